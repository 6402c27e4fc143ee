"""The cpu backend's attention paths (kernels.KernelChoices): where they differ from the
reference (modeling/attention.py) is only in what they read and which core computes - views of
a slot (or a row's blocks) up to its live length instead of gathered bucket windows, and SDPA
or a custom op instead of the masked softmax. Each falls back to the reference's pieces where
it does not apply (rings, sliding windows, sinks, other dtypes)."""

from __future__ import annotations

import torch
from torch import nn

from ...modeling.attention import Attention, GraphPart, attention_mask, gather_blocks
from .chunk_attention import chunk_attention
from .decode_attention import decode_attention


def attend(choices, attention: Attention, part: GraphPart, q, k_cache, v_cache) -> torch.Tensor:
    """One part's queries [N, Hq, T, D] over its slots -> [N, Hq, T, D] (Kernels.attend)."""
    if _op_decodes(choices.decode_attention_op, attention, part, q):
        return _decode_op(attention, part, q, k_cache, v_cache)
    position_ids, read = part.position_ids, part.read
    live = attention.read_extent(read)[1]
    if part.one_row_per_slot:
        core = _core(choices, attention, part)
        if read.rows is not None and attention.ring is None:
            return _attend_per_row(attention, q, k_cache, v_cache, position_ids, read.rows, core)
        return attention.attend_in_slot_order(q, k_cache, v_cache, part, live, core)
    keys, values = _row_windows(k_cache, v_cache, part.seq_ids, read.slot, live)
    return _attend_windows(choices, attention, part, q, keys, values)


def attend_paged(choices, attention: Attention, part: GraphPart, q, k_pool, v_pool) -> torch.Tensor:
    """Kernels.attend of a paged model (part.seq_ids: block tables [N, W / P]): decode rows
    through the decode op, reading blocks in place; other reads gather the blocks holding the
    live context (read.live positions: every row's with live_window), not the bucket's."""
    if _op_decodes(choices.paged_decode_op, attention, part, q):
        return _decode_op(attention, part, q, k_pool, v_pool)
    blocks = (part.read.live + attention.block_size - 1) // attention.block_size
    torch._check(blocks <= part.seq_ids.shape[1])
    tables = part.seq_ids[:, :blocks]
    keys, values = gather_blocks(k_pool, tables), gather_blocks(v_pool, tables)
    return _attend_windows(choices, attention, part, q, keys, values)


def _op_decodes(chosen: bool, attention: Attention, part: GraphPart, q: torch.Tensor) -> bool:
    """Whether the C++ decode op computes this part: one token per row (its slot or its block
    table in part.seq_ids), in a plain causal fp32 layer, where the choice turns it on."""
    return chosen and part.one_row_per_slot and part.position_ids.shape[1] == 1 and _plain_fp32(attention, q)


def _decode_op(attention: Attention, part: GraphPart, q, k_cache, v_cache) -> torch.Tensor:
    """Each row over its positions 0..its own, read in place: [N, Hq, 1, D]."""
    lengths = part.position_ids[:, 0] + 1
    return decode_attention(q[:, :, 0], k_cache, v_cache, part.seq_ids, lengths, attention.scale)[:, :, None]


def _plain_fp32(attention: Attention, q: torch.Tensor) -> bool:
    """What the C++ decode op computes: plain causal layers in fp32."""
    return attention.plain_causal and q.dtype == torch.float32


def _core(choices, attention: Attention, part: GraphPart):
    """SDPA from the choice's window on (none for gpt-oss: its sinks join the softmax, where
    SDPA has no place for them), else the reference's masked softmax."""
    window = attention.read_extent(part.read)[0]
    sdpa_from = choices.sdpa_decode_from_window if part.one_row_per_slot else choices.sdpa_prefill_from_window
    use_sdpa = attention.sinks is None and sdpa_from is not None and window >= sdpa_from
    return _sdpa(attention) if use_sdpa else attention.masked_softmax


def _attend_windows(choices, attention: Attention, part: GraphPart, q, keys, values) -> torch.Tensor:
    """A part's queries over each row's window read from position 0 (a ring: its whole ring),
    keys / values [N, Hkv, W, D]: the oneDNN chunk op for one wide plain causal chunk, else
    the part's core."""
    position_ids, window = part.position_ids, attention.read_extent(part.read)[0]
    onednn_from = choices.onednn_chunk_attention_from_window if attention.plain_causal else None
    if not part.one_row_per_slot and onednn_from is not None and window >= onednn_from and q.shape[0] == 1:
        return chunk_attention(q[0], keys[0], values[0], position_ids[0], attention.scale)[None]
    core = _core(choices, attention, part)
    return core(q, keys, values, position_ids, attention.key_positions(position_ids, keys.shape[2]))


def _sdpa(attention: Attention):
    """SDPA as an attention core (the masked softmax's signature): AOTInductor lowers it to a
    fused CPU kernel that never materialises the [T, W] scores. GQA order as ours: query head
    h uses KV head h // groups."""

    def core(q, keys, values, position_ids, key_positions):
        mask = attention_mask(position_ids, key_positions, attention.sliding_window)  # [N, 1, T, W]
        return nn.functional.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=attention.scale, enable_gqa=True
        )

    return core


def _row_windows(k_cache, v_cache, seq_ids, slot, live) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `live` cache positions of each row's slot: keys, values [N, Hkv, W, D]. A graph
    of one row reads its slot (a scalar, CpuCacheRead.slot) as a view; otherwise the windows
    are gathered (copied)."""
    if slot is not None:
        torch._check(slot < k_cache.shape[0])
        return k_cache[slot, :, :live][None], v_cache[slot, :, :live][None]
    return k_cache[seq_ids, :, :live], v_cache[seq_ids, :, :live]


def _attend_per_row(attention: Attention, q, k_cache, v_cache, position_ids, rows, core) -> torch.Tensor:
    """A step with one row per slot (TG) where each row reads its own slot and live length
    (CpuCacheRead.rows): the step reads the sum of the rows' contexts, not rows x the longest.
    Padded rows repeat a real row: the same result, computed twice."""
    outs = []
    for i, (slot, live) in enumerate(rows):
        torch._check(slot < k_cache.shape[0])
        keys, values = k_cache[slot, :, :live][None], v_cache[slot, :, :live][None]
        row_positions = position_ids[i : i + 1]
        key_positions = attention.key_positions(row_positions, live)
        outs.append(core(q[i : i + 1], keys, values, row_positions, key_positions))
    return torch.cat(outs)
