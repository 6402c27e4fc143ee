"""The KV layout of an export, decided once from its NeuronConfig and family: the only place
the layout's rules are computed. The model, its caches (kv_cache.py), the kernels, the engine,
vLLM's platform and the prefix-cache connectors receive a `KVLayout` and recompute none of it.

Every cache is a pool of `num_blocks` blocks of `block_size` positions, P. Without
--kv-block-size a block is a whole sequence (P = sequence_length), one per batch row:
- its block tables have one column, read in place (no gather);
- decode rows read the pool in block order (`decode_reads_pool_order`);
- a chunked export's sliding-window layers keep a ring of window + C positions, position p at
  index p % ring (at most C positions are written per call);
- a block is a contiguous, position-ordered prior for a kernel that reads one (`contiguous_prior`);
- prefix caching copies positions between blocks (our copy connector): vLLM cannot share a
  block that holds a whole sequence.
Smaller blocks are vLLM's shared blocks: no rings, gathered reads, vLLM's prefix cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from ..config import NeuronConfig


class PrefixCache(Enum):
    """How cached prefixes reach a new request: COPY, our connector copies positions into its
    whole-sequence block (vllm/connector.py); SHARED, vLLM's prefix cache hands it the blocks
    holding them (vllm/prefix_wait.py)."""

    COPY = "copy"
    SHARED = "shared"


def whole_sequence_blocks(config: NeuronConfig) -> bool:
    """The rule: a block holds a whole sequence (no --kv-block-size, or P = sequence_length)."""
    return config.kv_block_positions == config.sequence_length


@dataclass(frozen=True)
class LayerKV:
    """One layer's addressing inside a block. `ring`: the cache length of a ring layer, holding
    position p at index p % ring; None: position p at index p (of its block, p % P)."""

    block_size: int  # positions a block of this layer holds
    ring: int | None

    @property
    def position_ordered(self) -> bool:
        """Each row's read holds position p at index p (no ring): a contiguous prior for a
        kernel that takes one (backends/neuron/nki_kernels.py)."""
        return self.ring is None

    def index(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Where a one-block row keeps each position."""
        return position_ids if self.ring is None else torch.remainder(position_ids, self.ring)

    def extent(self, window: int, live):
        """(window, live) read of each row from position 0: a ring layer reads its whole ring."""
        return (window, live) if self.ring is None else (self.ring, self.ring)

    def key_positions(self, position_ids: torch.Tensor, width: int) -> torch.Tensor:
        """[N or 1, width] absolute position of each entry read. A padded row repeats its last
        real position, so the last column is the last position written."""
        if self.ring is None:
            return torch.arange(width, device=position_ids.device)[None]
        return ring_positions(position_ids[:, -1], self.ring)


def ring_positions(last_positions: torch.Tensor, length: int) -> torch.Tensor:
    """[N] last written position of each row -> [N, length] absolute position held by each
    ring index: the latest p <= last with p % length == index (negative: never written).
    Every position in (last - length, last] of the row's request has been written by then."""
    index = torch.arange(length, device=last_positions.device)
    last = last_positions[:, None]
    return last - torch.remainder(last - index, length)


@dataclass(frozen=True)
class KVLayout:
    """The pool and how each layer addresses it, with the checkpoint's KV heads (tensor
    parallelism may split or replicate them on the device)."""

    num_blocks: int
    block_size: int  # P
    sequence_length: int
    cache_lengths: tuple[int, ...]  # per layer: the positions a sequence keeps
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, config: NeuronConfig, spec) -> KVLayout:
        """The layout of `config`'s export of family `spec` (family.FamilySpec). A ring holds a
        sliding layer's window plus the most positions one call writes (the widest chunk), where
        that is shorter than the sequence: only chunked exports of whole-sequence blocks."""
        length = config.sequence_length
        writes = config.prefill_width if whole_sequence_blocks(config) else None
        lengths = tuple(
            length if w is None or writes is None else min(length, w + writes) for w in spec.sliding_windows
        )
        return cls(
            config.kv_pool_blocks,
            config.kv_block_positions,
            length,
            lengths,
            spec.num_kv_heads,
            spec.head_dim,
            getattr(torch, config.dtype),
        )

    @property
    def whole_sequence_blocks(self) -> bool:
        return self.block_size == self.sequence_length

    def layer(self, i: int) -> LayerKV:
        length = self.cache_lengths[i]
        return LayerKV(min(self.block_size, length), length if length < self.sequence_length else None)

    @property
    def ring_layers(self) -> tuple[int, ...]:
        """Layers keeping a ring of their last positions: there, a finished request's block no
        longer holds its whole prompt."""
        return tuple(i for i in range(self.num_layers) if self.layer(i).ring is not None)

    @property
    def decode_reads_pool_order(self) -> bool:
        """Decode rows may read the pool in block order, as views (no gather of every row's
        window): each row's block holds its whole context."""
        return self.whole_sequence_blocks

    @property
    def contiguous_prior(self) -> bool:
        """A row's prior K/V is one block, contiguous and in position order (ring layers aside),
        as a kernel reading a row's prior with KV heads folded into the batch wants it; smaller
        blocks gather the row's window first."""
        return self.whole_sequence_blocks

    @property
    def prefix_cache(self) -> PrefixCache:
        return PrefixCache.COPY if self.whole_sequence_blocks else PrefixCache.SHARED

    @property
    def num_layers(self) -> int:
        return len(self.cache_lengths)

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block, every layer."""
        positions = sum(self.layer(i).block_size for i in range(self.num_layers))
        return 2 * positions * self.num_kv_heads * self.head_dim * self.dtype.itemsize
