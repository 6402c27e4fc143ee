"""The neuron backend's kernels: a prefill chunk attends through nkilib's `attention_cte` (the
graphs attention_choice.py chose), everything else through the reference (modeling/kernels.py).

The call follows NxD Inference's prefix prefill (modules/attention/attention_base.py,
`perform_prefix_prefill`, l.772): heads fold into the kernel's batch dimension, q is scaled
first and the kernel's scale is 1.0 (it requires 1.0 with a prior), the kernel is wrapped by
`nki.jit` and called with a grid of the logical core's NeuronCores, the kernel reading query
head h from KV head h // groups itself (tp_q=True). trn2 only: NeuronCore-v2 runs no NKI
kernel of SDK 2.29+ (attention_choice.target_misfit). Keyword arguments only: the signature
grew between nki-library's 2.28 and 2.29_release branches.

What the kernel reads, for a chunk of T tokens (padded: repeating the last real token and
position) at positions start.. of a row whose context bucket is W (start + real tokens <= W):
- the row's context, read through its block tables (KVCache.read_tables), position p at index p;
- the prior: its first W - T positions, of which the first `base` are visible, where
  base = min(start, W - T) (attention_choice.kernel_prior); the active keys: the T positions
  base.., causal by index. So the kernel sees W positions in all;
- queries laid out by position: query index i is position base + i. A real query at position
  p sits at index p - base < T and sees prior [0, base) and active keys base..p: positions
  0..p, as the reference. Indices holding no real query compute what is thrown away; each
  token's output is gathered back at its position, so padded copies get the last real token's.
A CE graph (W == T, start 0) has no prior: the kernel is called without one, as NxD
Inference's `perform_prefill` calls it.

Imports nothing closed beyond `nki` and `nkilib`, lazily: stand-ins can take their place
(tests/nkilib_source_check.py).
"""

from __future__ import annotations

import functools
import importlib

import torch

from ...modeling.kernels import AttentionSpec, GraphPart, Kernels
from ...modeling.kv_cache import KVCache
from .attention_choice import KERNEL_MODULE, kernel_prior


@functools.cache
def attention_cte():
    """nkilib's attention_cte wrapped by nki.jit, as NxD Inference wraps it."""
    nki = importlib.import_module("nki")
    return nki.jit(importlib.import_module(KERNEL_MODULE).attention_cte)


class NkiKernels(Kernels):
    """`chunk_shapes`: (tokens, context bucket) of the chunk parts that run the kernel (one per
    chosen graph); `grid`: NeuronCores of a logical core."""

    def __init__(self, chunk_shapes: frozenset[tuple[int, int]], grid: int = 1):
        self.chunk_shapes = chunk_shapes
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
        if not chunk or not cache.layer.position_ordered:
            return super().attend(spec, part, q, cache, sinks)
        return self._chunk(spec, part, q, cache, sinks)

    def _chunk(self, spec: AttentionSpec, part: GraphPart, q, cache: KVCache, sinks) -> torch.Tensor:
        """q [1, Hq, T, D] of one chunk -> [1, Hq, T, D] through attention_cte."""
        keys, values, _ = cache.read_tables(part.tables, part.read.window, part.position_ids)
        context_k, context_v = keys[0], values[0]  # [Hkv, W, D], position p at index p
        window, tokens = context_k.shape[1], q.shape[2]
        positions = part.position_ids[0]
        prior, base = kernel_prior(window, tokens, positions[:1])  # base: [1]
        by_position = base + torch.arange(tokens, device=positions.device)
        index = torch.clamp(by_position - positions[:1], min=0)  # query of each position index
        query = (q[0] * spec.scale).to(context_k.dtype).index_select(1, index)  # [Hq, T, D]
        before = (context_k[:, :prior], context_v[:, :prior], base) if prior else None
        active = (context_k.index_select(1, by_position), context_v.index_select(1, by_position))
        out = self.call(spec, query, *active, before, sinks)
        return out.index_select(1, positions - base)[None].to(q.dtype)

    def call(self, spec: AttentionSpec, query, active_k, active_v, prior, sinks) -> torch.Tensor:
        """attention_cte on query [Hq, T, D] (scaled), active K/V [Hkv, T, D] and `prior` (K, V
        [Hkv, S, D], visible length [1]) or None -> [Hq, T, D]. tests/ and the compile probe
        (backend.py) call it with shapes of their own."""
        prior_k = prior_v = prior_len = None
        if prior is not None:
            prior_k, prior_v, prior_len = prior[0], prior[1], prior[2].to(torch.int32)
        kernel = attention_cte()
        call = kernel[self.grid] if self.grid > 1 else kernel
        return call(
            query,
            active_k,
            active_v,
            scale=1.0,
            causal_mask=True,
            k_prior=prior_k,
            v_prior=prior_v,
            prior_used_len=prior_len,
            sink=None if sinks is None else sinks.float()[:, None],
            sliding_window=spec.sliding_window or 0,  # 0: none (the torch reference compares it)
            tp_q=True,
            tp_k=True,
            tp_out=False,
        )  # [Hq, T, D]
