"""Narrow CP graphs (`prefill_widths`): a chunk runs in the narrowest compiled width that holds
it, and what it computes equals HF transformers whatever width ran it."""

from __future__ import annotations

import pytest
import torch
from fixtures.export_models import (
    BUCKETS,
    CHUNK,
    SEQUENCE_LENGTH,
    checkpoint_path,
    widths_export,
)
from helpers import greedy_rows
from transformers import AutoModelForCausalLM

from optimum_neuron_chunked import NeuronModelForCausalLM
from optimum_neuron_chunked.config import NeuronConfig
from optimum_neuron_chunked.graph_runner import GraphRunner
from optimum_neuron_chunked.graphs import graph_specs

WIDTHS = (8, 16, CHUNK)
# chunk lengths over one prompt: every width, a chunk crossing into the second bucket
CHUNKS = (CHUNK, 5, 16, 9, CHUNK, 1, 20)
LOGITS_TOLERANCE = 1e-4


def config(**kw) -> NeuronConfig:
    base = dict(
        batch_size=2, sequence_length=SEQUENCE_LENGTH, prefill_chunk_size=CHUNK, context_buckets=BUCKETS
    )
    return NeuronConfig(**(base | kw))


def test_each_chunk_runs_in_the_narrowest_width_that_holds_it():
    cfg = config(prefill_widths=WIDTHS)
    calls = []

    def graph(name):
        def run(ids, positions, tables):
            calls.append((name, ids.shape[1], positions[0, -1].item()))
            return torch.zeros(1, 4)

        return run

    runner = GraphRunner(cfg, {s.name: graph(s.name) for s in graph_specs(cfg)})
    start = 0
    for n in CHUNKS:
        runner.prefill(torch.arange(n), start, blocks=(0,))
        start += n
    assert calls == [
        ("cp_w64", 32, 31),
        ("cp_w64_c8", 8, 36),  # 5 tokens, padded by repeating the last position
        ("cp_w64_c16", 16, 52),
        ("cp_w64_c16", 16, 61),
        ("cp_w128", 32, 93),
        ("cp_w128_c8", 8, 94),
        ("cp_w128", 32, 114),
    ]
    with pytest.raises(ValueError, match="1 to 32 tokens"):
        runner.prefill(torch.arange(CHUNK + 1), 0, blocks=(0,))


def prefill_in_chunks(model: NeuronModelForCausalLM, ids: torch.Tensor, block: int) -> list[torch.Tensor]:
    """The logits after each chunk of CHUNKS."""
    out, start = [], 0
    for n in CHUNKS:
        out.append(model.runner.prefill(ids[start : start + n], start, (block,)))
        start += n
    return out


@pytest.mark.parametrize("backend", ["eager", pytest.param("cpu", marks=pytest.mark.slow)])
def test_narrow_chunks_match_transformers(backend):
    path = checkpoint_path("llama")
    out = widths_export(backend)
    model = NeuronModelForCausalLM.from_pretrained(out)
    assert {s.name for s in graph_specs(model.neuron_config)} >= {"cp_w64_c8", "cp_w128_c16"}
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(4, 380, (sum(CHUNKS),), generator=torch.Generator().manual_seed(3))
    got = prefill_in_chunks(model, ids, block=1)
    ends = torch.tensor(CHUNKS).cumsum(0).tolist()
    with torch.no_grad():
        logits = hf(ids[None]).logits[0]
    for end, row in zip(ends, got, strict=True):
        torch.testing.assert_close(row, logits[end - 1], atol=LOGITS_TOLERANCE, rtol=0)
    # and a greedy decode reads what the narrow chunks wrote
    first = logits[-1].argmax()
    tokens, _ = model.runner.decode(first[None], torch.tensor([ends[-1]]), [[1]], greedy_rows(1))
    with torch.no_grad():
        want = hf(torch.cat([ids, first[None]])[None]).logits[0, -1].argmax()
    assert tokens.tolist() == [int(want)]
