"""Pool blocks of vLLM's KV blocks under prefix caching: affinity first, then least recently freed."""

from __future__ import annotations

import pytest

from optimum_neuron_chunked.vllm.block_assignment import BlockAssignment


def nothing_shared(pool_block: int) -> int:
    return 0


def test_without_reuse_pool_blocks_go_least_recently_freed_first():
    assignment = BlockAssignment(3)
    assert [assignment.assign(b, nothing_shared) for b in (1, 2, 3)] == [0, 1, 2]
    assignment.release(1)
    assignment.release(0)
    assignment.release(2)
    # vLLM would hand out block 3 (freed last) first; the pool block freed longest ago goes first here
    assert [assignment.assign(b, nothing_shared) for b in (3, 2, 1)] == [1, 0, 2]


def test_the_free_pool_block_holding_the_longest_prefix_is_reused():
    assignment = BlockAssignment(3)
    for block in (1, 2, 3):
        assignment.assign(block, nothing_shared)
    for pool_block in (0, 1, 2):
        assignment.release(pool_block)
    held = {0: 0, 1: 40, 2: 90}
    assert assignment.assign(3, held.get) == 2
    assert assignment.assign(2, held.get) == 1
    assert assignment.assign(1, held.get) == 0
    assert assignment.pool_block_of(3) == 2


def test_a_mapped_block_or_a_full_pool_is_refused():
    assignment = BlockAssignment(1)
    assignment.assign(1, nothing_shared)
    with pytest.raises(ValueError, match="already stands for pool block 0"):
        assignment.assign(1, nothing_shared)
    with pytest.raises(RuntimeError, match="no free pool block"):
        assignment.assign(2, nothing_shared)
    assignment.release(0)
    assert assignment.pool_block_of(1) is None
    assert assignment.assign(2, nothing_shared) == 0
