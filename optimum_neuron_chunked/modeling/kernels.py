"""Per-backend choices of how the same math is computed, made here only (by measurement).

- attention: "masked_softmax" (explicit scores, MASK_VALUE fill) or "sdpa" (fused). The cpu
  backend compiles SDPA, which AOTInductor lowers to a CPU flash kernel that never
  materialises the [T, W] scores (benchmark/attention_kernel.py). Eager keeps the reference
  path; XLA / Neuron keep the masked softmax with -1e9 (exp of dtype-min NaNs on Neuron).
- expert_selection: a MoE graph of M tokens gathers its selected experts' weights while
  M * top_k / E < this fraction, else runs every expert densely. 1.0 is neuronx-distributed's
  rule (DEFAULT_SELECTIVE_LOADING_THRESHOLD, modules/moe/model_utils.py, Release 2.29 / 0.18.0).
  On CPU the gather copies the weights it selects (and first-touches new pages), so it pays
  only for small selections: 0.2 sits between the measured wins at 1/16 and 1/8 and the
  losses at 1/4 (benchmark/moe_experts.py, results moe-2026-11-23-vm).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelChoices:
    attention: str = "masked_softmax"
    expert_selection: float = 1.0


BY_BACKEND = {"cpu": KernelChoices(attention="sdpa", expert_selection=0.2)}


def kernel_choices(backend: str) -> KernelChoices:
    return BY_BACKEND.get(backend, KernelChoices())
