"""KV-cache slots: each live request owns one row of the static cache."""

from __future__ import annotations


class NoFreeSlotError(RuntimeError):
    pass


class SlotPool:
    def __init__(self, num_slots: int):
        self._free = list(range(num_slots))
        self.num_slots = num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        if not self._free:
            raise NoFreeSlotError(f"all {self.num_slots} KV-cache slots are in use (compiled batch_size)")
        return self._free.pop(0)

    def release(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"slot {slot} is not in use")
        self._free.append(slot)
        self._free.sort()
