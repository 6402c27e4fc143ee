"""A compiler probe for AWS's attention kernel: one attention_cte call at a chosen graph's
shapes, compiled alone by neuronx-cc (through NxD's ModelBuilder, as the bundle is) before any
graph of the export. A refusal is known after a graph of one op, and only the graphs of that
shape fall back to the reference attention; the rest of the export compiles once.

The probe calls the kernel exactly as the graphs do (NkiKernels.call) on inputs of the graph's
per-rank shapes: T queries, T active and the prior of attention_choice.kernel_prior, the
sliding window and sinks of each layer attention_choice.kernel_layers names (ring layers keep
the reference: the choice checks the same layers' windows), and the EAGLE3 head's attention
(its own query heads: its DC graphs run the kernel at the chunks' shapes)."""

from __future__ import annotations

import torch
from torch import nn

from ...config import NeuronConfig
from ...modeling.family import FamilySpec
from ...modeling.kernels import AttentionSpec
from ...modeling.parallel import ShardLayout
from .attention_choice import kernel_layers, kernel_prior
from .nki_kernels import NkiKernels


def kernel_specs(
    config: NeuronConfig, family: FamilySpec, head: FamilySpec | None = None
) -> list[AttentionSpec]:
    """The distinct attention specs (per rank) of the layers that can run the kernel, the
    EAGLE3 head's too (`head`: its layer as a family, Eagle3Spec.family; full attention)."""
    specs = {attention_spec(config, family, family.sliding_windows[i]) for i in kernel_layers(config, family)}
    if head is not None:
        specs.add(attention_spec(config, head, None))
    return sorted(specs, key=repr)


def attention_spec(config: NeuronConfig, family: FamilySpec, sliding_window: int | None) -> AttentionSpec:
    """A layer's AttentionSpec per rank, as attention.Attention builds it."""
    shard = ShardLayout.of(family, config.tp_degree)
    return AttentionSpec(
        shard.heads_per_rank,
        shard.kv_heads_per_rank,
        family.head_dim,
        family.scale,
        sliding_window,
        family.attention_sinks,
    )  # fmt: skip


class KernelProbe(nn.Module):
    """attention_cte on a chunk of `tokens` over a `window`-position context, nothing else.
    forward's parameters are named (NxD's ModelBuilder refuses *args)."""

    def __init__(self, kernels: NkiKernels, spec: AttentionSpec, tokens: int, window: int, dtype):
        super().__init__()
        self.kernels, self.spec = kernels, spec
        self.tokens, self.window, self.dtype = tokens, window, dtype

    def example_inputs(self) -> dict[str, torch.Tensor]:
        """Keyword inputs (ModelBuilder.trace's `kwargs`): no prior for a CE shape (W == T)."""
        s, t = self.spec, self.tokens
        prior, _ = kernel_prior(self.window, t)

        def zeros(heads: int, positions: int) -> torch.Tensor:
            return torch.zeros(heads, positions, s.head_dim, dtype=self.dtype)

        inputs = {"query": zeros(s.num_heads, t), "active_k": zeros(s.num_kv_heads, t)}
        inputs["active_v"] = zeros(s.num_kv_heads, t)
        if prior:
            inputs |= {"prior_k": zeros(s.num_kv_heads, prior), "prior_v": zeros(s.num_kv_heads, prior)}
            inputs["prior_len"] = torch.zeros(1, dtype=torch.int32)
        if s.sinks:
            inputs["sinks"] = torch.zeros(s.num_heads)
        return inputs

    def forward(
        self,
        query: torch.Tensor,
        active_k: torch.Tensor,
        active_v: torch.Tensor,
        prior_k: torch.Tensor | None = None,
        prior_v: torch.Tensor | None = None,
        prior_len: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        prior = None if prior_k is None else (prior_k, prior_v, prior_len)
        return self.kernels.call(self.spec, query, active_k, active_v, prior, sinks)
