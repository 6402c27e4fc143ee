"""A request's KV blocks as vLLM's scheduler hands them out, and what the graphs take (pure).

vLLM's KV cache manager allocates the export's blocks of P tokens (one per request where a
block is a whole sequence), shares prefix-cached ones between requests and frees them. vLLM
keeps block 0 as its null block (`BlockPool`, vllm/v1/core/block_pool.py, 0.16.0 and 0.32),
so vLLM's block b is the export's pool block b - 1 (`pool_block`) and vLLM counts one block more
than the pool (`vllm_num_blocks`): the one place that rule is written. The runner follows vLLM's GPU runner (`GPUModelRunner._update_states`,
vllm/v1/worker/gpu_model_runner.py, same rule in 0.16.0 and 0.32): a running request's
`new_block_ids` are appended, a request resumed after preemption (`CachedRequestData.
resumed_req_ids`, vllm/v1/core/sched/output.py, both releases) gets its list replaced.
"""

from __future__ import annotations

BlockIds = tuple[list[int], ...]  # per KV-cache group, as vLLM's SchedulerOutput carries them


def pool_block(block: int) -> int:
    """The export's pool block that vLLM's block `block` stands for (block 0: vLLM's null block)."""
    return block - 1


def vllm_num_blocks(pool_blocks: int) -> int:
    """vLLM's num_blocks for `pool_blocks` of the export's pool: one more, its null block."""
    return pool_blocks + 1


def pool_blocks(vllm_blocks: int) -> int:
    """The pool blocks vLLM's `vllm_blocks` (its null block counted) hand out."""
    return vllm_blocks - 1


def next_block_ids(current: BlockIds, new: BlockIds | None, resumed: bool) -> BlockIds:
    """A scheduled cached request's blocks after this step's allocation. Fresh lists: vLLM's
    in-process scheduler may hand the same list objects to several outputs."""
    if new is None:
        return current
    if resumed:
        return tuple(list(group) for group in new)
    if len(new) != len(current):
        raise RuntimeError(f"{len(new)} KV-cache groups of new blocks for a request with {len(current)}")
    return tuple([*held, *added] for held, added in zip(current, new, strict=True))


def dropped(block_ids: BlockIds) -> BlockIds:
    """A preempted request's blocks: vLLM freed them (its resumption brings new ones)."""
    return tuple([] for _ in block_ids)


def request_blocks(block_ids: BlockIds) -> list[int]:
    """A request's vLLM block ids (one KV-cache group for every layer)."""
    (blocks,) = block_ids
    if not blocks:
        raise RuntimeError("a scheduled request holds no KV block: vLLM allocates before scheduling")
    return blocks
