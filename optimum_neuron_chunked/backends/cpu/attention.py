"""The cpu backend's attention paths (kernels.KernelChoices): where they differ from the
reference (modeling/kernels.py) is only in what they read and which core computes - views of
a block (or a row's live blocks) up to its live length instead of gathered bucket windows, and
SDPA or a custom op instead of the masked softmax. Each falls back to the reference's pieces
where it does not apply (rings, sliding windows, sinks, other dtypes)."""

from __future__ import annotations

import functools

import torch
from torch import nn

from ...modeling.kernels import AttentionSpec, GraphPart, attend_read, attention_mask, masked_softmax
from ...modeling.kv_cache import KVCache
from .chunk_attention import chunk_attention
from .decode_attention import decode_attention


def attend(choices, decode_op: bool, spec: AttentionSpec, part: GraphPart, q, cache: KVCache, sinks):
    """One part's queries [N, Hq, T, D] over its blocks -> [N, Hq, T, D] (Kernels.attend)."""
    if decode_op and part.decode_rows and part.position_ids.shape[1] == 1 and _plain_fp32(spec, q):
        return _decode_op(spec, part, q, cache)
    read = part.read
    live = cache.extent(read.window, read.live)[1]
    if read.pool_order:
        core = _core(choices, spec, part, cache, sinks)
        if read.rows is not None:
            return _attend_per_row(q, cache, part.position_ids, read.rows, core)
        return attend_read(q, cache, part, live, core)
    if read.block is not None:
        keys, values, key_positions = cache.read_block(read.block, live, part.position_ids)
    else:  # the blocks holding the live context (read.live: every row's, with live_window)
        size = cache.keys.shape[2]
        blocks = (live + size - 1) // size
        torch._check(blocks <= part.tables.shape[1])
        keys, values, key_positions = cache.read_tables(part.tables[:, :blocks], live, part.position_ids)
    return _attend_windows(choices, spec, part, q, cache, sinks, keys, values, key_positions)


def _decode_op(spec: AttentionSpec, part: GraphPart, q, cache: KVCache) -> torch.Tensor:
    """Each row over its positions 0..its own, read in place: [N, Hq, 1, D]."""
    lengths = part.position_ids[:, 0] + 1
    out = decode_attention(q[:, :, 0], cache.keys, cache.values, part.tables, lengths, spec.scale)
    return out[:, :, None]


def _plain_fp32(spec: AttentionSpec, q: torch.Tensor) -> bool:
    """What the C++ decode op computes: plain causal layers in fp32."""
    return spec.plain_causal and q.dtype == torch.float32


def _core(choices, spec: AttentionSpec, part: GraphPart, cache: KVCache, sinks):
    """SDPA from the choice's window on (none for gpt-oss: its sinks join the softmax, where
    SDPA has no place for them), else the reference's masked softmax."""
    window = cache.extent(part.read.window, part.read.live)[0]
    sdpa_from = choices.sdpa_decode_from_window if part.decode_rows else choices.sdpa_prefill_from_window
    use_sdpa = not spec.sinks and sdpa_from is not None and window >= sdpa_from
    return _sdpa(spec) if use_sdpa else functools.partial(masked_softmax, spec, sinks)


def _attend_windows(
    choices, spec: AttentionSpec, part: GraphPart, q, cache, sinks, keys, values, key_positions
):
    """A part's queries over each row's window read from position 0 (a ring: its whole ring),
    keys / values [N, Hkv, W, D]: the oneDNN chunk op for one wide plain causal chunk, else
    the part's core."""
    position_ids, window = part.position_ids, cache.extent(part.read.window, part.read.live)[0]
    onednn_from = choices.onednn_chunk_attention_from_window if spec.plain_causal else None
    if not part.decode_rows and onednn_from is not None and window >= onednn_from and q.shape[0] == 1:
        return chunk_attention(q[0], keys[0], values[0], position_ids[0], spec.scale)[None]
    core = _core(choices, spec, part, cache, sinks)
    return core(q, keys, values, position_ids, key_positions)


def _sdpa(spec: AttentionSpec):
    """SDPA as an attention core (the masked softmax's signature): AOTInductor lowers it to a
    fused CPU kernel that never materialises the [T, W] scores. GQA order as ours: query head
    h uses KV head h // groups."""

    def core(q, keys, values, position_ids, key_positions):
        mask = attention_mask(position_ids, key_positions, spec.sliding_window)  # [N, 1, T, W]
        return nn.functional.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=spec.scale, enable_gqa=True
        )

    return core


def _attend_per_row(q, cache: KVCache, position_ids, rows, core) -> torch.Tensor:
    """Decode rows where each row reads its own block and live length
    (CpuCacheRead.rows): the step reads the sum of the rows' contexts, not rows x the longest.
    Padded rows repeat a real row: the same result, computed twice."""
    outs = []
    for i, (block, live) in enumerate(rows):
        row_positions = position_ids[i : i + 1]
        keys, values, key_positions = cache.read_block(block, live, row_positions)
        outs.append(core(q[i : i + 1], keys, values, row_positions, key_positions))
    return torch.cat(outs)
