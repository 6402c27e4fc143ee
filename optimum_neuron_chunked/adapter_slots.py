"""Which adapter holds which LoRA slot of an export: a pure policy, least recently used first.

Adapters are keyed by what the caller names them with (the loader: a name; vLLM: the request's
adapter id). A step places the adapters its rows name; one that has no slot takes a free one,
else the least recently used slot whose adapter is neither pinned nor needed by the step. Each
placed adapter is written into its slot before the step's graphs run (`place_rows`: the loader's
and vLLM's one path; GraphRunner.write_adapter): slots change between steps by a write, never by
a recompile.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence

from .modeling.lora import NO_ADAPTER


class SlotsExhausted(RuntimeError):
    """More adapters in one step than free, unpinned slots; the message says how many."""


class SlotTable:
    def __init__(self, slots: int):
        self.slots = slots
        self._holder: OrderedDict[Hashable, int] = OrderedDict()  # key -> slot, least recent first
        self.pinned: set[Hashable] = set()

    def slot_of(self, key: Hashable) -> int | None:
        return self._holder.get(key)

    def place(self, keys: Iterable[Hashable]) -> list[tuple[int, Hashable]]:
        """Give every key a slot, most recently used now -> the (slot, key) writes to make."""
        needed = list(dict.fromkeys(keys))
        writes = []
        for key in needed:
            if key in self._holder:
                self._holder.move_to_end(key)
                continue
            slot = self._free_slot(needed)
            self._holder[key] = slot
            writes.append((slot, key))
        return writes

    def place_rows(
        self, keys: Sequence[Hashable | None], write: Callable[[int, Hashable], None]
    ) -> list[int]:
        """Each row's slot for the adapter key it names (None: the base, NO_ADAPTER), the adapters
        that enter a slot written first by `write(slot, key)`."""
        for slot, key in self.place(k for k in keys if k is not None):
            write(slot, key)
        return [NO_ADAPTER if k is None else self._holder[k] for k in keys]

    def release(self, key: Hashable) -> None:
        """`key`'s slot is free (its tensors stay until another adapter is written); a pin stays:
        a reloaded adapter takes a slot again at its next step."""
        self._holder.pop(key, None)

    def drop(self, key: Hashable) -> None:
        """Forget `key`: its slot and its pin."""
        self.release(key)
        self.pinned.discard(key)

    def pin(self, key: Hashable) -> None:
        """Keep `key` in its slot until dropped; one slot always stays unpinned (an export of one
        slot pins none)."""
        if key not in self.pinned and len(self.pinned) + 1 >= self.slots:
            raise SlotsExhausted(
                f"pinning it would pin {len(self.pinned) + 1} of the export's {self.slots} adapter slots: "
                "one must stay free for the other adapters (export with a larger --max-loras)"
            )
        self.pinned.add(key)

    def _free_slot(self, needed: list[Hashable]) -> int:
        taken = set(self._holder.values())
        free = [s for s in range(self.slots) if s not in taken]
        if free:
            return free[0]
        for key, slot in self._holder.items():  # least recently used first
            if key not in self.pinned and key not in needed:
                del self._holder[key]
                return slot
        raise SlotsExhausted(
            f"{len(needed)} adapters in one step, {len(self.pinned)} of {self.slots} slots pinned: "
            "the export's --max-loras bounds the adapters of a step"
        )
