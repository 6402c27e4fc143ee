"""The cpu backend's attention paths (kernels.KernelChoices): where they differ from the
reference (modeling/kernels.py) is only in what they read and which core computes - views of
a block (or a row's live blocks) up to its live length instead of gathered bucket windows, and
SDPA or a custom op instead of the masked softmax. `layer_plan` makes both choices for a layer
of a call, in one place; `attend` carries them out. Each falls back to the reference's pieces
where it does not apply (rings, sliding windows, sinks, other dtypes)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import Enum

import torch
from torch import nn

from ...modeling.kernels import AttentionSpec, GraphPart, attend_read, attention_mask, masked_softmax
from ...modeling.kv_cache import KVCache
from .chunk_attention import chunk_attention
from .decode_attention import decode_attention


class Read(Enum):
    IN_PLACE = "the decode op reads each row's blocks in place"
    PER_ROW = "each row's own block up to its own live length (views)"
    POOL = "every block of the pool in block order (views)"
    BLOCK = "the one row's block up to the live length (a view)"
    LIVE_BLOCKS = "the blocks holding the live context (gathered)"


class Core(Enum):
    DECODE_OP = "the C++ decode op"
    SDPA = "scaled_dot_product_attention"
    MASKED_SOFTMAX = "the reference's masked softmax"
    ONEDNN_CHUNK = "the oneDNN chunk op"


@dataclass(frozen=True)
class LayerPlan:
    read: Read
    core: Core


def layer_plan(
    choices, decode_op: bool, spec: AttentionSpec, part: GraphPart, cache: KVCache, dtype
) -> LayerPlan:
    """What one layer of a call reads and which core computes it, from the call's CacheRead
    (CpuKernels.cache_read: pool order, block, rows), the layer's spec and layout, the choices."""
    read = part.read
    if decode_op and part.decode_rows and part.position_ids.shape[1] == 1:
        # What the op reads: position p at index p of a row's blocks (the layout: no ring). What it
        # computes: causal attention without a sliding window or sinks (the mask), fp32 queries over
        # an fp32 pool (never an fp8 one: the op reads it raw).
        reads = cache.layer.position_ordered
        if reads and spec.plain_causal and dtype == torch.float32 and cache.keys.dtype == dtype:
            return LayerPlan(Read.IN_PLACE, Core.DECODE_OP)
    if read.pool_order:
        where = Read.PER_ROW if read.rows is not None else Read.POOL
    else:
        where = Read.BLOCK if read.block is not None else Read.LIVE_BLOCKS
    width = cache.extent(read.window, read.live)[0]  # the bucket, or a ring
    onednn_from = choices.onednn_chunk_attention_from_window if spec.plain_causal else None
    one_chunk = not part.decode_rows and part.position_ids.shape[0] == 1
    if (
        where in (Read.BLOCK, Read.LIVE_BLOCKS)
        and one_chunk
        and onednn_from is not None
        and width >= onednn_from
    ):
        return LayerPlan(where, Core.ONEDNN_CHUNK)
    # SDPA from the choice's width on (not for sinks: SDPA has no place for them)
    sdpa_from = choices.sdpa_decode_from_window if part.decode_rows else choices.sdpa_prefill_from_window
    use_sdpa = not spec.sinks and sdpa_from is not None and width >= sdpa_from
    return LayerPlan(where, Core.SDPA if use_sdpa else Core.MASKED_SOFTMAX)


def attend(choices, decode_op: bool, spec: AttentionSpec, part: GraphPart, q, cache: KVCache, sinks):
    """One part's queries [N, Hq, T, D] over its blocks -> [N, Hq, T, D] (Kernels.attend), as
    layer_plan says."""
    plan = layer_plan(choices, decode_op, spec, part, cache, q.dtype)
    if plan.core is Core.DECODE_OP:
        lengths = part.position_ids[:, 0] + 1
        out = decode_attention(q[:, :, 0], cache.keys, cache.values, part.tables, lengths, spec.scale)
        return out[:, :, None]
    read, position_ids = part.read, part.position_ids
    live = cache.extent(read.window, read.live)[1]
    core = _sdpa(spec) if plan.core is Core.SDPA else functools.partial(masked_softmax, spec, sinks)
    if plan.read is Read.PER_ROW:
        return _attend_per_row(q, cache, position_ids, read.rows, core)
    if plan.read is Read.POOL:
        return attend_read(q, cache, part, live, core)
    if plan.read is Read.BLOCK:
        keys, values, key_positions = cache.read_block(read.block, live, position_ids)
    else:  # the blocks holding the live context (read.live: every row's, with live_window)
        blocks = cache.layer.blocks_holding(live)
        torch._check(blocks <= part.tables.shape[1])
        keys, values, key_positions = cache.read_tables(part.tables[:, :blocks], live, position_ids)
    if plan.core is Core.ONEDNN_CHUNK:
        return chunk_attention(q[0], keys[0], values[0], position_ids[0], spec.scale)[None]
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
