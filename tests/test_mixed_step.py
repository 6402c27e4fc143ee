"""Mixed steps (`mixed_step` exports): a step's decode rows and a full prefill chunk of another
request run in one MX graph call. What it computes equals HF transformers, the runner fuses
exactly the chunks it should, and vLLM's scheduler driving it gives HF's tokens."""

from __future__ import annotations

import pytest
import torch
from fixtures.export_models import (
    BUCKETS,
    CHUNK,
    SEQUENCE_LENGTH,
    checkpoint_path,
    export_with,
    widths_export,
)
from helpers import RecordingGraphs, prompt
from transformers import AutoModelForCausalLM

from optimum_neuron_chunked import NeuronModelForCausalLM
from optimum_neuron_chunked.config import NeuronConfig, NeuronConfigError
from optimum_neuron_chunked.generation import prefill_prompt
from optimum_neuron_chunked.graph_runner import GraphRunner
from optimum_neuron_chunked.graphs import graph_specs
from optimum_neuron_chunked.testing.reference import hf_greedy
from optimum_neuron_chunked.vllm.step_plan import DecodeRow, PrefillChunk, StepPlan, describe, fuse_chunk

LOGITS_TOLERANCE = 1e-4


def _plan(decodes: int, *chunk_lengths: int, ids=("b", "c", "d")) -> StepPlan:
    rows = tuple(DecodeRow(f"r{i}", (i,), 1, 10) for i in range(decodes))
    chunks = tuple(
        PrefillChunk(ids[i], (10 + i,), 0, (1,) * n, samples=False) for i, n in enumerate(chunk_lengths)
    )
    return StepPlan(rows, chunks)


BATCH = (8,)  # decode widths: the batch alone


def test_the_first_full_chunk_runs_with_the_decodes():
    assert fuse_chunk(_plan(2, 32), 32, BATCH).fused == 0
    assert fuse_chunk(_plan(2, 5, 32, 32), 32, BATCH).fused == 1  # the first full one
    plan = fuse_chunk(_plan(1, 32, 7), 32, BATCH)
    assert [c.req_id for c in plan.separate_chunks] == ["c"]
    assert describe(plan) == "1 decodes + b[0:32] c[0:7] (decodes with b[0:32] in one call)"


def test_no_fusing_without_decodes_short_chunks_or_for_prompt_logprobs():
    assert fuse_chunk(_plan(0, 32), 32, BATCH).fused is None  # a prefill-only step keeps CP
    assert fuse_chunk(_plan(2, 31), 32, BATCH).fused is None  # MX would compute the padding
    assert fuse_chunk(_plan(2, 32), 32, BATCH, apart=frozenset({"b"})).fused is None  # every position
    assert fuse_chunk(_plan(2, 32, 32), 32, BATCH, apart=frozenset({"b"})).fused == 1


def test_decodes_that_fit_a_narrower_tg_graph_keep_it():
    """With decode widths 4 and 8, up to 4 decodes run in the 4-row TG: MX would pad them to 8."""
    assert fuse_chunk(_plan(4, 32), 32, (4, 8)).fused is None
    assert fuse_chunk(_plan(5, 32), 32, (4, 8)).fused == 0
    assert fuse_chunk(_plan(1, 32), 32, (8,)).fused == 0


def test_mixed_step_needs_a_chunked_export():
    with pytest.raises(NeuronConfigError, match="--prefill-chunk-size"):
        NeuronConfig(batch_size=2, sequence_length=SEQUENCE_LENGTH, mixed_step=True)


def test_a_mixed_call_runs_in_the_bucket_that_covers_both_parts():
    cfg = NeuronConfig(batch_size=2, sequence_length=SEQUENCE_LENGTH, prefill_chunk_size=CHUNK,
                       context_buckets=BUCKETS, mixed_step=True)  # fmt: skip
    assert [s.name for s in graph_specs(cfg) if s.kind == "mx"] == ["mx_w64", "mx_w128"]
    calls = []

    def graph(name):
        def run(ids, pos, tables, chunk_ids, chunk_pos, chunk_tables, params, rand):
            calls.append(
                (
                    name,
                    tables.tolist(),
                    pos[:, 0].tolist(),
                    chunk_tables.tolist(),
                    chunk_pos[0, [0, -1]].tolist(),
                )
            )
            return torch.arange(ids.shape[0]), torch.zeros(ids.shape[0], 4), torch.ones(1, 4)

        return run

    runner = GraphRunner(cfg, {s.name: graph(s.name) for s in graph_specs(cfg)})

    def step(block: int, position: int, chunk_start: int, chunk_block: int, tokens: int = CHUNK):
        one = torch.ones(1)
        return runner.decode_with_chunk(one, torch.tensor([position]), [[block]], (torch.ones(1, 3), one),
                                        torch.ones(tokens), chunk_start, (chunk_block,))  # fmt: skip

    tokens, _, chunk_logits = step(0, 10, 0, 1)
    assert tokens.tolist() == [0] and chunk_logits.tolist() == [1.0] * 4
    step(0, 70, 0, 1)  # the decode row needs the larger bucket
    step(0, 10, 64, 1)  # the chunk does
    assert calls == [
        ("mx_w64", [[0], [0]], [10, 10], [[1]], [0, 31]),  # one decode row padded to the batch
        ("mx_w128", [[0], [0]], [70, 70], [[1]], [0, 31]),
        ("mx_w128", [[0], [0]], [10, 10], [[1]], [64, 95]),
    ]
    with pytest.raises(ValueError, match="full chunk"):
        step(0, 10, 0, 1, tokens=CHUNK - 1)
    with pytest.raises(ValueError, match="writing other blocks"):
        step(1, 10, 0, 1)


@pytest.mark.parametrize("backend", ["eager", pytest.param("cpu", marks=pytest.mark.slow)])
def test_mixed_steps_match_transformers(backend):
    """Block 0 decodes while block 1's prompt is prefilled in full chunks in the same calls."""
    path = checkpoint_path("llama")
    out = widths_export(backend)
    model = NeuronModelForCausalLM.from_pretrained(out)
    model.runner.graphs = RecordingGraphs(model.runner.graphs)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    a, b = prompt(40, seed=3), prompt(3 * CHUNK, seed=4)
    seq = torch.cat([a, prefill_prompt(model.runner, a, (0,)).argmax()[None]])
    for start in range(0, b.shape[0], CHUNK):
        tokens, logits, chunk_logits = model.runner.decode_with_chunk(
            seq[-1:], torch.tensor([len(seq) - 1]), [[0]], (torch.ones(1, 3), torch.zeros(1)),
            b[start : start + CHUNK], start, (1,),
        )  # fmt: skip
        with torch.no_grad():
            want = hf(seq[None]).logits[0, -1]
            want_chunk = hf(b[None, : start + CHUNK]).logits[0, -1]
        torch.testing.assert_close(logits[0], want, atol=LOGITS_TOLERANCE, rtol=0)
        torch.testing.assert_close(chunk_logits, want_chunk, atol=LOGITS_TOLERANCE, rtol=0)
        assert int(tokens[0]) == int(want.argmax())
        seq = torch.cat([seq, tokens])
    # b's third chunk (positions 64..95) crosses into the second bucket
    assert [n for n in model.runner.graphs.ran if n.startswith("mx")] == ["mx_w64", "mx_w64", "mx_w128"]


@pytest.fixture(scope="module")
def mixed_export():
    return export_with("llama", "eager", batch_size=2, sequence_length=SEQUENCE_LENGTH, prefill_chunk_size=CHUNK,
                       context_buckets=BUCKETS, mixed_step=True)  # fmt: skip


@pytest.mark.parametrize("sampling", [{}, {"logprobs": 2}], ids=["on-device", "host-sampled"])
def test_vllm_runs_a_decode_and_each_full_chunk_in_one_call(mixed_export, hf_reference, sampling):
    """Host-sampled: a's logprobs need its logits, fetched from the MX call's decode rows."""
    from vllm_stepper import Engine

    engine = Engine(mixed_export)
    engine.worker.runner.graph_runner.graphs = graphs = RecordingGraphs(
        engine.worker.runner.graph_runner.graphs
    )
    a, b = prompt(5, seed=10), prompt(100, seed=11)
    engine.add("a", a, max_tokens=9, **sampling)
    engine.step(), engine.step()
    engine.add("b", b, max_tokens=3)
    fused = []
    while engine.scheduler.has_requests():
        graphs.ran.clear()
        table = engine.step()
        plan = engine.worker.runner.last_plan
        if plan is not None and plan.fused is not None:
            fused.append((table, [n for n in graphs.ran if not n.startswith("copy")]))
    assert fused == [  # the last, partial chunk b[96:100] runs its own CP call beside a's TG
        ("a | b[0:32]", ["mx_w64"]),
        ("a | b[32:64]", ["mx_w64"]),
        ("a | b[64:96]", ["mx_w128"]),
    ]
    hf = hf_reference("llama")
    assert engine.tokens == {"a": hf_greedy(hf, a, 9), "b": hf_greedy(hf, b, 3)}
    assert engine.free_blocks == 2
