"""The KV layout of an export, decided once from its NeuronConfig and family: the only place
the layout's rules are computed. The model, its caches (kv_cache.py), the kernels, the engine,
vLLM's platform and the prefix-cache connectors receive a `KVPool` / `KVLayout` and recompute
none of it.

Glossary: a *block* holds P consecutive positions of one request; a *whole-sequence block*
holds a whole sequence (P = sequence_length, one per batch row); a *ring* keeps a sliding
layer's last window + C positions, position p at index p % ring; *pool order*: decode rows read
every block of the pool in block order, as views; a *prior*: a row's context read contiguous
and in position order (a kernel's input).

Every cache is a pool of `num_blocks` blocks of `block_size` positions. Whole-sequence blocks:
- tables have one column, addressed in place (no gather); decode rows read in pool order;
- a chunked export's sliding-window layers keep a ring of window + C positions (at most C
  positions are written per call);
- prefix caching copies positions between blocks (our copy connector): vLLM cannot share a
  block that holds a whole sequence.
Smaller blocks are vLLM's shared blocks: no rings, gathered reads, vLLM's prefix cache.

Storage (`KVStorage`): the pool holds the compute dtype, or float8 e4m3 (--kv-cache-dtype fp8):
every write divides by the layer's scale and saturates to Neuron's +-240 (quantization.store_scaled,
the FP8 weights' rule), every read multiplies back in the compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from ..config import NeuronConfig, ceil_div
from .quantization import STORAGE, store_scaled


class PrefixCache(Enum):
    """How cached prefixes reach a new request: COPY, our connector copies positions into its
    whole-sequence block (vllm/connector.py); SHARED, vLLM's prefix cache hands it the blocks
    holding them (vllm/prefix_wait.py)."""

    COPY = "copy"
    SHARED = "shared"


@dataclass(frozen=True)
class KVPool:
    """The pool of an export, from its config alone (no family needed)."""

    num_blocks: int
    block_size: int  # P
    sequence_length: int
    chunked: bool

    @classmethod
    def of(cls, config: NeuronConfig) -> KVPool:
        """--kv-cache-blocks blocks of --kv-block-size positions; by default one whole-sequence
        block per batch row."""
        blocks, size = (
            config.kv_cache_blocks or config.batch_size,
            config.kv_block_size or config.sequence_length,
        )
        return cls(blocks, size, config.sequence_length, config.chunked)

    def column(self, position: int) -> int:
        """The block-table column holding `position`: p // P."""
        return position // self.block_size

    def blocks_holding(self, positions):
        """Blocks (table columns) holding a row's first `positions` positions: ceil(positions / P)
        (a graph of context bucket W takes tables of blocks_holding(W) columns)."""
        return ceil_div(positions, self.block_size)

    @property
    def whole_sequence_blocks(self) -> bool:
        """The rule: a block holds a whole sequence (no --kv-block-size; config refuses P = S)."""
        return self.block_size == self.sequence_length

    @property
    def decode_reads_pool_order(self) -> bool:
        """Decode rows may read the pool in block order, as views (no gather of every row's
        window): each row's block holds its whole context."""
        return self.whole_sequence_blocks

    @property
    def prefix_cache(self) -> PrefixCache:
        return PrefixCache.COPY if self.whole_sequence_blocks else PrefixCache.SHARED

    @property
    def copy_graph(self) -> bool:
        """A copy graph for the COPY prefix cache (chunked exports: a hit's suffix is a chunk)."""
        return self.chunked and self.prefix_cache is PrefixCache.COPY


@dataclass(frozen=True)
class LayerKV:
    """One layer's addressing inside a block. `ring`: the cache length of a ring layer, holding
    position p at index p % ring; None: position p at index p (of its block, p % P).
    `in_place`: a row's block is addressed by its one table column (whole-sequence blocks)."""

    block_size: int  # positions a block of this layer holds
    ring: int | None
    in_place: bool = True

    @property
    def position_ordered(self) -> bool:
        """Each row's read holds position p at index p (no ring): a contiguous prior for a
        kernel that takes one (backends/neuron/nki_kernels.py), views for the cpu backend."""
        return self.ring is None

    def index(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Where a row's block keeps each position (whole-sequence blocks)."""
        return position_ids if self.ring is None else torch.remainder(position_ids, self.ring)

    def address(self, tables: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block [N, 1 or T], offset [N, T]) of each position of rows with block tables [N, M]:
        position p of row r at offset p % P of block tables[r, p // P]; whole-sequence blocks
        in place (static, no gather: positions below P, or wrapped in a ring)."""
        if self.in_place:  # row_blocks, kept a column
            return tables[:, :1], self.index(position_ids)
        column = torch.div(position_ids, self.block_size, rounding_mode="floor")
        return torch.gather(tables, 1, column), torch.remainder(position_ids, self.block_size)

    def extent(self, bucket: int, live):
        """(width, live) read of each row from position 0: the context bucket, or a ring layer's
        whole ring."""
        return (bucket, live) if self.ring is None else (self.ring, self.ring)

    def blocks_holding(self, positions):
        """The table columns holding a row's first `positions` positions of this layer."""
        return ceil_div(positions, self.block_size)

    def key_positions(self, position_ids: torch.Tensor, width: int) -> torch.Tensor:
        """[N or 1, width] absolute position of each entry read. A padded row repeats its last
        real position, so the last column is the last position written."""
        if self.ring is None:
            return torch.arange(width, device=position_ids.device)[None]
        return ring_positions(position_ids[:, -1], self.ring)


def row_blocks(tables: torch.Tensor) -> torch.Tensor:
    """[N] each row's one block, where blocks hold whole sequences (KVPool.whole_sequence_blocks,
    addressed in place: LayerKV.in_place): its block table's one column."""
    return tables[:, 0]


def ring_positions(last_positions: torch.Tensor, length: int) -> torch.Tensor:
    """[N] last written position of each row -> [N, length] absolute position held by each
    ring index: the latest p <= last with p % length == index (negative: never written).
    Every position in (last - length, last] of the row's request has been written by then."""
    index = torch.arange(length, device=last_positions.device)
    last = last_positions[:, None]
    return last - torch.remainder(last - index, length)


@dataclass(frozen=True)
class KVStorage:
    """How one layer's K and V are stored: `dtype` (the compute dtype) as they are, or float8 e4m3
    scaled by `scales` (K, V) and saturated to +-240."""

    dtype: torch.dtype
    fp8: bool = False
    scales: tuple[float, float] = (1.0, 1.0)

    @property
    def pool_dtype(self) -> torch.dtype:
        return STORAGE["fp8"] if self.fp8 else self.dtype

    def store(self, x: torch.Tensor, which: int) -> torch.Tensor:
        """K (which 0) or V (1) as the pool holds them."""
        if not self.fp8:
            return x.to(self.dtype)
        return store_scaled(x, self.scales[which], "fp8")

    def load(self, x: torch.Tensor, which: int) -> torch.Tensor:
        """What the pool holds as K (0) or V (1) in the compute dtype."""
        if not self.fp8:
            return x
        return (x.float() * self.scales[which]).to(self.dtype)


@dataclass(frozen=True)
class KVLayout:
    """The pool and how each layer addresses it, with the checkpoint's KV heads (tensor
    parallelism may split or replicate them on the device)."""

    pool: KVPool
    cache_lengths: tuple[int, ...]  # per layer: the positions a sequence keeps
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # the compute dtype
    fp8: bool = False  # --kv-cache-dtype fp8: the pool holds float8 e4m3 (KVStorage)
    scales: tuple[tuple[float, float], ...] = ()  # per layer (K, V); () = 1.0
    eagle3: bool = False  # an EAGLE3 head's layer beside the target's (`draft`)

    @classmethod
    def of(cls, config: NeuronConfig, spec) -> KVLayout:
        """The layout of `config`'s export of family `spec` (family.FamilySpec). A ring holds a
        sliding layer's window plus the most positions one call writes (the widest chunk), where
        that is shorter than the sequence: only chunked exports of whole-sequence blocks."""
        pool = KVPool.of(config)
        length = config.sequence_length
        writes = config.prefill_width if pool.whole_sequence_blocks else None
        lengths = tuple(
            length if w is None or writes is None else min(length, w + writes) for w in spec.sliding_windows
        )
        fp8 = config.kv_cache_dtype == "fp8"
        dtype = getattr(torch, config.dtype)
        return cls(
            pool, lengths, spec.num_kv_heads, spec.head_dim, dtype, fp8, config.kv_cache_scales,
            bool(config.speculation_head),
        )  # fmt: skip

    def storage(self, i: int) -> KVStorage:
        """Layer i's K / V storage."""
        return KVStorage(self.dtype, self.fp8, self.scales[i] if self.scales else (1.0, 1.0))

    @property
    def pool_dtype(self) -> torch.dtype:
        return self.storage(0).pool_dtype

    @property
    def draft(self) -> LayerKV:
        """The EAGLE3 head's one layer (modeling/eagle3.py): full attention in the same blocks,
        addressed by the target's tables (its KV heads and head_dim are the target's)."""
        return LayerKV(self.block_size, None, self.whole_sequence_blocks)

    @property
    def draft_storage(self) -> KVStorage:
        """The head's K / V storage: an fp8 pool stores them at scale 1 (no checkpoint scales)."""
        return KVStorage(self.dtype, self.fp8)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def sequence_length(self) -> int:
        return self.pool.sequence_length

    @property
    def whole_sequence_blocks(self) -> bool:
        return self.pool.whole_sequence_blocks

    @property
    def decode_reads_pool_order(self) -> bool:
        return self.pool.decode_reads_pool_order

    def reads_pool_order(self, decode_rows: bool) -> bool:
        """A call's rows read the pool in block order (kernels.CacheRead.pool_order): decode
        rows, where the pool allows it."""
        return decode_rows and self.decode_reads_pool_order

    @property
    def prefix_cache(self) -> PrefixCache:
        return self.pool.prefix_cache

    def layer(self, i: int) -> LayerKV:
        length = self.cache_lengths[i]
        ring = length if length < self.sequence_length else None
        return LayerKV(min(self.block_size, length), ring, self.whole_sequence_blocks)

    @property
    def ring_layers(self) -> tuple[int, ...]:
        """Layers keeping a ring of their last positions: there, a finished request's block no
        longer holds its whole prompt."""
        return tuple(i for i in range(self.num_layers) if not self.layer(i).position_ordered)

    @property
    def prefix_cache_refusal(self) -> str | None:
        """Why cached prefixes cannot be reused with this layout, or None."""
        if not self.pool.chunked:
            return (
                "a standard export encodes whole prompts from position 0 (export with --prefill-chunk-size)"
            )
        if self.prefix_cache is PrefixCache.COPY and self.ring_layers:
            return (
                "its sliding-window layers keep a ring of the last positions only, so a finished "
                "request's block no longer holds its prefix"
            )
        return None

    @property
    def num_layers(self) -> int:
        return len(self.cache_lengths)

    def summary(self, tp_degree: int = 1) -> str:
        """The export's line on its pool: blocks, bytes, tokens a GiB holds (all ranks together)."""
        kind = (
            "fp8 e4m3" + (", checkpoint scales" if self.scales else ", scale 1")
            if self.fp8
            else str(self.dtype)
        )
        per_token = self.bytes_per_block / self.block_size
        return (
            f"KV pool: {self.num_blocks} blocks of {self.block_size} positions, {kind}: "
            f"{self.num_blocks * self.bytes_per_block / 2**20:.3g} MiB, {2**30 / per_token:,.0f} tokens per GiB"
            + (f" (over {tp_degree} ranks)" if tp_degree > 1 else "")
        )

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block, every layer (an EAGLE3 head's too), every KV head."""
        return self.block_bytes(self.num_kv_heads)

    def block_bytes(self, kv_heads: int) -> int:
        """K and V of one block, every layer (an EAGLE3 head's too), of `kv_heads` KV heads
        (a rank's: parallel.ShardLayout.kv_heads_per_rank)."""
        positions = sum(self.layer(i).block_size for i in range(self.num_layers))
        positions += self.draft.block_size if self.eagle3 else 0
        return 2 * positions * kv_heads * self.head_dim * self.pool_dtype.itemsize

    @property
    def page_kv_heads(self) -> int:
        """vLLM's page of one block, as one full-attention layer of P positions: every layer's
        KV heads (an EAGLE3 head's too). Its bytes are `bytes_per_block` where no layer keeps a
        ring; a ring layer's block holds fewer positions than P (vllm/worker.py)."""
        return self.num_kv_heads * (self.num_layers + self.eagle3)
