"""How a backend computes the shared math: the one interface between the model and a backend's
tuning, with the types it speaks in. `Kernels` itself is the reference - what eager, XLA and
Neuron compute, and what every other strategy is tested against: plain linear layers,
attention as the masked softmax over each row's gathered bucket window (decode rows of a pool
of whole-sequence blocks: over views of the pool in block order, as the layout allows), and
experts gathered by neuronx-distributed's rule.

A backend whose compiler can do better subclasses it (backends/cpu/kernels.py) and hands its
instance to the model (Backend.kernels); the model calls only these methods. Attention reaches
a kernel as a frozen `AttentionSpec`, the layer's `KVCache` and tensors, never as the module.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .kv_cache import KVCache
from .kv_layout import KVLayout, row_blocks
from .layers import MASK_VALUE


@dataclass(frozen=True)
class AttentionSpec:
    """What a kernel needs to know of one layer's attention (heads held by this rank)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None
    sinks: bool  # gpt-oss: a learned logit per query head joins the softmax (attend's `sinks`)

    @property
    def plain_causal(self) -> bool:
        """Causal over the whole context: no sliding window (so no ring) or sinks."""
        return not self.sinks and self.sliding_window is None


@dataclass(frozen=True)
class CacheRead:
    """What every layer's attention reads of its cache in one graph call, decided once per call
    (Kernels.cache_read).

    window: the graph's context bucket (static: a backend may pick its kernel by it).
    live: positions read from each row: the window, or fewer where a backend reads the live
      context only (backends/cpu/kernels.py).
    pool_order: decode rows read every block of the pool in block order, as views, instead of
      gathering each row's window (KVLayout.reads_pool_order).
    """

    window: int
    live: int | torch.SymInt
    pool_order: bool = False


@dataclass(frozen=True)
class GraphPart:
    """Rows of one graph call that attend alike: a prefill chunk ([1, T]) or decode rows
    ([N, T], `decode_rows`). A graph call is one part (CE, CP, TG, VF) or a mixed step's two
    (decode rows, then a chunk): the projections and the MLP run once over every part's
    tokens, each part attends over its own blocks (Attention.forward)."""

    position_ids: torch.Tensor  # [N, T]
    tables: torch.Tensor  # [N, ceil(W / P)] block tables (kv_cache.py)
    read: CacheRead
    decode_rows: bool  # the graph kind's choice (TG, VF, MX's decode part), never a shape's
    rotaries: tuple  # (cos, sin) of the global rotary, and of the local one or None

    @property
    def tokens(self) -> int:
        return self.position_ids.shape[0] * self.position_ids.shape[1]


# (q, keys, values, position_ids, key_positions) -> output, as masked_softmax
AttentionCore = Callable[..., torch.Tensor]


class Kernels:
    # A MoE graph of M tokens gathers its selected experts' weights while M * top_k / E is
    # under this fraction, else runs every expert densely: neuronx-distributed's rule
    # (DEFAULT_SELECTIVE_LOADING_THRESHOLD, modules/moe/model_utils.py, Release 2.29 / 0.18.0).
    expert_selection: float = 1.0

    def linear(self, in_features: int, out_features: int, bias: bool) -> nn.Module:
        """A tp-1 linear layer (parallel.TorchLayers builds every projection with it)."""
        return nn.Linear(in_features, out_features, bias=bias)

    def cache_read(
        self, kv: KVLayout, position_ids: torch.Tensor, tables: torch.Tensor, window: int, decode_rows: bool
    ) -> CacheRead:
        """What every layer reads of its cache in one call: the whole context bucket, decode
        rows in pool order where the layout allows it (no gather)."""
        return CacheRead(window, window, kv.reads_pool_order(decode_rows))

    def attend(
        self,
        spec: AttentionSpec,
        part: GraphPart,
        q: torch.Tensor,  # [N, Hq, T, D]
        cache: KVCache,
        sinks: torch.Tensor | None,  # [Hq] where spec.sinks
    ) -> torch.Tensor:
        """One part's queries over what part.read says -> [N, Hq, T, D]; the masked softmax."""
        return attend_read(q, cache, part, part.read.live, functools.partial(masked_softmax, spec, sinks))


def attend_read(q, cache: KVCache, part: GraphPart, live, core: AttentionCore) -> torch.Tensor:
    """A part's queries over one read of the cache up to `live` (KVCache.read_tables / read_pool): each row's
    blocks by its table, or, in pool order (CacheRead.pool_order), every block of the pool as
    views - gathering every decode row's window would copy the whole live cache each step.
    There rows are moved to their blocks and back; a block with no row attends to whatever it
    holds and its result is dropped; padded rows repeat a real row, so duplicate blocks copy
    identical values."""
    if not part.read.pool_order:
        keys, values, key_positions = cache.read_tables(part.tables, live, part.position_ids)
        return core(q, keys, values, part.position_ids, key_positions)
    rows, position_ids, blocks = row_blocks(part.tables), part.position_ids, cache.keys.shape[0]
    q_pool = q.new_zeros(blocks, *q.shape[1:]).index_copy(0, rows, q)
    pos_pool = position_ids.new_zeros(blocks, position_ids.shape[1]).index_copy(0, rows, position_ids)
    keys, values, key_positions = cache.read_pool(live, pos_pool)
    return core(q_pool, keys, values, pos_pool, key_positions).index_select(0, rows)


def attention_mask(
    position_ids: torch.Tensor, key_positions: torch.Tensor, sliding_window: int | None
) -> torch.Tensor:
    """[N, 1, T, W] boolean: which cached keys (at absolute `key_positions`, [N or 1, W]) each
    query may attend to. Negative key positions (ring entries not yet written) never are."""
    key_pos = key_positions[:, None, None, :]  # [N, 1, 1, W]
    query_pos = position_ids[:, None, :, None]  # [N, 1, T, 1]
    mask = (key_pos <= query_pos) & (key_pos >= 0)
    if sliding_window is not None:
        mask = mask & (key_pos > query_pos - sliding_window)
    return mask


def masked_softmax(
    spec: AttentionSpec, sinks: torch.Tensor | None, q, keys, values, position_ids, key_positions
) -> torch.Tensor:
    """q [N, Hq, T, D] over keys/values [N, Hkv, W, D] -> [N, Hq, T, D], W the positions
    read: masked scores (MASK_VALUE), softmax, values - what every backend can lower.

    Grouped-query attention without expanding K/V: query heads k*G..k*G+G-1 share KV
    head k (transformers' repeat_kv order), so they are stacked along the query axis.
    Batched 3-D products over (row, KV head) and a mask made at the scores' shape: no view
    of a scores buffer feeds a matmul (AOTInductor cannot lay one out when its live width
    is unbacked and a dim is 1). Query positions are tiled group-major, as q.
    """
    n, _, t, _ = q.shape
    groups, kv_heads, read = spec.num_heads // spec.num_kv_heads, spec.num_kv_heads, keys.shape[2]
    q = q.reshape(n * kv_heads, groups * t, spec.head_dim)
    keys, values = keys.reshape(n * kv_heads, read, -1), values.reshape(n * kv_heads, read, -1)
    mask = attention_mask(position_ids.repeat(1, groups), key_positions, spec.sliding_window)
    mask = mask.expand(n, kv_heads, groups * t, read).reshape(n * kv_heads, groups * t, read)
    scores = torch.where(mask, (torch.bmm(q, keys.transpose(1, 2)) * spec.scale).float(), MASK_VALUE)
    if sinks is not None:  # eager_attention_forward of gpt_oss: an extra column, dropped after
        sinks = sinks.float().view(1, kv_heads, groups, 1).repeat_interleave(t, dim=2)
        sinks = sinks.expand(n, -1, -1, -1).reshape(n * kv_heads, groups * t, 1)
        probs = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :read]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.bmm(probs.to(values.dtype), values).view(n, spec.num_heads, t, spec.head_dim)
