"""Which KV-cache pool block holds the longest prefix of a prompt: the prefix cache's index (pure).

The cache has one pool block per request and keeps nothing beside them: a pool block's KV stays valid
after its request ends, until the pool block is given to another request. So the index records, per
pool block, the tokens whose K/V the pool block holds (positions 0..n-1), and a new request reuses the
longest common prefix with any pool block by copying those positions into its own pool block - or by no
copy at all when vLLM's allocator gives it the very pool block that holds them. Eviction is vLLM's
block pool: a freed pool block is reallocated most-recently-freed first (blocks without a hash go
to the front of the free queue, `BlockPool.free_blocks`, vllm/v1/core/block_pool.py, 0.32),
and reallocating a pool block replaces what the index says it holds.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PrefixHit:
    """`length` tokens of a prompt whose K/V `source` holds at positions 0..length-1."""

    source: int
    length: int


@dataclass(frozen=True)
class BlockCopy:
    """Copy positions 0..length-1 of every layer's K/V from pool block `source` to pool block `target`."""

    source: int
    target: int
    length: int


def common_prefix_length(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def worth_waiting(prompt, hit_length: int, computing: list, min_gain: int, block: int = 1) -> bool:
    """Whether a new request should wait a step rather than start now: a running request is
    computing a prompt that shares at least `min_gain` more tokens with this one than the
    cache holds yet (`block`: hits are whole blocks of this many tokens). Starting now would
    compute them twice - and a prefill that started takes its share of every step's token
    budget until it is done. The wait ends: a running prefill is scheduled before any new
    request, so it progresses every step."""
    prompt = np.asarray(prompt, dtype=np.int64)
    for other in computing:
        shared = min(common_prefix_length(prompt, np.asarray(other, dtype=np.int64)), len(prompt) - 1)
        if shared - shared % block >= hit_length + min_gain:
            return True
    return False


class PrefixIndex:
    """pool block -> token ids whose K/V the pool block holds at positions 0, 1, ..., and the
    LoRA adapter they were computed under (compat.adapter_cache_key; None: the base): K/V of one
    adapter is never a hit for another.

    `min_hit`: shorter common prefixes are not worth a copy call (a chat template's first
    tokens); a hit always leaves the prompt's last token to compute, so that it samples.
    `drop`: tokens a hit gives up after that cap - 1 with an EAGLE3 head, as vLLM's prefix cache
    drops one hash unit of a hit for eagle (`hit_length -= min(alignment_tokens, block_size)`,
    v1/core/single_type_kv_cache_manager.py, 0.32; hits here are token-granular): the head's K/V
    at a hit's last position was written with the token that followed it in the source, which
    may not follow it here, so that position is computed again."""

    def __init__(self, min_hit: int, drop: int = 0):
        self.min_hit, self.drop = min_hit, drop
        self._held: dict[int, np.ndarray] = {}
        self._adapter: dict[int, Hashable] = {}

    def held(self, pool_block: int, adapter: Hashable = None) -> np.ndarray:
        """What the pool block holds for a prompt under `adapter` (nothing under another)."""
        if self._adapter.get(pool_block) != adapter:
            return np.empty(0, dtype=np.int64)
        return self._held.get(pool_block, np.empty(0, dtype=np.int64))

    def set(self, pool_block: int, token_ids, adapter: Hashable = None) -> None:
        """The pool block now holds the K/V of `token_ids` under `adapter` (those before it are gone)."""
        self._held[pool_block] = np.asarray(token_ids, dtype=np.int64)
        self._adapter[pool_block] = adapter

    def longest_hit(self, prompt, adapter: Hashable = None) -> PrefixHit | None:
        prompt = np.asarray(prompt, dtype=np.int64)
        best = None
        for pool_block in self._held:
            n = min(common_prefix_length(prompt, self.held(pool_block, adapter)), len(prompt) - 1) - self.drop
            if n >= self.min_hit and (best is None or n > best.length):
                best = PrefixHit(pool_block, n)
        return best

    def admit(self, target: int, prompt, hit: PrefixHit | None, adapter: Hashable = None) -> BlockCopy | None:
        """A request enters `target` with `hit` (what get_num_new_matched_tokens promised):
        the copy that puts the hit in place (None when none is needed), and the index now
        says `target` holds the hit's tokens. A copy is always read before anything of this
        step writes its source (the runner copies first), so the source's entry stays."""
        prompt = np.asarray(prompt, dtype=np.int64)
        length = hit.length if hit else 0
        already = common_prefix_length(prompt[:length], self.held(target, adapter))
        self.set(target, prompt[:length], adapter)
        if length == 0 or already >= length:
            return None  # no hit, or the pool block already holds it (pool block affinity)
        return BlockCopy(hit.source, target, length)
