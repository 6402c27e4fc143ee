"""One layer's static KV cache: one write, one copy and three named reads (in the spirit of gpt-fast's
`KVCache.update(input_pos, k, v)`, model.py), by the layout's rules (kv_layout.py).

Every cache is a pool of blocks [blocks, Hkv, P, D], and every graph addresses it through
block tables [N, ceil(W / P)], as kv_layout.LayerKV says (`address`, `index`): row r's
position p lives in block table[r, p // P] at offset p % P; whole-sequence blocks in place, a
ring layer's block holding position p at p % ring.

Padding invariant: a padded token repeats the last real token *and its position*. It computes
the same K/V as that token (same input, same position, same visible keys), so the
duplicate-index scatter writes identical values - a true no-op whatever the write order.
Keys are masked by absolute position (key_pos <= query_pos), so stale entries a previous
request left beyond the live context are never read.

Block tables are padded by the same rule: a row's columns past its blocks repeat its last block
(graph_inputs.pad_repeat_last). Those columns stand for positions past the row's live context:
only read, never written, masked, they get probability exactly 0, and 0 times any finite value
adds nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .kv_layout import KVStorage, LayerKV


def scatter_cache(
    cache: torch.Tensor,  # [blocks, Hkv, P, D]
    rows: torch.Tensor,  # [N, 1] or [N, T]: the cache row of each token
    index: torch.Tensor,  # [N, T]: the position in that row
    values: torch.Tensor,  # [N, T, Hkv, D], as the cache stores them (KVStorage.store)
    functional: bool,
) -> torch.Tensor:
    """cache[rows, :, index] = values. In place for torch backends (the compiled graphs share
    the cache tensor); as a new tensor for XLA tracing, which turns a buffer reassigned to it
    into aliased device state and does not support in-place updates."""
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
    # index_select, not advanced indexing: torch 2.9's CPU kernels index no float8 tensor
    blocks = cache[:, :, :positions].index_select(0, block_tables.reshape(-1))  # [N * M, Hkv, positions, D]
    return (
        blocks.view(n, m, *blocks.shape[1:])
        .transpose(1, 2)
        .reshape(n, cache.shape[1], m * positions, cache.shape[3])
    )


@dataclass(frozen=True)
class KVCache:
    """One layer's K and V and how positions address them (its LayerKV, from KVLayout): one
    write, one copy and three named reads. `write` returns the cache with a part's K/V in it (the same tensors, or
    new ones under `functional` XLA tracing)."""

    keys: torch.Tensor  # [blocks, Hkv, P, D], KVStorage.pool_dtype
    values: torch.Tensor  # same shape
    layer: LayerKV
    functional: bool
    storage: KVStorage  # writes store, reads load in the compute dtype (fp8 pools: scaled)

    def write(
        self,
        tables: torch.Tensor,  # [N, M] block tables
        position_ids: torch.Tensor,  # [N, T]
        k: torch.Tensor,  # [N, T, Hkv, D]
        v: torch.Tensor,  # [N, T, Hkv, D]
    ) -> KVCache:
        """The cache with k, v written at each row's positions (LayerKV.address)."""
        rows, index = self.layer.address(tables, position_ids)
        keys = scatter_cache(self.keys, rows, index, self.storage.store(k, 0), self.functional)
        values = scatter_cache(self.values, rows, index, self.storage.store(v, 1), self.functional)
        return replace(self, keys=keys, values=values)

    def copy(self, position_ids: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> KVCache:
        """The cache with the K/V of `position_ids` [1, T] of block src [1] copied into block
        dst [1] (whole-sequence blocks: a cached prefix enters a new request's block). Padding
        repeats the last position (graph_inputs.pad_repeat_last): the same entry copied twice.
        Copied as stored (fp8 stays fp8)."""
        index = self.layer.index(position_ids)  # [1, T]
        copied = []
        for cache in (self.keys, self.values):
            values = cache.index_select(0, src).index_select(2, index[0])  # [1, Hkv, T, D]
            copied.append(scatter_cache(cache, dst[:, None], index, values.transpose(1, 2), self.functional))
        return replace(self, keys=copied[0], values=copied[1])

    def extent(self, bucket: int, live):
        """(width, live) read of each row (LayerKV.extent)."""
        return self.layer.extent(bucket, live)

    # Three reads, each returning keys, values [R, Hkv, W, D] of each row's positions from 0 up
    # to `live` (a ring: its whole ring) and their absolute positions [R or 1, W], for rows at
    # `position_ids` [R, T]. The caller's CacheRead says which one (kernels.attend_read).

    def read_tables(self, tables: torch.Tensor, live, position_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Block tables [N, M]: each row's blocks in table order, each cut to `live` where one
        block holds it all (a copy; callers pass the columns up to the block of position live - 1)."""
        live = self.layer.extent(live, live)[1]
        positions = torch.sym_min(self.layer.block_size, live)
        keys, values = (
            self.storage.load(gather_blocks(self.keys, tables, positions), 0),
            self.storage.load(gather_blocks(self.values, tables, positions), 1),
        )
        return keys, values, self.layer.key_positions(position_ids, keys.shape[2])

    def read_block(self, block, live, position_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One block id (a scalar): a view of that block, R = 1."""
        live = self.layer.extent(live, live)[1]
        torch._check(block < self.keys.shape[0])
        keys, values = self.keys[block, :, :live][None], self.values[block, :, :live][None]
        keys, values = self.storage.load(keys, 0), self.storage.load(values, 1)
        return keys, values, self.layer.key_positions(position_ids, keys.shape[2])

    def read_pool(self, live, position_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Every block of the pool in block order, as views (fp8 pools: dequantized copies), R = num_blocks."""
        live = self.layer.extent(live, live)[1]
        keys, values = (
            self.storage.load(self.keys[:, :, :live], 0),
            self.storage.load(self.values[:, :, :live], 1),
        )
        return keys, values, self.layer.key_positions(position_ids, keys.shape[2])
