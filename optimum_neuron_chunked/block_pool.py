"""The KV pool's blocks for requests the host runs itself (generate()). vLLM allocates the
blocks of the requests it serves (vllm/kv_blocks.py)."""

from __future__ import annotations

from collections.abc import Sequence

from .modeling.kv_layout import KVPool


class NoFreeBlockError(RuntimeError):
    """Fewer free KV blocks than a request needs."""


class BlockPool:
    """The free blocks of an export's pool (modeling/kv_layout.KVPool), ids 0..num_blocks - 1:
    one block per request where a block is a whole sequence."""

    def __init__(self, pool: KVPool):
        self._free = list(range(pool.num_blocks))
        self.pool, self.num_blocks = pool, pool.num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self, positions: int) -> tuple[int, ...]:
        """Blocks for `positions` positions (one per P positions, rounded up; at least one)."""
        n = max(1, self.pool.blocks_holding(positions))
        if n > len(self._free):
            raise NoFreeBlockError(
                f"{n} KV blocks wanted, {len(self._free)} of {self.num_blocks} free (the pool holds "
                "--kv-cache-blocks blocks, or one per --batch_size row)"
            )
        blocks, self._free = tuple(self._free[:n]), self._free[n:]
        return blocks

    def release(self, blocks: Sequence[int]) -> None:
        if any(not 0 <= b < self.num_blocks or b in self._free for b in blocks):
            raise ValueError(f"blocks {list(blocks)} are not all in use")
        self._free = sorted(self._free + list(blocks))
