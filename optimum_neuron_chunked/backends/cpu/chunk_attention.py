"""A prefill chunk's causal attention through oneDNN, one query head at a time (cpu backend only,
kernels.onednn_chunk_attention_from_window).

ATen's CPU flash attention (what SDPA lowers to) runs its products on MKL sgemm, which uses no
AVX-512 on AMD hosts; oneDNN's matmul (`torch.ops.mkldnn._linear_pointwise`, the kernel the
cpu backend's linear layers call) does. The op is opaque to the graph compiler: AOTInductor
calls it as an extern kernel through its proxy executor, so it must be registered (this module
imported) in any process that loads a cpu export; backends/cpu/attention.py imports it.

Why an op and not the same calls inline: with the live width unbacked, AOTInductor cannot lay
out the second product's operands (the softmax output and a transposed cache view) for an
extern kernel (`LoweringException: NotImplementedError: Pointwise`, torch 2.13).
"""

from __future__ import annotations

import torch

from ...modeling.layers import MASK_VALUE


def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T through oneDNN (looked up per call: torch builds without oneDNN import this)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [None], "")


# Query rows per oneDNN call: a [rows, W] score block small enough to stay in cache (a chunk
# of 256 is one block; a standard export's CE graph runs many, each reading only the keys up
# to its last row, so the causal upper triangle is skipped).
ROW_BLOCK = 256


@torch.library.custom_op("optimum_neuron_chunked::chunk_attention", mutates_args=())
def chunk_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """query [Hq, T, D], keys / values [Hkv, W, D] (the block's first W positions),
    positions [T] (the chunk's: consecutive, a padded row repeating the last real one)
    -> [Hq, T, D]. Query head h reads KV head h // (Hq / Hkv), as transformers' repeat_kv.

    Causal only (no sliding window, no sinks): every key before a row block's first position
    is visible to all its rows, so the mask covers only the block's own span of columns."""
    query = query * scale
    out = torch.empty_like(query)
    for start in range(0, positions.shape[0], ROW_BLOCK):
        rows = slice(start, start + ROW_BLOCK)
        _attend_rows(query[:, rows], keys, values, positions[rows], out[:, rows])
    return out


def _attend_rows(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, out: torch.Tensor
) -> None:
    """One row block into `out` (a view of the op's output), one query head at a time ([rows, W]
    scores; two heads at once measured slower at W >= 2048)."""
    groups = query.shape[0] // keys.shape[0]
    first, width = int(positions[0]), int(positions[-1]) + 1
    hidden = torch.arange(first, width, device=positions.device)[None] > positions[:, None]
    for kv_head in range(keys.shape[0]):
        block_keys = keys[kv_head, :width]
        values_t = values[kv_head, :width].t().contiguous()  # [D, W]: oneDNN's "weight" for P @ V
        for head in range(kv_head * groups, (kv_head + 1) * groups):
            scores = _linear(query[head], block_keys)  # [rows, W]
            scores[:, first:].masked_fill_(hidden, MASK_VALUE)
            torch.ops.aten._softmax.out(scores, -1, False, out=scores)  # row-wise: safe in place
            out[head] = _linear(scores, values_t)


@chunk_attention.register_fake
def _(query, keys, values, positions, scale):
    return torch.empty_like(query)
