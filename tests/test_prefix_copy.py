"""The copy graph: a prefix copied from one whole-sequence block into another is exactly what computing it
there would have written, on every backend that runs here (cpu: AOTInductor, in place)."""

from __future__ import annotations

import pytest
import torch
from fixtures.export_models import CHUNK
from helpers import export_params, greedy_rows, prompt

from optimum_neuron_chunked.generation import prefill_prompt

EXPORTS = ["llama-2x4x32-eager", "llama-2x4x32-cpu", "qwen3_moe-2x4x32-cpu"]


@pytest.mark.parametrize("export_dir", export_params(EXPORTS), indirect=True)
@pytest.mark.parametrize("hit", [CHUNK - 7, 2 * CHUNK, 3 * CHUNK + 5])
def test_a_copied_prefix_equals_the_computed_one(export_dir, neuron_model, hf_reference, hit):
    hf = hf_reference(neuron_model.config.model_type)
    shared = prompt(3 * CHUNK + 5, seed=60)
    ids = torch.cat([shared[:hit], prompt(20, seed=61)])
    prefill_prompt(neuron_model.runner, shared, (0,))
    prefill_prompt(neuron_model.runner, prompt(100, seed=62), (1,))  # stale K/V the copy must replace
    calls = neuron_model.runner.copy_prefix(0, 1, hit)
    assert calls == -(-hit // CHUNK)
    logits = None
    for start in range(hit, len(ids), CHUNK):
        logits = neuron_model.runner.prefill(ids[start : start + CHUNK], start, blocks=(1,))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0, -1].float()
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    # and the decode graph reads the copied positions too
    tokens, _ = neuron_model.runner.decode(
        torch.tensor([int(logits.argmax())]), torch.tensor([len(ids)]), [[1]], greedy_rows(1)
    )
    with torch.no_grad():
        expected_next = hf(torch.cat([ids, logits.argmax()[None]])[None]).logits[0, -1].argmax()
    assert int(tokens[0]) == int(expected_next)


def test_copy_is_refused_by_standard_exports_and_checks_its_length_and_blocks():
    from optimum_neuron_chunked.config import NeuronConfig
    from optimum_neuron_chunked.graph_runner import GraphRunner
    from optimum_neuron_chunked.graphs import graph_specs

    def runner(**options) -> GraphRunner:  # the export's graph set, never called
        config = NeuronConfig(batch_size=2, sequence_length=128, **options)
        return GraphRunner(config, {s.name: None for s in graph_specs(config)})

    with pytest.raises(ValueError, match="chunked"):
        runner().copy_prefix(0, 1, 10)
    chunked = runner(prefill_chunk_size=32)
    with pytest.raises(ValueError, match="exceed"):
        chunked.copy_prefix(0, 1, 129)
    with pytest.raises(ValueError, match="must hold pool blocks 0..1"):
        chunked.copy_prefix(0, 2, 50)  # block 2 is outside the pool: refused before any call
    assert chunked.copy_prefix(1, 1, 50) == 0  # same block: nothing to copy
