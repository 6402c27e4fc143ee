"""Which KV-cache pool block a request's KV block stands for, while prefix caching is on (pure).

vLLM's block pool hands out the most recently freed block first (blocks without a hash go to
the front of the free queue: `BlockPool.free_blocks`, vllm/v1/core/block_pool.py, 0.32). With
kv_blocks.pool_block that evicts the freshest cached prefix first - the one a chat's next turn
is most likely to need. So with prefix caching the connector maps blocks to pool blocks itself:
a new request gets the free pool block that holds the longest prefix of its prompt (pool block affinity:
no copy), else the pool block freed longest ago (LRU eviction). The map reaches the runner with the
step's `PrefixCopies`; without prefix caching the pool block stays kv_blocks.pool_block.
"""

from __future__ import annotations

from collections.abc import Callable


class BlockAssignment:
    """Live block id -> pool block, and the free pool blocks, least recently freed first."""

    def __init__(self, num_blocks: int):
        self._pool_block_of: dict[int, int] = {}
        self._free: list[int] = list(range(num_blocks))

    def pool_block_of(self, block: int) -> int | None:
        return self._pool_block_of.get(block)

    def assign(self, block: int, shared: Callable[[int], int]) -> int:
        """A pool block for a block vLLM just allocated. `shared(pool block)`: how many leading tokens of the
        new request's prompt the pool block holds (0 when too few to reuse). The block must not be
        mapped (release its pool block first)."""
        if block in self._pool_block_of:
            raise ValueError(f"block {block} already stands for pool block {self._pool_block_of[block]}")
        if not self._free:
            raise RuntimeError(f"no free pool block for block {block}: more live blocks than pool blocks")
        # max() keeps the first of equal keys: the least recently freed among equals
        pool_block = max(self._free, key=shared)
        self._free.remove(pool_block)
        self._pool_block_of[block] = pool_block
        return pool_block

    def release(self, pool_block: int) -> None:
        """The pool block's request ended (or lost its block): the pool block is free, most recently freed."""
        blocks = [b for b, s in self._pool_block_of.items() if s == pool_block]
        for block in blocks:
            del self._pool_block_of[block]
            self._free.append(pool_block)
