"""Weight-only quantization: int8 or fp8 weights with float32 scales, symmetric.

Rule (NxD Inference's per-channel weight quantization, neuronx_distributed/quantization/):
each output channel (row of a [out, in] weight) gets scale = amax / qmax, qmax 127 for int8
and 240 for fp8 (Neuron's float8 e4m3 saturates at +-240, not OCP e4m3fn's +-448:
neuronx_distributed/quantization/README_rescaling_fp8_for_neuron.md), and the stored weight
is w / scale rounded to nearest (int8: an integer; fp8: an e4m3 value, ties to even). A
zero row gets scale 1.

A scale has as many dimensions as its weight, so the one sharding rule (parallel.py) splits
it with its weight: per channel [out, 1] (experts [E, out, 1]), block-wise (FP8 checkpoints)
[out / bo, in / bi]. A dimension of 1 is replicated.

The graphs compute y = (x @ cast(W).T) * scale for per-channel weights - the cast is exact
(int8 and e4m3 values are bfloat16 values) - and dequantize block-wise weights per block.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch
from torch import nn

from ..config import QUANTIZATIONS
from ..lora_targets import MLP_TARGETS, TARGETS, is_slot

STORAGE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
# fp8: Neuron's E4M3 saturates at +-240, not OCP e4m3fn's 448 (larger values become NaN on the
# device: neuronx_distributed/quantization/README_rescaling_fp8_for_neuron.md)
QMAX = {"int8": 127.0, "fp8": 240.0}
# An e4m3fn value calibrated for +-448 fits +-240 once halved, its scale doubled (exact but for
# the smallest subnormals): FP8 weights (fit_neuron_fp8) and checkpoint KV scales (kv_scale_for_neuron).
NEURON_FP8_FACTOR = 2.0
# Module-name suffixes of the projections quantized (attention, MLP: lora_targets.TARGETS; MoE
# experts); embeddings, lm_head, routers and norms are kept in --dtype.
QUANTIZED_MODULES = (*TARGETS, "experts")
EXPERT_WEIGHTS = MLP_TARGETS  # an expert's projections are named as a dense MLP's


@dataclass(frozen=True)
class QuantSpec:
    """How an export stores its quantized weights (NeuronConfig.quantization*)."""

    dtype: str  # "int8" | "fp8"
    block: tuple[int, int] | None = None  # block-wise scales (out, in); None: per output channel
    skip: tuple[str, ...] = ()  # module-name patterns kept in --dtype (`skips`)

    @classmethod
    def of(cls, config) -> QuantSpec | None:
        if not config.quantization:
            return None
        block = tuple(config.quantization_block) or None
        return cls(config.quantization, block, tuple(config.quantization_skip))

    @property
    def storage(self) -> torch.dtype:
        return STORAGE[self.dtype]

    def skips(self, module: str) -> bool:
        return any(module_matches(module, pattern) for pattern in self.skip)

    def quantizes(self, module: str) -> bool:
        """`module` (a decoder module name, e.g. model.layers.3.self_attn.q_proj) is stored quantized;
        a projection's LoRA slots (`...self_attn.lora.q_proj`, lora_targets.slot_name) keep --dtype."""
        named = module.rsplit(".", 1)[-1] in QUANTIZED_MODULES and not is_slot(module)
        return named and not self.skips(module)

    def scale_shape(self, weight_shape: tuple[int, ...]) -> tuple[int, ...]:
        *lead, out, inner = weight_shape
        if self.block is None:
            return (*lead, out, 1)
        return (*lead, out // self.block[0], inner // self.block[1])


def module_matches(module: str, pattern: str) -> bool:
    """A --quantization-skip pattern matches a module, or one of the modules holding it, by name
    suffix at a dot (`down_proj`; `layers.0.mlp`: layer 0's MLP projections; `layers.1`: layer
    1 and not 10), or it is a glob over the whole name (`model.layers.1?.*`)."""
    parts = module.split(".")
    holders = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return any(h == pattern or h.endswith("." + pattern) for h in holders) or fnmatch.fnmatchcase(
        module, pattern
    )


def quantize(weight: torch.Tensor, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., out, in] -> (stored weight, float32 scale [..., out, 1]) by the rule above."""
    w = weight.float()
    scale = w.abs().amax(-1, keepdim=True) / QMAX[dtype]
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return store_scaled(w, scale, dtype), scale


def store_scaled(x: torch.Tensor, scale: torch.Tensor | float, dtype: str) -> torch.Tensor:
    """x / scale as `dtype` stores it: saturated to +-QMAX, rounded to nearest (int8: an
    integer; fp8: the e4m3fn cast, ties to even). Weights (`quantize`) and an fp8 KV pool
    (kv_layout.KVStorage) store by this one rule."""
    q = (x.float() / scale).clamp(-QMAX[dtype], QMAX[dtype])
    return (torch.round(q) if dtype == "int8" else q).to(STORAGE[dtype])


def block_expand(scale: torch.Tensor, weight_shape: tuple[int, ...]) -> torch.Tensor:
    """A scale [..., out / bo, in / bi] (or [..., out, 1]) broadcast to its weight's shape."""
    *_, out, inner = weight_shape
    bo, bi = out // scale.shape[-2], inner // scale.shape[-1]
    return scale.repeat_interleave(bo, -2).repeat_interleave(bi, -1)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight as its scale means it, in `dtype` (scaled in float32)."""
    return (weight.float() * block_expand(scale, tuple(weight.shape))).to(dtype)


def fit_neuron_fp8(weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An e4m3fn weight and its scale (blocks or channels) with every value inside Neuron's
    +-240: the scale groups holding a larger value are halved and their scale doubled (exact
    but for the smallest subnormals; NxD's recipe, dividing by 448 / 240, rounds every value)."""
    groups = _group_amax(weight.float().abs(), scale.shape) > QMAX["fp8"]
    if not groups.any():
        return weight, scale
    factor = torch.where(groups, 1 / NEURON_FP8_FACTOR, 1.0)
    halved = weight.float() * block_expand(factor, tuple(weight.shape))
    return halved.to(weight.dtype), scale / factor


def kv_scale_for_neuron(scale: float) -> float:
    """A checkpoint's K or V scale (calibrated for e4m3fn's +-448) for a pool saturating at +-240."""
    return float(scale) * NEURON_FP8_FACTOR


def _group_amax(values: torch.Tensor, scale_shape: torch.Size) -> torch.Tensor:
    *lead, out, inner = values.shape
    go, gi = scale_shape[-2], scale_shape[-1]
    grouped = values.reshape(*lead, go, out // go, gi, inner // gi)
    return grouped.amax(dim=(-3, -1))


class QuantizedLinear(nn.Module):
    """nn.Linear with a quantized weight and its float32 scale (same names + `scale`)."""

    def __init__(self, linear: nn.Linear, spec: QuantSpec):
        super().__init__()
        shape = tuple(linear.weight.shape)
        device = linear.weight.device
        self.weight = nn.Parameter(torch.empty(shape, dtype=spec.storage, device=device), requires_grad=False)
        self.scale = nn.Parameter(
            torch.ones(spec.scale_shape(shape), dtype=torch.float32, device=device), requires_grad=False
        )
        self.bias = linear.bias
        self.blockwise = spec.block is not None

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T without the bias (a row-parallel layer adds it once, after the sum)."""
        if self.blockwise:
            return nn.functional.linear(x, dequantize(self.weight, self.scale, x.dtype))
        return (nn.functional.linear(x, self.weight.to(x.dtype)) * self.scale[:, 0]).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.project(x)
        return y if self.bias is None else y + self.bias


def quantize_experts(experts: nn.Module, spec: QuantSpec) -> None:
    """The stacked expert weights of moe.Experts replaced by quantized ones and their
    `<name>_scale`: [E, out, 1] per channel, [E, out / bo, in / bi] block-wise."""
    experts.blockwise = spec.block is not None
    for name in EXPERT_WEIGHTS:
        weight = getattr(experts, name)
        shape = tuple(weight.shape)
        setattr(
            experts, name, nn.Parameter(torch.empty(shape, dtype=spec.storage, device=weight.device), False)
        )
        scale = torch.ones(spec.scale_shape(shape), dtype=torch.float32, device=weight.device)
        setattr(experts, f"{name}_scale", nn.Parameter(scale, requires_grad=False))


def quantize_modules(model: nn.Module, spec: QuantSpec, layers) -> list[str]:
    """Swap every module `spec` quantizes for its quantized form (`layers.quantized`: the
    backend's layer factory); returns their names."""
    names = [name for name, _ in model.named_modules() if spec.quantizes(name)]
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent)
        module = getattr(owner, child)
        if child == "experts":
            quantize_experts(module, spec)
        else:
            setattr(owner, child, layers.quantized(module, spec))
    return names


def scale_name(weight_name: str) -> str:
    """The scale of a stored quantized weight: q_proj.weight -> q_proj.scale, experts.gate_proj
    -> experts.gate_proj_scale."""
    if weight_name.endswith(".weight"):
        return weight_name.removesuffix(".weight") + ".scale"
    return weight_name + "_scale"


__all__ = [
    "QUANTIZATIONS",
    "QuantSpec",
    "QuantizedLinear",
    "dequantize",
    "fit_neuron_fp8",
    "module_matches",
    "quantize",
    "quantize_modules",
    "scale_name",
]
