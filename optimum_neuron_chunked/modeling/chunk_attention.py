"""A prefill chunk's causal attention through oneDNN, one KV head at a time (cpu backend only,
kernels.onednn_chunk_attention).

ATen's CPU flash attention (what SDPA lowers to) runs its products on MKL sgemm, which uses no
AVX-512 on AMD hosts; oneDNN's matmul (`torch.ops.mkldnn._linear_pointwise`, the kernel the
cpu backend's linear layers call) does. The op is opaque to the graph compiler: AOTInductor
calls it as an extern kernel through its proxy executor, so it must be registered (this module
imported) in any process that loads a cpu export; modeling/__init__ imports it.

Why an op and not the same calls inline: with the live width unbacked, AOTInductor cannot lay
out the second product's operands (the softmax output and a transposed cache view) for an
extern kernel (`LoweringException: NotImplementedError: Pointwise`, torch 2.13).
"""

from __future__ import annotations

import torch

from .layers import MASK_VALUE


def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T through oneDNN (looked up per call: torch builds without oneDNN import this)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [None], "")


@torch.library.custom_op("optimum_neuron_chunked::chunk_attention", mutates_args=())
def chunk_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """query [Hq, T, D], keys / values [Hkv, W, D] (the slot's first W cache positions),
    positions [T] (the chunk's, a padded row repeating the last real one) -> [Hq, T, D].
    Query head h reads KV head h // (Hq / Hkv), as transformers' repeat_kv.

    Causal only (no sliding window, no sinks): every key before the chunk's first position is
    visible to every row, so the mask covers the last W - positions[0] <= T columns only.
    One query head at a time: its [T, W] scores stay small enough to be reused from cache
    (two heads at once measured slower at W >= 2048)."""
    groups = query.shape[0] // keys.shape[0]
    first = int(positions[0])
    hidden = torch.arange(first, keys.shape[1], device=positions.device)[None] > positions[:, None]
    query = query * scale
    out = torch.empty_like(query)
    for kv_head in range(keys.shape[0]):
        values_t = values[kv_head].t().contiguous()  # [D, W]: oneDNN's "weight" for P @ V
        for head in range(kv_head * groups, (kv_head + 1) * groups):
            scores = _linear(query[head], keys[kv_head])  # [T, W]
            scores[:, first:].masked_fill_(hidden, MASK_VALUE)
            torch.ops.aten._softmax.out(scores, -1, False, out=scores)  # row-wise: safe in place
            out[head] = _linear(scores, values_t)
    return out


@chunk_attention.register_fake
def _(query, keys, values, positions, scale):
    return torch.empty_like(query)
