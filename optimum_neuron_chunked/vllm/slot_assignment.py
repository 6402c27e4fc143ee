"""Which KV-cache slot a request's KV block stands for, while prefix caching is on (pure).

vLLM's block pool hands out the most recently freed block first (blocks without a hash go to
the front of the free queue: `BlockPool.free_blocks`, vllm/v1/core/block_pool.py, 0.32). With
slot = block id - 1 that evicts the freshest cached prefix first - the one a chat's next turn
is most likely to need. So with prefix caching the connector maps blocks to slots itself:
a new request gets the free slot that holds the longest prefix of its prompt (slot affinity:
no copy), else the slot freed longest ago (LRU eviction). The map reaches the runner with the
step's `PrefixCopies`; without prefix caching the slot stays block id - 1.
"""

from __future__ import annotations

from collections.abc import Callable


class SlotAssignment:
    """Live block id -> slot, and the free slots, least recently freed first."""

    def __init__(self, num_slots: int):
        self._slot_of: dict[int, int] = {}
        self._free: list[int] = list(range(num_slots))

    def slot_of(self, block: int) -> int | None:
        return self._slot_of.get(block)

    def assign(self, block: int, shared: Callable[[int], int]) -> int:
        """A slot for a block vLLM just allocated. `shared(slot)`: how many leading tokens of the
        new request's prompt the slot holds (0 when too few to reuse). The block must not be
        mapped (release its slot first)."""
        if block in self._slot_of:
            raise ValueError(f"block {block} already stands for slot {self._slot_of[block]}")
        if not self._free:
            raise RuntimeError(f"no free slot for block {block}: more live blocks than slots")
        # max() keeps the first of equal keys: the least recently freed among equals
        slot = max(self._free, key=shared)
        self._free.remove(slot)
        self._slot_of[block] = slot
        return slot

    def release(self, slot: int) -> None:
        """The slot's request ended (or lost its block): the slot is free, most recently freed."""
        blocks = [b for b, s in self._slot_of.items() if s == slot]
        for block in blocks:
            del self._slot_of[block]
            self._free.append(slot)
