"""One layer's static KV cache and the rules that address it (in the spirit of gpt-fast's
`KVCache.update(input_pos, k, v)`, model.py).

Every cache is a pool of blocks [blocks, Hkv, P, D], and every graph addresses it through
block tables [N, ceil(W / P)]: row r's position p lives in block table[r, p // P] at offset
p % P. An export without --kv-cache-blocks is the pool whose block is a whole sequence, one
block per batch row (a slot): its tables have one column, read in place (no gather), and a
sliding layer's block is a ring of ring_length positions holding position p at p % length.

Padding invariant: a padded token repeats the last real token *and its position*. It computes
the same K/V as that token (same input, same position, same visible keys), so the
duplicate-index scatter writes identical values - a true no-op whatever the write order.
Keys are masked by absolute position (key_pos <= query_pos), so stale entries a previous
request left beyond the live context are never read.

Block tables are padded by the same rule: a row's columns past its blocks repeat its last block
(graph_runner.pad_repeat_last). Those columns stand for positions past the row's live context:
only read, never written, masked, they get probability exactly 0, and 0 times any finite value
adds nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


def ring_length(sliding_window: int | None, sequence_length: int, prefill_width: int) -> int:
    """Cache positions a layer keeps per slot. A sliding layer needs only its window plus the
    positions one call writes (a query at the start of a chunk still sees `window - 1` keys
    before it while the chunk's last token is written): a ring of that length when it is
    shorter than the sequence, with position p stored at index p % length."""
    if sliding_window is None:
        return sequence_length
    return min(sequence_length, sliding_window + prefill_width)


def cache_lengths(
    sliding_windows: tuple[int | None, ...], sequence_length: int, ring_width: int | None
) -> tuple[int, ...]:
    """Per layer, the positions a sequence keeps: rings of window + ring_width where that is
    shorter (NeuronConfig.ring_width; None: no rings, every layer keeps every position)."""
    return tuple(ring_length(w, sequence_length, ring_width or sequence_length) for w in sliding_windows)


def ring_positions(last_positions: torch.Tensor, length: int) -> torch.Tensor:
    """[N] last written position of each row -> [N, length] absolute position held by each
    ring index: the latest p <= last with p % length == index (negative: never written).
    Every position in (last - length, last] of the row's request has been written by then."""
    index = torch.arange(length, device=last_positions.device)
    last = last_positions[:, None]
    return last - torch.remainder(last - index, length)


def scatter_cache(
    cache: torch.Tensor,  # [B, Hkv, S, D]: slots x positions, or blocks x offsets
    rows: torch.Tensor,  # [N, 1] or [N, T]: the cache row of each token
    index: torch.Tensor,  # [N, T]: the position in that row
    values: torch.Tensor,  # [N, T, Hkv, D]
    functional: bool,
) -> torch.Tensor:
    """cache[rows, :, index] = values. In place for torch backends (the compiled graphs share
    the cache tensor); as a new tensor for XLA tracing, which turns a buffer reassigned to it
    into aliased device state and does not support in-place updates."""
    values = values.to(cache.dtype)
    if not functional:
        # Advanced indices on dims 0 and 2 put [N, T] first: values are [N, T, Hkv, D].
        cache[rows, :, index] = values
        return cache
    heads = torch.arange(cache.shape[1], device=cache.device)
    where = (rows[:, None, :], heads[None, :, None], index[:, None, :])  # -> [N, Hkv, T]
    return torch.index_put(cache, where, values.transpose(1, 2))


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor, positions) -> torch.Tensor:
    """A cache [blocks, Hkv, P, D] read through block tables [N, M] -> each row's M blocks, each
    cut to its first `positions`, [N, Hkv, M * positions, D] (a copy)."""
    n, m = block_tables.shape
    blocks = cache[:, :, :positions][block_tables]  # [N, M, Hkv, positions, D]
    return blocks.transpose(1, 2).reshape(n, cache.shape[1], m * positions, cache.shape[3])


@dataclass(frozen=True)
class KVCache:
    """One layer's K and V and how positions address them. `write` returns the cache with a
    part's K/V in it (the same tensors, or new ones under `functional` XLA tracing).

    `one_block_per_row`: a block holds a row's whole sequence (or ring): a table has one column,
    and the reference kernel may read decode rows in pool order (kernels.attend_in_pool_order)."""

    keys: torch.Tensor  # [blocks, Hkv, P, D]
    values: torch.Tensor  # same shape
    ring: int | None  # cache length of a ring layer (ring_length); None: position-indexed
    one_block_per_row: bool
    functional: bool

    @property
    def block_size(self) -> int:
        return self.keys.shape[2]

    def write(
        self,
        tables: torch.Tensor,  # [N, M] block tables
        position_ids: torch.Tensor,  # [N, T]
        k: torch.Tensor,  # [N, T, Hkv, D]
        v: torch.Tensor,  # [N, T, Hkv, D]
    ) -> KVCache:
        """The cache with k, v written at each row's positions: position p of row r at offset
        p % P of block tables[r, p // P]."""
        if tables.shape[1] == 1:  # static, no gather: positions are below P, or wrap in a ring
            rows = tables
            index = position_ids if self.ring is None else torch.remainder(position_ids, self.ring)
        else:
            rows = torch.gather(tables, 1, torch.div(position_ids, self.block_size, rounding_mode="floor"))
            index = torch.remainder(position_ids, self.block_size)
        keys = scatter_cache(self.keys, rows, index, k, self.functional)
        values = scatter_cache(self.values, rows, index, v, self.functional)
        return replace(self, keys=keys, values=values)

    def extent(self, window: int, live: int | torch.SymInt) -> tuple[int, int | torch.SymInt]:
        """(window, live) this layer reads of each row: a ring layer reads its whole ring."""
        return (window, live) if self.ring is None else (self.ring, self.ring)

    def key_positions(self, position_ids: torch.Tensor, width: int) -> torch.Tensor:
        """[N or 1, width] absolute position of each cache entry read. A padded row repeats
        its last real position, so the last column is the last position written."""
        if self.ring is None:
            return torch.arange(width, device=position_ids.device)[None]
        return ring_positions(position_ids[:, -1], self.ring)

    def windows(self, tables: torch.Tensor, live) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [N, Hkv, R, D] of each row's positions from 0 (a copy): its M blocks in
        table order, each cut to `live` positions where one block holds them all (R = M * min(P,
        live): callers pass the table columns up to the block holding position live - 1)."""
        positions = torch.sym_min(self.block_size, live)
        return gather_blocks(self.keys, tables, positions), gather_blocks(self.values, tables, positions)

    def block_view(self, block, live) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `live` positions of one block (a scalar) as views: [1, Hkv, live, D]."""
        torch._check(block < self.keys.shape[0])
        return self.keys[block, :, :live][None], self.values[block, :, :live][None]

    def pool_view(self, live) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `live` positions of every block, in pool order, as views [blocks, Hkv, live, D]."""
        return self.keys[:, :, :live], self.values[:, :, :live]
