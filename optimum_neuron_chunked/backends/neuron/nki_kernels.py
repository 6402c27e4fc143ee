"""The neuron backend's kernels: a prefill chunk attends through nkilib's `attention_cte` (the
graphs attention_choice.py chose), everything else through the reference (modeling/kernels.py).

The call follows NxD Inference's prefix prefill (modules/attention/attention_base.py,
`perform_prefix_prefill`, release 2.29): heads fold into the kernel's batch dimension, q is
scaled first and the kernel's scale is 1.0 (it requires 1.0 with a prior), the kernel is
wrapped by `nki.jit` and called with a grid of the logical core's NeuronCores where there are
several; on trn1 / inf2 K/V heads are repeated to the query heads and q goes in as [H, D, T]
(tp_q=False), on trn2 the kernel reads query head h from KV head h // groups itself. Keyword
arguments only: the signature grew between nki-library's 2.28 and 2.29_release branches.

What the kernel reads: the row's context read as the layout says (KVCache.read: a
whole-sequence block as it is, smaller blocks gathered, linear in the window) is the prior, of
which the first `prior_used_len` = the chunk's first position are visible; the chunk's own K/V,
just written, are read back at its positions and attend causally by index. A padded chunk
repeats its last token and position, so a padded query would see the padded keys too: its
output is replaced by the last real token's, so padded copies compute exactly what the last
real token does (modeling/kv_cache.py's invariant) and the next layer writes identical K/V.

Imports nothing closed beyond `nki` and `nkilib`, lazily: stand-ins can take their place
(tests/nkilib_source_check.py).
"""

from __future__ import annotations

import functools
import importlib

import torch

from ...modeling.kernels import AttentionSpec, GraphPart, Kernels
from ...modeling.kv_cache import KVCache
from .attention_choice import KERNEL_MODULE


@functools.cache
def attention_cte():
    """nkilib's attention_cte wrapped by nki.jit, as NxD Inference wraps it."""
    nki = importlib.import_module("nki")
    return nki.jit(importlib.import_module(KERNEL_MODULE).attention_cte)


class NkiKernels(Kernels):
    """`chunk_shapes`: (tokens, context bucket) of the chunk parts that run the kernel (one per
    chosen graph); `native_gqa`: the kernel maps query heads to KV heads (trn2), else K/V heads
    are repeated (trn1, inf2); `grid`: NeuronCores of a logical core."""

    def __init__(self, chunk_shapes: frozenset[tuple[int, int]], native_gqa: bool, grid: int = 1):
        self.chunk_shapes = chunk_shapes
        self.native_gqa = native_gqa
        self.grid = grid

    def attend(
        self,
        spec: AttentionSpec,
        part: GraphPart,
        q: torch.Tensor,
        cache: KVCache,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        rows, tokens = part.position_ids.shape
        chunk = not part.decode_rows and rows == 1 and (tokens, part.read.window) in self.chunk_shapes
        if not chunk or cache.layer.ring is not None:  # a ring is not in position order
            return super().attend(spec, part, q, cache, sinks)
        return self._chunk(spec, part, q, cache, sinks)

    def _chunk(self, spec: AttentionSpec, part: GraphPart, q, cache: KVCache, sinks) -> torch.Tensor:
        """q [1, Hq, T, D] of one chunk -> [1, Hq, T, D] through attention_cte."""
        keys, values, _ = cache.read(part.tables, part.read.window, part.position_ids)
        prior_k, prior_v = keys[0], values[0]  # [Hkv, W, D], position p at index p
        positions = part.position_ids[0]
        active_k, active_v = prior_k.index_select(1, positions), prior_v.index_select(1, positions)
        if not self.native_gqa:
            groups = spec.num_heads // spec.num_kv_heads
            prior_k, prior_v, active_k, active_v = (
                x.repeat_interleave(groups, dim=0) for x in (prior_k, prior_v, active_k, active_v)
            )
        query = (q[0] * spec.scale).to(prior_k.dtype)  # [Hq, T, D]
        kernel = attention_cte()
        call = kernel[self.grid] if self.grid > 1 else kernel
        out = call(
            query if self.native_gqa else query.transpose(1, 2),
            active_k,
            active_v,
            scale=1.0,
            causal_mask=True,
            k_prior=prior_k,
            v_prior=prior_v,
            prior_used_len=positions[:1].to(torch.int32),
            sink=None if sinks is None else sinks.float()[:, None],
            sliding_window=spec.sliding_window or 0,  # 0: none (the torch reference compares it)
            tp_q=self.native_gqa,
            tp_k=True,
            tp_out=False,
        )  # [Hq, T, D]
        real = positions - positions[0]  # a padded token's index is its real twin's
        return out.index_select(1, real)[None].to(q.dtype)
