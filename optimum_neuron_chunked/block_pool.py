"""The KV pool's blocks for requests the host runs itself (generate()). vLLM allocates the
blocks of the requests it serves (vllm/kv_blocks.py)."""

from __future__ import annotations

from collections.abc import Sequence


class NoFreeBlockError(RuntimeError):
    """Fewer free KV blocks than a request needs."""


class BlockPool:
    """The export's pool of `num_blocks` blocks of `block_size` positions, ids 0..num_blocks - 1
    (NeuronConfig.kv_pool_blocks, kv_block_positions): one block per request where a block
    is a whole sequence."""

    def __init__(self, num_blocks: int, block_size: int):
        self._free = list(range(num_blocks))
        self.num_blocks, self.block_size = num_blocks, block_size

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self, positions: int) -> tuple[int, ...]:
        """Blocks for `positions` positions (one per block_size, rounded up; at least one)."""
        n = max(1, -(-positions // self.block_size))
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
