"""A decoder layer's attention module: projections, norms and rotary, then one write of the
step's K/V into the layer's KVCache and one read through the backend's Kernels.attend
(modeling/kernels.py: the interface and the reference read; kv_cache.py: the addressing)."""

from __future__ import annotations

import torch
from torch import nn

from .family import FamilySpec
from .kernels import AttentionSpec, GraphPart, Kernels
from .kv_cache import KVCache
from .layers import apply_rotary, rms_norm
from .lora import LoraSpec, attention_shapes, project, slot_modules
from .parallel import ShardLayout


class Attention(nn.Module):
    """Heads held by this rank: all of them at tp 1 (see parallel.py for the split)."""

    def __init__(
        self,
        spec: FamilySpec,
        *,
        sliding_window: int | None,
        layout: ShardLayout,
        layers,
        kernels: Kernels,
        use_rope: bool = True,
        local_rope: bool = False,
        lora_spec: LoraSpec | None = None,
        input_size: int | None = None,  # EAGLE3's head: 2 * hidden (modeling/eagle3.py)
    ):
        super().__init__()
        self.kernels = kernels
        self.use_rope = use_rope
        self.local_rope = local_rope  # gemma3's sliding layers: the local rotary (GraphPart.rotaries)
        d, hidden = spec.head_dim, spec.hidden_size
        width = input_size or hidden
        self.spec = AttentionSpec(
            num_heads=layout.heads_per_rank,
            num_kv_heads=layout.kv_heads_per_rank,
            head_dim=d,
            scale=spec.scale,
            sliding_window=sliding_window,
            sinks=spec.attention_sinks,
        )
        shapes = attention_shapes(width, layout.num_heads * d, layout.kv_heads * d, hidden)
        self.q_proj = layers.column(*shapes["q_proj"], bias=spec.qkv_bias)
        self.k_proj = layers.column(*shapes["k_proj"], bias=spec.qkv_bias)
        self.v_proj = layers.column(*shapes["v_proj"], bias=spec.qkv_bias)
        self.o_proj = layers.row(*shapes["o_proj"], bias=spec.o_bias)
        self.lora = slot_modules(lora_spec, layers, shapes)  # lora_targets.SLOTS
        if spec.qk_norm:
            self.q_norm = rms_norm(d, spec.rms_norm_eps, spec.gemma_norms)
            self.k_norm = rms_norm(d, spec.rms_norm_eps, spec.gemma_norms)
        else:
            self.q_norm = self.k_norm = None
        # gpt-oss: per query head, a logit that joins the softmax and takes probability mass
        self.sinks = nn.Parameter(torch.zeros(layout.heads_per_rank)) if spec.attention_sinks else None

    def forward(
        self,
        x: torch.Tensor,  # [1, R, H]: every part's tokens, part after part
        parts: tuple[GraphPart, ...],
        cache: KVCache,
        lora_mask: torch.Tensor | None = None,  # [R, S*r]: each token's adapter slot (lora.py)
    ) -> tuple[torch.Tensor, KVCache]:
        """-> (output [1, R, H], the cache written, in place or anew).

        The projections run once over all R tokens. Every part writes its K/V before any part
        reads: parts write distinct blocks, so the order does not change what is read, and a
        write after a read of the same buffer would make AOTInductor copy the whole cache."""
        q, k, v = (
            project(getattr(self, n), self.lora, n, x, lora_mask)[0] for n in ("q_proj", "k_proj", "v_proj")
        )
        queries, offset = [], 0
        for part in parts:
            rows = slice(offset, offset + part.tokens)
            part_q, cache = self._write(part, q[rows], k[rows], v[rows], cache)
            queries.append(part_q)
            offset += part.tokens
        outs = []
        for part, part_q in zip(parts, queries, strict=True):
            n, t = part.position_ids.shape
            out = self.kernels.attend(self.spec, part, part_q, cache, self.sinks)  # [N, Hq, T, D]
            outs.append(out.transpose(1, 2).reshape(n * t, -1))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return project(self.o_proj, self.lora, "o_proj", out[None], lora_mask), cache

    def _write(self, part: GraphPart, q, k, v, cache: KVCache) -> tuple[torch.Tensor, KVCache]:
        """One part's q/k/v rows [n * t, heads * D] -> (queries [N, Hq, T, D], the cache with
        the part's K/V written at its positions)."""
        n, t = part.position_ids.shape
        spec = self.spec
        q = q.reshape(n, t, spec.num_heads, spec.head_dim)
        k = k.reshape(n, t, spec.num_kv_heads, spec.head_dim)
        v = v.reshape(n, t, spec.num_kv_heads, spec.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [N, Hq, T, D], [N, Hkv, T, D]
        if self.use_rope:
            cos_sin = part.rotaries[1] if self.local_rope else part.rotaries[0]
            q, k = apply_rotary(q, *cos_sin), apply_rotary(k, *cos_sin)
        return q, cache.write(part.tables, part.position_ids, k.transpose(1, 2), v)
