"""Narrow TG graphs (`decode_widths`): a decode step runs in the narrowest compiled width that
holds its rows, and what it computes equals HF transformers whatever width ran it."""

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
from helpers import RecordingGraphs, greedy_rows
from transformers import AutoModelForCausalLM

from optimum_neuron_chunked import NeuronModelForCausalLM
from optimum_neuron_chunked.config import NeuronConfig
from optimum_neuron_chunked.generation import prefill_prompt
from optimum_neuron_chunked.graph_runner import GraphRunner
from optimum_neuron_chunked.graphs import graph_specs

LOGITS_TOLERANCE = 1e-4


def test_each_step_runs_in_the_narrowest_width_that_holds_its_rows():
    cfg = NeuronConfig(batch_size=4, sequence_length=SEQUENCE_LENGTH, prefill_chunk_size=CHUNK,
                       context_buckets=BUCKETS, decode_widths=(1, 2, 4))  # fmt: skip
    calls = []

    def graph(name):
        def run(ids, positions, tables, params, rand):
            calls.append((name, tables[:, 0].tolist(), positions[:, 0].tolist()))
            return tables[:, 0].clone(), torch.zeros(ids.shape[0], 4)  # "samples" each row's block

        return run

    runner = GraphRunner(cfg, {s.name: graph(s.name) for s in graph_specs(cfg)})

    def step(blocks: list[int], positions: list[int]) -> list[int]:
        n = len(blocks)
        tables = torch.tensor([[s] for s in blocks])  # one whole-sequence block a row
        tokens, _ = runner.decode(
            torch.ones(n), torch.tensor(positions), tables, (torch.ones(n, 3), torch.zeros(n))
        )
        return tokens.tolist()

    assert step([3], [10]) == [3]
    assert step([0, 2], [5, 70]) == [0, 2]  # each row gets its own row's result back
    assert step([2, 0, 1], [70, 5, 9]) == [2, 0, 1]
    assert calls == [
        ("tg_w64_r1", [3], [10]),
        ("tg_w128_r2", [2, 0], [70, 5]),  # longest context first
        ("tg_w128", [2, 1, 0, 0], [70, 9, 5, 5]),  # padded to 4 by repeating the shortest row
    ]
    with pytest.raises(ValueError, match="1 to 4 rows"):
        step([0, 1, 2, 3, 3], [1, 1, 1, 1, 1])


@pytest.mark.parametrize("backend", ["eager", pytest.param("cpu", marks=pytest.mark.slow)])
def test_narrow_decode_steps_match_transformers(backend):
    path = checkpoint_path("llama")
    out = widths_export(backend)
    model = NeuronModelForCausalLM.from_pretrained(out)
    model.runner.graphs = RecordingGraphs(model.runner.graphs)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [torch.randint(4, 380, (n,), generator=torch.Generator().manual_seed(n)) for n in (20, 62)]
    seqs = [p.clone() for p in prompts]
    for block, p in enumerate(prompts):
        first = prefill_prompt(model.runner, p, (block,)).argmax()
        seqs[block] = torch.cat([p, first[None]])
    # both rows (the batch's width), then block 1 alone (width 1) into the second bucket, then both
    for blocks in ([0, 1], [1], [1], [0, 1]):
        last = torch.stack([seqs[s][-1] for s in blocks])
        positions = torch.tensor([len(seqs[s]) - 1 for s in blocks])
        tokens, logits = model.runner.decode(last, positions, [[s] for s in blocks], greedy_rows(len(blocks)))
        for row, s in enumerate(blocks):
            with torch.no_grad():
                want = hf(seqs[s][None]).logits[0, -1]
            torch.testing.assert_close(logits[row], want, atol=LOGITS_TOLERANCE, rtol=0)
            assert int(tokens[row]) == int(want.argmax())
            seqs[s] = torch.cat([seqs[s], tokens[row : row + 1]])
    assert [n for n in model.runner.graphs.ran if n.startswith("tg")] == [
        "tg_w64", "tg_w64_r1", "tg_w128_r1", "tg_w128",
    ]  # fmt: skip
