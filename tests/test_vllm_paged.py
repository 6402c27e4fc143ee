"""Paged exports under vLLM: its KV cache manager allocates the export's blocks (shared by its
prefix cache, freed on finish, abort and preemption) and the runner hands each request's block
ids to the graphs. Tokens equal HF's greedy tokens; the pool ends with every block free.

The export: llama, 4 decode rows, S=128, chunk 32, a pool of 32 blocks of 16 positions.
"""

from __future__ import annotations

import pytest
import torch
from fixtures.export_models import BUCKETS, export_with
from helpers import generate, greedy, prompt
from vllm_stepper import Engine

from optimum_neuron_chunked.graph_inputs import block_table
from optimum_neuron_chunked.testing.reference import hf_greedy
from optimum_neuron_chunked.vllm.kv_blocks import dropped, next_block_ids, request_blocks

BLOCK, BLOCKS = 16, 32
PAGED = dict(
    batch_size=4,
    sequence_length=128,
    prefill_chunk_size=32,
    context_buckets=BUCKETS,
    kv_cache_blocks=BLOCKS,
    kv_block_size=BLOCK,
)
VARIANTS = [
    pytest.param(("eager", False), id="eager"),
    pytest.param(("eager", True), id="eager-mixed-step"),  # a chunk rides with the decodes (MX)
]
SERVED = [
    pytest.param(("eager", False), id="eager"),
    pytest.param(("xla", False), id="xla", marks=pytest.mark.xla),  # the graphs neuronx-cc gets
]


@pytest.fixture
def export_dir(request):
    """The (cached) paged export of the llama checkpoint: (backend, mixed_step) `request.param`."""
    backend, mixed = getattr(request, "param", ("eager", False))
    return export_with("llama", backend, **PAGED, **({"mixed_step": True} if mixed else {}))


def engine_for(export_dir, **cache) -> Engine:
    from vllm.config import CacheConfig, ModelConfig, VllmConfig

    model = ModelConfig(model=str(export_dir), dtype="float32", seed=0)
    return Engine(export_dir, VllmConfig(model_config=model, cache_config=CacheConfig(**cache)))


def run(engine: Engine) -> list[str]:
    table = []
    while engine.scheduler.has_requests():
        table.append(engine.step())
    return table


def first_chunk(table: list[str], req_id: str) -> str:
    return next(part for row in table for part in row.split() if part.startswith(f"{req_id}["))


def joined(*parts) -> torch.Tensor:
    return torch.cat([torch.as_tensor(p) for p in parts])


def free_blocks(engine: Engine) -> int:
    """Blocks vLLM can hand out (cached ones with no request count: they are evictable)."""
    return engine.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


# -- block bookkeeping (pure) -----------------------------------------------------------------


def test_new_blocks_append_and_a_resumed_request_gets_its_list_replaced():
    held = ([3, 7],)
    assert next_block_ids(held, None, resumed=False) == ([3, 7],)
    assert next_block_ids(held, ([9],), resumed=False) == ([3, 7, 9],)
    assert next_block_ids(held, ([4, 5],), resumed=True) == ([4, 5],)
    assert held == ([3, 7],)  # fresh lists: vLLM's may be shared
    assert dropped(held) == ([],)
    assert request_blocks(([4, 5, 1],)) == [4, 5, 1]
    with pytest.raises(RuntimeError, match="no KV block"):
        request_blocks(([],))


def test_block_tables_are_cut_or_padded_by_repeating_each_rows_last_block():
    table = block_table([(3, 7, 9), (5,), (2, 4), (0,)], 4)
    assert table.dtype == torch.int32
    assert table.tolist() == [[3, 7, 9, 9], [5, 5, 5, 5], [2, 4, 4, 4], [0, 0, 0, 0]]
    assert block_table([(3, 7, 9), (5,)], 2).tolist() == [[3, 7], [5, 5]]


def test_paged_limits_give_vllm_the_pool_and_honour_a_smaller_override():
    from optimum_neuron_chunked.config import NeuronConfig
    from optimum_neuron_chunked.vllm.limits import EngineRequest, ServingConfigError, serving_limits

    config = NeuronConfig(backend="eager", **PAGED)

    def limits(**kw):
        base = dict(max_model_len=None, max_num_seqs=None, max_num_batched_tokens=None)
        return serving_limits(
            config, EngineRequest(**base, long_prefill_token_threshold=0, dtype="float32", **kw)
        )

    assert (limits().block_size, limits().num_blocks) == (BLOCK, BLOCKS + 1)  # + vLLM's null block
    assert limits(num_gpu_blocks_override=9).num_blocks == 9
    with pytest.raises(ServingConfigError, match="--num-gpu-blocks-override 34"):
        limits(num_gpu_blocks_override=BLOCKS + 2)
    with pytest.raises(ServingConfigError, match="--max-model-len 128 needs 8 KV blocks"):
        limits(num_gpu_blocks_override=8)  # 7 usable blocks hold 112 positions


def test_paged_plans_keep_the_scheduler_order_between_chunks():
    """A request admitted this step may read blocks an earlier chunk of the step writes (a prefix
    hit on blocks vLLM cached when it allocated them): paged plans fuse their first chunk only,
    and run such a request's one-token piece as a chunk, not in the TG call ahead of the chunks."""
    from optimum_neuron_chunked.vllm.step_plan import ScheduledWork, fuse_chunk, plan_step

    work = [
        ScheduledWork("d", (1,), 5, (7,), 5, 6),
        ScheduledWork("x", (2, 3), 16, tuple(range(8)), 30, 30),
        ScheduledWork("y", (2, 4), 24, tuple(range(32)), 70, 70),  # reads block 2 x writes
    ]
    plan = plan_step(work, 32, 4)
    assert fuse_chunk(plan, 32, (4,), in_order=True).fused is None
    assert (
        fuse_chunk(plan, 32, (4,)).fused == 1
    )  # whole-sequence-block exports: no request reads another's block
    # resumed with all but its last token hit, on blocks x writes this step: a chunk after x's
    resumed = ScheduledWork("r", (2, 3, 5), 47, (9,), 30, 48, after_earlier_chunks=True)
    plan = plan_step([*work, resumed], 32, 4)
    assert [d.req_id for d in plan.decodes] == ["d"]
    assert [(c.req_id, c.start, c.samples) for c in plan.chunks][-1] == ("r", 47, True)


# -- vLLM's scheduler and KV cache manager driving the export ------------------------------------


def test_the_platform_hands_vllm_the_block_pool_and_its_own_prefix_cache(export_dir):
    from optimum_neuron_chunked.vllm.platform import NeuronChunkedPlatform

    engine = engine_for(export_dir)
    NeuronChunkedPlatform.check_and_update_config(engine.worker.vllm_config)  # the engine core's call
    cache = engine.worker.vllm_config.cache_config
    assert (cache.block_size, cache.num_gpu_blocks_override) == (BLOCK, BLOCKS + 1)
    connector = engine.worker.vllm_config.kv_transfer_config
    assert cache.enable_prefix_caching and connector.kv_connector == "PrefixWaitConnector"
    assert engine.worker.vllm_config.scheduler_config.max_num_seqs == 4
    assert free_blocks(engine) == BLOCKS


@pytest.mark.parametrize("export_dir", VARIANTS, indirect=True)
def test_concurrent_requests_across_chunk_and_block_edges_equal_transformers(export_dir, hf_reference):
    engine = engine_for(export_dir)
    prompts = {f"r{n}": prompt(n, seed=70 + n) for n in (1, 15, 17, 33, 70, 100)}  # 6 on 4 rows
    for req_id, ids in prompts.items():
        engine.add(req_id, ids, max_tokens=8)  # 15 + 8 and 17 + 8 cross a block edge decoding
    table, addressed = [], set()
    while engine.scheduler.has_requests():
        table.append(engine.step())
        plan = engine.worker.runner.last_plan
        for work in (*plan.decodes, *plan.chunks) if plan else ():
            if work.req_id in engine.scheduler.requests:  # vLLM's block b is the pool's b - 1
                (held,) = engine.scheduler.kv_cache_manager.get_block_ids(work.req_id)
                assert work.blocks == tuple(b - 1 for b in held), work
            addressed |= set(work.blocks)
    assert 0 in addressed and max(addressed) < BLOCKS  # the pool's ids, 0..BLOCKS - 1
    starts = [int(part.split("[")[1].split(":")[0]) for row in table for part in row.split() if "[" in part]
    assert any(start % BLOCK for start in starts if start)  # a chunk resumed mid-block
    hf = hf_reference("llama")
    assert engine.tokens == {r: hf_greedy(hf, ids, 8) for r, ids in prompts.items()}
    assert free_blocks(engine) == BLOCKS


def test_more_requests_than_the_pool_holds_are_preempted_and_recomputed(export_dir, hf_reference):
    engine = engine_for(export_dir, num_gpu_blocks_override=9)  # 8 usable blocks: 128 positions
    prompts = {f"r{i}": prompt(40 + i, seed=80 + i) for i in range(4)}  # each grows to 5-6 blocks
    for req_id, ids in prompts.items():
        engine.add(req_id, ids, max_tokens=40)
    preempted = set()
    while engine.scheduler.has_requests():
        engine.step()
        preempted |= {r.request_id for r in engine.scheduler.requests.values() if r.num_preemptions}
    assert preempted
    hf = hf_reference("llama")
    assert engine.tokens == {r: hf_greedy(hf, ids, 40) for r, ids in prompts.items()}
    assert free_blocks(engine) == 8


def test_a_shared_prefix_is_read_from_vllms_cached_blocks(export_dir, hf_reference):
    system = prompt(70, seed=90)  # 4 full blocks, and 6 positions of a fifth
    a, b, c = (joined(system, prompt(n, seed=91 + n)) for n in (10, 20, 30))
    engine = engine_for(export_dir)
    engine.add("a", a, max_tokens=4)
    engine.step()
    engine.add("b", b, max_tokens=4)
    # a hit on a's first 4 blocks: vLLM caches a block once allocated to a scheduled chunk, so on
    # 0.16.0 (one chunk a step) b reads blocks 2-3 in the step a's chunk writes them
    assert first_chunk(run(engine), "b") == "b[64:90]"
    engine.add("c", c, max_tokens=4)  # a and b finished: their blocks are free, still cached
    assert first_chunk(run(engine), "c") == "c[64:96]"
    hf = hf_reference("llama")
    assert engine.tokens == {r: hf_greedy(hf, ids, 4) for r, ids in {"a": a, "b": b, "c": c}.items()}
    assert free_blocks(engine) == BLOCKS


def test_a_request_waits_for_the_blocks_a_running_prefill_shares_with_it(export_dir, hf_reference):
    """b arrives with a, sharing a's first 70 tokens: rather than compute blocks 2-3 itself
    beside a (vLLM's cache alone hits only the blocks scheduled so far), b waits until a's chunk
    writing them is scheduled, then hits all 4 full blocks."""
    system = prompt(70, seed=97)
    a, b = joined(system, prompt(30, seed=98)), joined(system, prompt(10, seed=99))
    engine = engine_for(export_dir)
    engine.add("a", a, max_tokens=4)
    engine.add("b", b, max_tokens=4)
    table = run(engine)
    assert "b[" not in table[0]  # a computes [0:32] first, b waits
    assert first_chunk(table, "b") == "b[64:80]"
    hf = hf_reference("llama")
    assert engine.tokens == {"a": hf_greedy(hf, a, 4), "b": hf_greedy(hf, b, 4)}
    assert free_blocks(engine) == BLOCKS


def test_abort_mid_prefill_leaks_no_block(export_dir, hf_reference):
    engine = engine_for(export_dir)
    a, b = prompt(100, seed=95), prompt(20, seed=96)
    engine.add("a", a, max_tokens=4)
    engine.add("b", b, max_tokens=4)
    engine.step()
    assert free_blocks(engine) < BLOCKS
    engine.abort("a")  # mid-prefill: some of its blocks are computed, the rest allocated
    run(engine)
    assert engine.tokens["b"] == hf_greedy(hf_reference("llama"), b, 4)
    assert free_blocks(engine) == BLOCKS
    assert engine.scheduler.kv_cache_manager.usage == 0
    assert not engine.worker.runner.batch.requests  # the runner dropped both block lists


@pytest.mark.parametrize("export_dir", SERVED, indirect=True)
def test_vllm_serves_a_paged_export_with_prefix_hits(export_dir, hf_reference):
    """vLLM's own engine core (not the stepper) sizes the pool from the platform's settings,
    hashes blocks and reports the hits; the tokens equal transformers'."""
    from vllm import LLM

    system = prompt(70, seed=97)
    prompts = [joined(system, prompt(n, seed=98 + n)) for n in (10, 20)] + [prompt(100, seed=99)]
    llm = LLM(model=str(export_dir), seed=0)
    try:
        first = generate(llm, prompts[:1], greedy(6))
        rest = llm.generate([{"prompt_token_ids": p.tolist()} for p in prompts[1:]], greedy(6))
    finally:
        llm.llm_engine.engine_core.shutdown()
    hf = hf_reference("llama")
    tokens = [list(o.token_ids) for o in first] + [list(o.outputs[0].token_ids) for o in rest]
    assert tokens == [hf_greedy(hf, p, 6) for p in prompts]
    assert [o.num_cached_tokens for o in rest] == [64, 0]  # 4 of a's blocks
