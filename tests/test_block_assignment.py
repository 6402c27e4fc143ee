"""Slots of KV blocks under prefix caching: affinity first, then least recently freed."""

from __future__ import annotations

import pytest

from optimum_neuron_chunked.vllm.block_assignment import BlockAssignment


def nothing_shared(slot: int) -> int:
    return 0


def test_without_reuse_slots_go_least_recently_freed_first():
    slots = BlockAssignment(3)
    assert [slots.assign(b, nothing_shared) for b in (1, 2, 3)] == [0, 1, 2]
    slots.release(1)
    slots.release(0)
    slots.release(2)
    # vLLM would hand out block 3 (freed last) first; the slot freed longest ago goes first here
    assert [slots.assign(b, nothing_shared) for b in (3, 2, 1)] == [1, 0, 2]


def test_the_free_slot_holding_the_longest_prefix_is_reused():
    slots = BlockAssignment(3)
    for block in (1, 2, 3):
        slots.assign(block, nothing_shared)
    for slot in (0, 1, 2):
        slots.release(slot)
    held = {0: 0, 1: 40, 2: 90}
    assert slots.assign(3, held.get) == 2
    assert slots.assign(2, held.get) == 1
    assert slots.assign(1, held.get) == 0
    assert slots.pool_block_of(3) == 2


def test_a_mapped_block_or_a_full_pool_is_refused():
    slots = BlockAssignment(1)
    slots.assign(1, nothing_shared)
    with pytest.raises(ValueError, match="already stands for pool block 0"):
        slots.assign(1, nothing_shared)
    with pytest.raises(RuntimeError, match="no free pool block"):
        slots.assign(2, nothing_shared)
    slots.release(0)
    assert slots.pool_block_of(1) is None
    assert slots.assign(2, nothing_shared) == 0
