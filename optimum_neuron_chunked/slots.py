"""KV-cache slots (each live request owns one row of the static cache) and, for paged
exports, blocks of the shared pool."""

from __future__ import annotations

from collections.abc import Sequence

import torch

PAD_BLOCK = 0  # vLLM's null block: right-pads block-table rows (never read: positions mask it)


class NoFreeSlotError(RuntimeError):
    pass


class SlotPool:
    def __init__(self, num_slots: int):
        self._free = list(range(num_slots))
        self.num_slots = num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self, positions: int = 0) -> int:
        """A free slot: it holds a whole sequence, whatever `positions` it will write."""
        if not self._free:
            raise NoFreeSlotError(f"all {self.num_slots} KV-cache slots are in use (compiled batch_size)")
        return self._free.pop(0)

    def release(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"slot {slot} is not in use")
        self._free.append(slot)
        self._free.sort()


class BlockPool:
    """A paged export's KV blocks, for requests the host runs itself (generate()): ids 1 to
    num_blocks; block 0 is the null block that pads block tables and is never handed out, as
    in vLLM's BlockPool (modeling/kv_cache.py)."""

    def __init__(self, num_blocks: int, block_size: int):
        self._free = list(range(1, num_blocks + 1))
        self.num_blocks, self.block_size = num_blocks, block_size

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self, positions: int) -> tuple[int, ...]:
        """Blocks for `positions` positions (one per block_size, rounded up)."""
        n = -(-positions // self.block_size)
        if n > len(self._free):
            raise NoFreeSlotError(
                f"{n} KV blocks wanted, {len(self._free)} of {self.num_blocks} free (--kv-cache-blocks)"
            )
        blocks, self._free = tuple(self._free[:n]), self._free[n:]
        return blocks

    def release(self, blocks: tuple[int, ...]) -> None:
        if any(not 0 < b <= self.num_blocks or b in self._free for b in blocks):
            raise ValueError(f"blocks {list(blocks)} are not all in use")
        self._free = sorted(self._free + list(blocks))


def block_table(rows: Sequence[Sequence[int]]) -> torch.Tensor:
    """[N, M] block ids of N requests, M the longest, right-padded with the null block: THE
    block-table builder (graph_runner cuts or pads a table to a graph's columns)."""
    width = max(len(r) for r in rows)
    table = torch.full((len(rows), width), PAD_BLOCK, dtype=torch.int32)
    for i, r in enumerate(rows):
        table[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
    return table
