"""A quantized source checkpoint: what it holds, and what its export stores.

Served: gpt-oss's MXFP4 experts (dequantised, checkpoint_stream), and FP8 weights, kept as FP8
(no round trip through bfloat16) with their own scales:
- transformers' fine-grained FP8 (`quant_method: fp8`, `weight_block_size` [bo, bi]): per
  Linear an e4m3fn `weight` and a float32 `weight_scale_inv` [out / bo, in / bi], the factor
  the weight is multiplied by (quantizers/quantizer_finegrained_fp8.py, transformers 5.x);
- compressed-tensors' "float-quantized" format (llm-compressor's FP8 schemes): an e4m3fn
  `weight` and a `weight_scale` per output channel [out, 1] or per tensor.
Their values may reach e4m3fn's +-448, past Neuron's +-240: quantization.fit_neuron_fp8. MoE
experts' per-expert scales are stacked as their weights (checkpoint_stream._stacked_scales).
Activation scales (W8A8 checkpoints) are not used: the graphs quantize no activation.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .config import NeuronConfigError
from .modeling.quantization import QUANTIZED_MODULES

logger = logging.getLogger(__name__)

DEQUANTIZED_HINT = (
    "export a dequantized copy instead (transformers: from_pretrained with the quantizer's "
    "dequantize option, then save_pretrained), with --quantization int8|fp8 to quantize it for Neuron."
)


class UnsupportedQuantizationError(NeuronConfigError):
    """A quantized checkpoint this package cannot export as it is."""


@dataclass(frozen=True)
class SourceQuantization:
    method: str  # "mxfp4" | "fp8" | "compressed-tensors"
    block: tuple[int, int] | None = None  # fine-grained FP8's weight_block_size
    scale_suffix: str = ""  # the weight's scale: <module>.<scale_suffix>
    activation_scales: bool = False  # W8A8: activation scales the export leaves out

    @property
    def fp8(self) -> bool:
        return self.method in ("fp8", "compressed-tensors")


def source_quantization(hf_config) -> SourceQuantization | None:
    """The quantization of a checkpoint's config (None: unquantized); refuses, by name, those
    this package cannot serve."""
    quant = getattr(hf_config, "quantization_config", None)
    if quant is None:
        return None
    quant = quant if isinstance(quant, dict) else quant.to_dict()
    method = str(quant.get("quant_method", "unknown")).removeprefix("QuantizationMethod.").lower()
    if method == "mxfp4":
        return SourceQuantization("mxfp4")
    if method == "fp8":
        block = quant.get("weight_block_size")
        if not block or len(block) != 2:
            raise UnsupportedQuantizationError(
                f"the FP8 checkpoint has no 2-d weight_block_size ({block}): {DEQUANTIZED_HINT}"
            )
        static = quant.get("activation_scheme", "dynamic") != "dynamic"
        return SourceQuantization("fp8", (int(block[0]), int(block[1])), "weight_scale_inv", static)
    if method == "compressed-tensors":
        return _compressed_tensors(quant)
    raise UnsupportedQuantizationError(
        f"the checkpoint is quantized with {method}, which the graphs cannot compute: {DEQUANTIZED_HINT}"
    )


def _compressed_tensors(quant: dict) -> SourceQuantization:
    fmt = quant.get("format")
    groups = list((quant.get("config_groups") or {}).values())
    weights = [g.get("weights") or {} for g in groups]
    fp8 = all(
        w.get("type") == "float"
        and w.get("num_bits") == 8
        and w.get("symmetric", True)
        and w.get("strategy") in ("channel", "tensor")
        for w in weights
    )
    if fmt != "float-quantized" or not groups or not fp8:
        schemes = sorted({f"{w.get('type')}{w.get('num_bits')} {w.get('strategy')}" for w in weights})
        raise UnsupportedQuantizationError(
            f"the compressed-tensors checkpoint ({fmt}, weights {', '.join(schemes)}) is not FP8 per channel "
            f"or per tensor, the one compressed-tensors format exported as it is: {DEQUANTIZED_HINT}"
        )
    activations = any(g.get("input_activations") for g in groups)
    return SourceQuantization("compressed-tensors", None, "weight_scale", activations)


def export_quantization(requested: str | None, source: SourceQuantization | None) -> str:
    """--quantization as exported: as asked for a checkpoint in full precision; fp8 for an FP8
    checkpoint (its weights, kept), which int8 would quantize twice."""
    if source is None or not source.fp8:
        return requested or ""
    if requested not in (None, "fp8"):
        raise UnsupportedQuantizationError(
            f"--quantization {requested} on an FP8 checkpoint would round its FP8 weights again: omit "
            "--quantization (or pass fp8) to keep them, or export a dequantized copy with --quantization int8."
        )
    if source.activation_scales:
        logger.warning("the checkpoint's activation scales are ignored: the export quantizes weights only")
    return "fp8"


def unquantized_modules(dtypes: dict[str, torch.dtype]) -> tuple[str, ...]:
    """Projections an FP8 checkpoint keeps in full precision (its `ignore` list), from the
    dtypes of its tensors: the export keeps them too (NeuronConfig.quantization_skip)."""
    kept = []
    for name, dtype in dtypes.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in QUANTIZED_MODULES:
            if dtype != torch.float8_e4m3fn:
                kept.append(module if module.startswith("model.") else f"model.{module}")
    return tuple(sorted(kept))


def source_scale(weight: torch.Tensor, scale: torch.Tensor, source: SourceQuantization) -> torch.Tensor:
    """The checkpoint's scale of `weight` [out, in] as quantization.py holds it: float32 [out, 1]
    per channel (a per-tensor scale repeated), [out / bo, in / bi] block-wise."""
    out, inner = weight.shape
    scale = scale.float()
    if source.block is not None:
        bo, bi = source.block
        if out % bo or inner % bi or tuple(scale.shape) != (out // bo, inner // bi):
            raise UnsupportedQuantizationError(
                f"a [{out}, {inner}] FP8 weight is not whole {bo}x{bi} blocks (scale {tuple(scale.shape)}): "
                f"{DEQUANTIZED_HINT}"
            )
        return scale
    return scale.reshape(-1, 1).expand(out, 1).contiguous() if scale.numel() == 1 else scale.reshape(out, 1)


__all__ = [
    "SourceQuantization",
    "UnsupportedQuantizationError",
    "export_quantization",
    "source_quantization",
    "source_scale",
    "unquantized_modules",
]
