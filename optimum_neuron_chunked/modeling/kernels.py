"""How a backend computes the shared math: the one interface between the model and a backend's
tuning. `Kernels` itself is the reference - what eager, XLA and Neuron compute, and what every
other strategy is tested against: plain linear layers, attention as the masked softmax over
each row's gathered bucket window (decode rows: over views of the cache in slot order), and
experts gathered by neuronx-distributed's rule.

A backend whose compiler can do better subclasses it (backends/cpu/kernels.py) and hands its
instance to the model (Backend.kernels); the model calls only these methods.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from .attention import Attention, CacheRead, GraphPart


class Kernels:
    # A MoE graph of M tokens gathers its selected experts' weights while M * top_k / E is
    # under this fraction, else runs every expert densely: neuronx-distributed's rule
    # (DEFAULT_SELECTIVE_LOADING_THRESHOLD, modules/moe/model_utils.py, Release 2.29 / 0.18.0).
    expert_selection: float = 1.0

    def linear(self, in_features: int, out_features: int, bias: bool) -> nn.Module:
        """A tp-1 linear layer (parallel.TorchLayers builds every projection with it)."""
        return nn.Linear(in_features, out_features, bias=bias)

    def cache_read(
        self, position_ids: torch.Tensor, seq_ids: torch.Tensor, window: int, one_row_per_slot: bool
    ) -> CacheRead:
        """What every layer reads of its cache in one call: the whole context bucket."""
        from .attention import CacheRead

        return CacheRead(window, window)

    def attend(
        self,
        attention: Attention,
        part: GraphPart,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """One part's queries [N, Hq, T, D] over its slots -> [N, Hq, T, D]."""
        return attention.reference_attend(part, q, k_cache, v_cache)
