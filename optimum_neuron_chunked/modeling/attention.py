"""Attention over a static per-slot KV cache.

Every graph (CE, CP, TG) runs the same code: scatter this step's K/V into the rows' slots at
their positions, then attend over the first `window` positions of those slots. Sliding-window
layers of chunked exports keep a ring of `window + chunk` positions instead (ring_length).

Padding invariant: a padded token repeats the last real token *and its position*. It
computes the same K/V as that token (same input, same position, same visible keys), so the
duplicate-index scatter writes identical values - a true no-op whatever the write order.
Keys are masked by absolute position (key_pos <= query_pos), so stale entries a previous
request left in the slot beyond the live context are never read.

Paged models (block_size set) keep one pool of blocks [blocks + 1, Hkv, P, D] instead of slots:
a row's position p lives in block table[p // P] at offset p % P, and every read gathers the
row's blocks into its window. Block 0 is vLLM's null block (BlockPool takes block id 0 off its
free list as `null_block` and never hands it to a request: vllm/v1/core/block_pool.py, 0.32
and 0.16.0) and pads block tables; it is never written, since padding repeats real tokens and
rows, so it holds zeros. Positions it stands for lie past the row's live context: masked, they
get probability exactly 0, and 0 times its zeros (or any stale finite value) adds nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .family import FamilySpec
from .kernels import Kernels
from .layers import MASK_VALUE, apply_rotary, rms_norm
from .parallel import ShardLayout


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


def ring_length(sliding_window: int | None, sequence_length: int, prefill_width: int) -> int:
    """Cache positions a layer keeps per slot. A sliding layer needs only its window plus the
    positions one call writes (a query at the start of a chunk still sees `window - 1` keys
    before it while the chunk's last token is written): a ring of that length when it is
    shorter than the sequence, with position p stored at index p % length."""
    if sliding_window is None:
        return sequence_length
    return min(sequence_length, sliding_window + prefill_width)


def cache_lengths(
    sliding_windows: tuple[int | None, ...],
    sequence_length: int,
    prefill_width: int | None,
    paged: bool = False,
) -> tuple[int, ...]:
    """Per layer, the cache positions a slot (paged: a sequence) keeps; prefill_width None or a
    paged cache: no rings, blocks are shared and freed by vLLM, which knows no rings."""
    width = sequence_length if paged else prefill_width or sequence_length
    return tuple(ring_length(w, sequence_length, width) for w in sliding_windows)


def ring_positions(last_positions: torch.Tensor, length: int) -> torch.Tensor:
    """[N] last written position of each row -> [N, length] absolute position held by each
    ring index: the latest p <= last with p % length == index (negative: never written).
    Every position in (last - length, last] of the row's request has been written by then."""
    index = torch.arange(length, device=last_positions.device)
    last = last_positions[:, None]
    return last - torch.remainder(last - index, length)


@dataclass(frozen=True)
class CacheRead:
    """What every layer's attention reads of its cache in one graph call, decided once per call
    (Kernels.cache_read).

    window: the graph's context bucket (static: a backend may pick its kernel by it).
    live: positions read from each slot: the window, or fewer where a backend reads the live
      context only (backends/cpu/kernels.py).
    """

    window: int
    live: int | torch.SymInt


def write_cache(
    cache: torch.Tensor,  # [B, Hkv, S, D]
    seq_ids: torch.Tensor,  # [N]
    position_ids: torch.Tensor,  # [N, T]
    values: torch.Tensor,  # [N, T, Hkv, D]
    functional: bool,
) -> torch.Tensor:
    """cache[seq_ids, :, position_ids] = values (scatter_cache)."""
    return scatter_cache(cache, seq_ids[:, None], position_ids, values, functional)


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


def block_positions(
    block_tables: torch.Tensor, position_ids: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables [N, M] and positions [N, T] -> (block [N, T], offset [N, T]) holding each
    position in a paged cache."""
    blocks = torch.gather(block_tables, 1, torch.div(position_ids, block_size, rounding_mode="floor"))
    return blocks, torch.remainder(position_ids, block_size)


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """A paged cache [blocks, Hkv, P, D] read through block tables [N, M] -> each row's first
    M * P positions, [N, Hkv, M * P, D] (a copy)."""
    n, m = block_tables.shape
    blocks = cache[block_tables]  # [N, M, Hkv, P, D]
    return blocks.transpose(1, 2).reshape(n, cache.shape[1], m * cache.shape[2], cache.shape[3])


@dataclass(frozen=True)
class GraphPart:
    """Rows of one graph call that attend alike: a prefill chunk ([1, T]) or decode rows
    ([B, 1], one row per slot). A graph call is one part (CE, CP, TG) or a mixed step's two
    (decode rows, then a chunk): the projections and the MLP run once over every part's
    tokens, each part attends over its own slots (Attention.forward). A paged model's parts
    carry block tables where slot models carry slots (the model's construction says which)."""

    position_ids: torch.Tensor  # [N, T]
    seq_ids: torch.Tensor  # [N] slots; paged models: [N, W // P] block tables
    read: CacheRead
    one_row_per_slot: bool
    rotaries: tuple  # (cos, sin) of the global rotary, and of the local one or None

    @property
    def tokens(self) -> int:
        return self.position_ids.shape[0] * self.position_ids.shape[1]


class Attention(nn.Module):
    """Heads held by this rank: all of them at tp 1 (see parallel.py for the split)."""

    def __init__(
        self,
        spec: FamilySpec,
        *,
        sliding_window: int | None,
        layout: ShardLayout,
        layers,
        functional_cache: bool,
        kernels: Kernels,
        use_rope: bool = True,
        local_rope: bool = False,
        ring: int | None = None,
        block_size: int | None = None,
    ):
        super().__init__()
        self.kernels = kernels
        self.functional_cache, self.use_rope = functional_cache, use_rope
        self.local_rope = local_rope  # gemma3's sliding layers: the local rotary (GraphPart.rotaries)
        self.ring = ring  # cache length of a ring layer (see ring_length); None: position-indexed
        self.block_size = block_size  # positions per block of a paged cache; None: slots
        d, hidden = spec.head_dim, spec.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = layout.heads_per_rank, layout.kv_heads_per_rank, d
        self.scale = spec.scale
        self.sliding_window = sliding_window
        self.q_proj = layers.column(hidden, layout.num_heads * d, bias=spec.qkv_bias)
        self.k_proj = layers.column(hidden, layout.kv_heads * d, bias=spec.qkv_bias)
        self.v_proj = layers.column(hidden, layout.kv_heads * d, bias=spec.qkv_bias)
        self.o_proj = layers.row(layout.num_heads * d, hidden, bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = rms_norm(d, spec.rms_norm_eps, spec.gemma_norms)
            self.k_norm = rms_norm(d, spec.rms_norm_eps, spec.gemma_norms)
        else:
            self.q_norm = self.k_norm = None
        # gpt-oss: per query head, a logit that joins the softmax and takes probability mass
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if spec.attention_sinks else None

    @property
    def plain_causal(self) -> bool:
        """Causal over the whole context: no sliding window, ring or sinks."""
        return self.sinks is None and self.sliding_window is None and self.ring is None

    def forward(
        self,
        x: torch.Tensor,  # [1, R, H]: every part's tokens, part after part
        parts: tuple[GraphPart, ...],
        k_cache: torch.Tensor,  # [B, Hkv, S, D]
        v_cache: torch.Tensor,  # [B, Hkv, S, D]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (output [1, R, H], k_cache, v_cache): the caches written, in place or anew.

        The projections run once over all R tokens. Every part writes its K/V before any part
        reads: parts hold distinct slots, so the order does not change what is read, and a
        write after a read of the same buffer would make AOTInductor copy the whole cache."""
        q, k, v = self.q_proj(x)[0], self.k_proj(x)[0], self.v_proj(x)[0]
        queries, offset = [], 0
        for part in parts:
            rows = slice(offset, offset + part.tokens)
            part_q, k_cache, v_cache = self._write(part, q[rows], k[rows], v[rows], k_cache, v_cache)
            queries.append(part_q)
            offset += part.tokens
        outs = []
        for part, part_q in zip(parts, queries, strict=True):
            n, t = part.position_ids.shape
            out = self.kernels.attend(self, part, part_q, k_cache, v_cache)  # [N, Hq, T, D]
            outs.append(out.transpose(1, 2).reshape(n * t, -1))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return self.o_proj(out[None]), k_cache, v_cache

    def _write(self, part: GraphPart, q, k, v, k_cache, v_cache):
        """One part's q/k/v rows [n * t, heads * D] -> (queries [N, Hq, T, D], caches with the
        part's K/V written at its positions)."""
        n, t = part.position_ids.shape
        q = q.reshape(n, t, self.num_heads, self.head_dim)
        k = k.reshape(n, t, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [N, Hq, T, D], [N, Hkv, T, D]
        if self.use_rope:
            cos_sin = part.rotaries[1] if self.local_rope else part.rotaries[0]
            q, k = apply_rotary(q, *cos_sin), apply_rotary(k, *cos_sin)
        position_ids, rows = part.position_ids, part.seq_ids[:, None]
        if self.block_size is not None:
            rows, index = block_positions(part.seq_ids, position_ids, self.block_size)
        elif self.ring is not None:
            index = torch.remainder(position_ids, self.ring)
        else:
            index = position_ids
        k_cache = scatter_cache(k_cache, rows, index, k.transpose(1, 2), self.functional_cache)
        v_cache = scatter_cache(v_cache, rows, index, v, self.functional_cache)
        return q, k_cache, v_cache

    def read_extent(self, read: CacheRead) -> tuple[int, int | torch.SymInt]:
        """(window, live) this layer reads of each slot: a ring layer reads its whole ring."""
        return (read.window, read.live) if self.ring is None else (self.ring, self.ring)

    def reference_attend(self, part: GraphPart, q, k_cache, v_cache) -> torch.Tensor:
        """The reference read (Kernels.attend): decode rows over views of the cache in slot
        order, a chunk over its row's gathered window; the masked softmax. A paged model
        gathers every row's blocks, decode rows too (a pool has no slot order).

        `part.one_row_per_slot` is the graph kind's choice (TG: N = batch_size rows), never
        inferred from a shape, so a new graph cannot silently take the other path."""
        _, live = self.read_extent(part.read)
        if self.block_size is not None:
            keys, values = gather_blocks(k_cache, part.seq_ids), gather_blocks(v_cache, part.seq_ids)
            key_positions = self.key_positions(part.position_ids, keys.shape[2])
            return self.masked_softmax(q, keys, values, part.position_ids, key_positions)
        if part.one_row_per_slot:
            return self.attend_in_slot_order(q, k_cache, v_cache, part, live, self.masked_softmax)
        keys, values = k_cache[part.seq_ids, :, :live], v_cache[part.seq_ids, :, :live]
        key_positions = self.key_positions(part.position_ids, live)
        return self.masked_softmax(q, keys, values, part.position_ids, key_positions)

    def key_positions(self, position_ids: torch.Tensor, window: int) -> torch.Tensor:
        """[N or 1, window] absolute position of each cache entry read. A padded row repeats
        its last real position, so the last column is the last position written."""
        if self.ring is None:
            return torch.arange(window, device=position_ids.device)[None]
        return ring_positions(position_ids[:, -1], self.ring)

    def attend_in_slot_order(self, q, k_cache, v_cache, part: GraphPart, live, core) -> torch.Tensor:
        """A step with one row per slot (TG) attends over views of the cache: gathering every
        row's window would copy the whole live cache each step. Rows are moved to their slots
        and back; a slot with no row attends to whatever it holds, and the result is dropped.
        Padded rows repeat a real row, so duplicate seq_ids copy identical values. `core`:
        (q, keys, values, position_ids, key_positions) -> output, as masked_softmax."""
        seq_ids, position_ids, slots = part.seq_ids, part.position_ids, k_cache.shape[0]
        q_slots = q.new_zeros(slots, *q.shape[1:]).index_copy(0, seq_ids, q)
        pos_slots = position_ids.new_zeros(slots, position_ids.shape[1]).index_copy(0, seq_ids, position_ids)
        keys, values = k_cache[:, :, :live], v_cache[:, :, :live]
        key_positions = self.key_positions(pos_slots, live)
        return core(q_slots, keys, values, pos_slots, key_positions).index_select(0, seq_ids)

    def masked_softmax(self, q, keys, values, position_ids, key_positions) -> torch.Tensor:
        """q [N, Hq, T, D] over keys/values [N, Hkv, W, D] -> [N, Hq, T, D], W the positions
        read: masked scores (MASK_VALUE), softmax, values - what every backend can lower.

        Grouped-query attention without expanding K/V: query heads k*G..k*G+G-1 share KV
        head k (transformers' repeat_kv order), so they are stacked along the query axis.
        Batched 3-D products over (row, KV head) and a mask made at the scores' shape: no view
        of a scores buffer feeds a matmul (AOTInductor cannot lay one out when its live width
        is unbacked and a dim is 1). Query positions are tiled group-major, as q.
        """
        n, _, t, _ = q.shape
        groups, kv_heads, read = self.num_heads // self.num_kv_heads, self.num_kv_heads, keys.shape[2]
        q = q.reshape(n * kv_heads, groups * t, self.head_dim)
        keys, values = keys.reshape(n * kv_heads, read, -1), values.reshape(n * kv_heads, read, -1)
        mask = attention_mask(position_ids.repeat(1, groups), key_positions, self.sliding_window)
        mask = mask.expand(n, kv_heads, groups * t, read).reshape(n * kv_heads, groups * t, read)
        scores = torch.where(mask, (torch.bmm(q, keys.transpose(1, 2)) * self.scale).float(), MASK_VALUE)
        if self.sinks is not None:  # eager_attention_forward of gpt_oss: an extra column, dropped after
            sinks = self.sinks.float().view(1, kv_heads, groups, 1).repeat_interleave(t, dim=2)
            sinks = sinks.expand(n, -1, -1, -1).reshape(n * kv_heads, groups * t, 1)
            probs = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :read]
        else:
            probs = torch.softmax(scores, dim=-1)
        return torch.bmm(probs.to(values.dtype), values).view(n, self.num_heads, t, self.head_dim)
