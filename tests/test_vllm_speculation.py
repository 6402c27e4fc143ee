"""Speculative decoding under vLLM: its n-gram proposer drafts, the scheduler schedules the
drafts, the runner verifies K + 1 tokens a row in one VF call and emits what vLLM's rejection
rule accepts. Greedy tokens equal transformers' with more requests than rows, prompts across
chunk and bucket edges, drafts accepted in whole, in part and not at all, an abort mid-verify,
preemption and prefix hits; seeded sampling is reproducible.

Exports: llama, 2 rows (paged: 4 rows, a pool of 9 blocks), S=128, chunk 32, K=4, eager (and xla:
vLLM 0.16.0, the graphs neuronx-cc would receive)."""

from __future__ import annotations

import pytest
import torch
from fixtures.export_models import BUCKETS, export_with
from vllm_stepper import Engine

from optimum_neuron_chunked.testing.reference import hf_greedy

K = 4
SPEC = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SHAPE = dict(sequence_length=128, prefill_chunk_size=32, context_buckets=BUCKETS, speculation_length=K)
BLOCKS = dict(SHAPE, batch_size=2, decode_widths=(1, 2))
PAGED = dict(SHAPE, batch_size=4, kv_cache_blocks=32, kv_block_size=16)


def repetitive(n: int, seed: int) -> torch.Tensor:
    """A prompt that repeats a span: the n-gram proposer finds drafts in it."""
    span = torch.randint(4, 380, (11,), generator=torch.Generator().manual_seed(seed))
    return span.repeat(n // 11 + 1)[:n]


def engine_for(export_dir, **engine_args) -> Engine:
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(export_dir), seed=0, speculative_config=SPEC, **engine_args)
    return Engine(export_dir, args.create_engine_config())


def run(engine: Engine, max_steps: int = 300) -> None:
    engine.step_until(lambda: not engine.scheduler.has_requests(), max_steps)


@pytest.fixture(
    params=[pytest.param("eager", id="eager"), pytest.param("xla", id="xla", marks=pytest.mark.xla)]
)
def whole_export(request):
    return export_with("llama", request.param, **BLOCKS)


def test_greedy_tokens_equal_transformers_with_the_proposers_drafts(whole_export, hf_reference):
    engine = engine_for(whole_export)
    prompts = {"a": repetitive(30, 1), "b": repetitive(45, 2), "c": repetitive(70, 3), "d": repetitive(9, 4)}
    for req_id, ids in prompts.items():  # four requests on two rows; c's prompt crosses two chunk edges
        engine.add(req_id, ids, max_tokens=24)
    run(engine)
    hf = hf_reference("llama")
    assert engine.tokens == {r: hf_greedy(hf, ids, 24) for r, ids in prompts.items()}
    assert engine.verified  # the n-gram proposer drafted from the repeated spans
    assert engine.free_blocks == 2


def test_drafts_accepted_in_whole_in_part_and_not_at_all(whole_export, hf_reference):
    """Drafts given to the scheduler in the proposer's place, cut from transformers' own answer
    and spoiled at a chosen draft: every verify emits the accepted drafts and the target's token."""
    hf = hf_reference("llama")
    prompts = {"a": repetitive(31, 5), "b": repetitive(58, 6), "c": repetitive(12, 7)}
    truth = {r: hf_greedy(hf, ids, 40) for r, ids in prompts.items()}
    engine = engine_for(whole_export)

    calls = dict.fromkeys(prompts, 0)

    def drafts_for(req_id: str, tokens: list[int]) -> list[int]:
        right = truth[req_id][len(tokens) : len(tokens) + K]
        calls[req_id] += 1
        spoil = calls[req_id] % (K + 1)  # the draft spoiled: 0, 1, ..., then none (all right)
        return [t if i != spoil else (t + 1) % 380 + 4 for i, t in enumerate(right)]

    engine.drafts_for = drafts_for
    for req_id, ids in prompts.items():
        engine.add(req_id, ids, max_tokens=40)
    run(engine)
    assert engine.tokens == truth
    outcomes = {(d, a) for _, d, a in engine.verified}
    assert (K, K) in outcomes and (K, 0) in outcomes and any(0 < a < d for d, a in outcomes), outcomes
    assert len(engine.verified) < 3 * 40 // 2  # whole rows of drafts were accepted
    assert engine.free_blocks == 2


def test_an_abort_mid_verify_leaves_the_others_exact(whole_export, hf_reference):
    engine = engine_for(whole_export)
    engine.add("a", repetitive(30, 4), max_tokens=30)
    engine.add("b", repetitive(40, 5), max_tokens=20)
    engine.step_until(lambda: any(r == "a" for r, _, _ in engine.verified))
    engine.abort("a")  # its drafts were verified, the next ones scheduled
    engine.add("c", repetitive(25, 6), max_tokens=12)  # takes a's row
    run(engine)
    hf = hf_reference("llama")
    assert engine.tokens["b"] == hf_greedy(hf, repetitive(40, 5), 20)
    assert engine.tokens["c"] == hf_greedy(hf, repetitive(25, 6), 12)
    assert engine.free_blocks == 2


@pytest.mark.parametrize("backend", [pytest.param("eager"), pytest.param("xla", marks=pytest.mark.xla)])
def test_preemption_and_prefix_hits_keep_the_tokens_exact(backend, hf_reference):
    """Paged: a pool too small for every request preempts and recomputes; a shared prefix is
    read from vLLM's cached blocks."""
    export_dir = export_with("llama", backend, **PAGED)
    engine = engine_for(export_dir, num_gpu_blocks_override=9, enable_prefix_caching=True)
    system = repetitive(48, 7)
    prompts = {f"r{i}": torch.cat([system, repetitive(4 + i, 8 + i)]) for i in range(4)}
    for req_id, ids in prompts.items():
        engine.add(req_id, ids, max_tokens=30)
    preempted, table = set(), []
    while engine.scheduler.has_requests():
        table.append(engine.step())
        preempted |= {r.request_id for r in engine.scheduler.requests.values() if r.num_preemptions}
    hf = hf_reference("llama")
    assert preempted and engine.verified
    assert engine.tokens == {r: hf_greedy(hf, ids, 30) for r, ids in prompts.items()}
    first = {}  # each request's first chunk: where its computing started
    for part in (p for row in table for p in row.split() if "[" in p):
        req_id, start = part.split("[")[0], int(part.split("[")[1].split(":")[0])
        first.setdefault(req_id, start)
    assert any(first[r] >= 16 for r in ("r1", "r2", "r3")), table  # a hit on r0's cached blocks
    assert engine.free_blocks == 8


def test_seeded_sampling_with_drafts_is_reproducible(whole_export):
    from vllm import SamplingParams

    def sample(seed: int) -> list[int]:
        engine = engine_for(whole_export)
        params = SamplingParams(max_tokens=24, temperature=0.8, top_k=20, seed=seed, ignore_eos=True)
        engine.add_request("a", repetitive(33, 9), params)
        engine.add("b", repetitive(20, 10), max_tokens=24)  # a greedy neighbour
        run(engine)
        assert any(r == "a" for r, _, _ in engine.verified)
        return engine.tokens["a"]

    first = sample(1234)
    assert sample(1234) == first and sample(99) != first


def test_vllm_serve_with_speculation_equals_transformers(tmp_path, hf_reference):
    """`vllm serve --speculative-config`: concurrent requests on more than the rows, the
    tokens transformers' and drafts counted by vLLM; nothing left behind at shutdown."""
    import json

    from optimum_neuron_chunked.testing.server import Server, concurrent_greedy_tokens

    export_dir = export_with("llama", "eager", **BLOCKS)
    server = Server(export_dir, tmp_path / "serve.log", "--speculative-config", json.dumps(SPEC)).wait_ready()
    try:
        prompts = [repetitive(n, 20 + n) for n in (9, 33, 50, 70)]
        got = concurrent_greedy_tokens(server.url, str(export_dir), [p.tolist() for p in prompts], 16)
        drafts = server.metrics().get("vllm:spec_decode_num_draft_tokens_total", 0.0)
    finally:
        assert server.stop() == [], "processes left behind after SIGTERM"
    hf = hf_reference("llama")
    assert got == [hf_greedy(hf, p, 16) for p in prompts]
    assert drafts > 0
