"""A quantized source checkpoint: what it holds, and what its export stores.

Served: gpt-oss's MXFP4 experts (dequantised, checkpoint_stream), and FP8 weights, kept as FP8
(no round trip through bfloat16) with their own scales:
- transformers' fine-grained FP8 (`quant_method: fp8`, `weight_block_size` [bo, bi]): per
  Linear an e4m3fn `weight` and a float32 `weight_scale_inv` [out / bo, in / bi], the factor
  the weight is multiplied by (quantizers/quantizer_finegrained_fp8.py, transformers 5.x);
- compressed-tensors' FP8 groups (llm-compressor's FP8_DYNAMIC, FP8, FP8_BLOCK; weight-only
  FP8, which the library labels `naive-quantized`): an e4m3fn `weight` and a `weight_scale` in
  the model's dtype, per output channel [out, 1], per tensor, or per block
  [ceil(out / bo), ceil(in / bi)] (the group's `block_structure`; a partial last block allowed).
Their values may reach e4m3fn's +-448, past Neuron's +-240: quantization.fit_neuron_fp8. MoE
experts' per-expert scales are stacked as their weights (checkpoint_stream._stacked_scales).
Activation and KV-cache scales are not used (dropped_notes): the graphs quantize neither.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .config import NeuronConfigError, ceil_div
from .modeling.quantization import QUANTIZED_MODULES, dequantize, kv_scale_for_neuron
from .safetensors_io import TensorInfo

logger = logging.getLogger(__name__)

ORIGINAL_HINT = (
    "export the unquantized original checkpoint instead, with --quantization int8|fp8 for 8-bit weights "
    "on Neuron"
)
BITSANDBYTES_HINT = (
    "; or load this one with transformers, call model.dequantize() and save_pretrained the result"
)
CT_EXPORTED = (
    "compressed-tensors checkpoints export when every group's weights are float 8-bit symmetric, "
    "static, per channel, per tensor or in blocks (FP8_DYNAMIC, FP8, FP8_BLOCK, weight-only FP8), "
    "stored float-quantized or naive-quantized"
)


class UnsupportedQuantizationError(NeuronConfigError):
    """A quantized checkpoint this package cannot export as it is."""


@dataclass(frozen=True)
class SourceQuantization:
    method: str  # "mxfp4" | "fp8" | "compressed-tensors"
    block: tuple[int, int] | None = None  # block-wise scales [bo, bi]; None: per channel / tensor
    scale_suffix: str = ""  # the weight's scale: <module>.<scale_suffix>
    activation_scales: bool = False  # static activation scales (W8A8) the export leaves out
    kv_cache_scales: bool = False  # a KV-cache quantization scheme the export leaves out

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
                f"the FP8 checkpoint has no 2-d weight_block_size ({block}): {ORIGINAL_HINT}."
            )
        static = quant.get("activation_scheme", "dynamic") != "dynamic"
        return SourceQuantization("fp8", (int(block[0]), int(block[1])), "weight_scale_inv", static)
    if method == "compressed-tensors":
        return _compressed_tensors(quant)
    hint = ORIGINAL_HINT + (BITSANDBYTES_HINT if method == "bitsandbytes" else "")
    raise UnsupportedQuantizationError(
        f"the checkpoint is quantized with {method}, which the graphs cannot compute: {hint}."
    )


def _compressed_tensors(quant: dict) -> SourceQuantization:
    """The format decided from each group's weight scheme (compressed-tensors' QuantizationArgs:
    type, num_bits, symmetric, dynamic, strategy, block_structure), not the checkpoint's label:
    the library labels FP8 weights without an activation scheme `naive-quantized`, groups of
    several schemes `mixed-precision` (compressors/format.py, 0.17)."""
    groups = quant.get("config_groups") or {}
    if not groups:
        raise UnsupportedQuantizationError(
            f"the compressed-tensors checkpoint has no config_groups: {CT_EXPORTED}."
        )
    blocks = {_fp8_group(name, group, quant.get("format")) for name, group in groups.items()}
    if len(blocks) > 1:
        raise UnsupportedQuantizationError(
            f"the compressed-tensors checkpoint's groups mix FP8 scale layouts "
            f"({', '.join(sorted(str(b or 'per channel / tensor') for b in blocks))}); an export stores one: "
            f"{ORIGINAL_HINT}."
        )
    static_inputs = any((g.get("input_activations") or {}).get("dynamic") is False for g in groups.values())
    return SourceQuantization(
        "compressed-tensors", blocks.pop(), "weight_scale", static_inputs, bool(quant.get("kv_cache_scheme"))
    )


def _fp8_group(name: str, group: dict, default_format: str | None) -> tuple[int, int] | None:
    """A group's FP8 weights -> their block (None: per channel or per tensor), or refused naming
    what the group holds."""
    w = group.get("weights") or {}
    fmt = group.get("format") or default_format
    strategy = w.get("strategy")
    block = w.get("block_structure")
    fp8 = (
        w.get("type") == "float"
        and w.get("num_bits") == 8
        and w.get("symmetric", True)
        and not w.get("dynamic", False)
        and (strategy in ("channel", "tensor") or (strategy == "block" and block and len(block) == 2))
    )
    if not fp8 or fmt not in ("float-quantized", "naive-quantized"):
        traits = [
            t for t, on in (("asymmetric", not w.get("symmetric", True)), ("dynamic", w.get("dynamic"))) if on
        ]
        held = " ".join([f"{w.get('type')} {w.get('num_bits')}-bit", *traits, str(strategy)])
        raise UnsupportedQuantizationError(
            f"the compressed-tensors checkpoint's {name} holds {held} weights stored {fmt}: {CT_EXPORTED}; "
            f"for this one, {ORIGINAL_HINT}."
        )
    return (int(block[0]), int(block[1])) if strategy == "block" else None


def dropped_notes(source: SourceQuantization | None, dtype: str, kv_cache_dtype: str = "auto") -> list[str]:
    """What the export leaves out of an FP8 checkpoint, one line each (only what it holds)."""
    if source is None:
        return []
    notes = []
    if source.activation_scales:
        notes.append("activation scales dropped: the export quantizes weights only (activations in --dtype)")
    if source.kv_cache_scales and kv_cache_dtype != "fp8":
        notes.append(
            f"KV-cache scales dropped: the export's KV cache is {dtype} (--dtype); --kv-cache-dtype fp8 uses them"
        )
    return notes


def checkpoint_kv_scales(hf_config, files, layers: int) -> tuple[tuple[float, float], ...]:
    """An fp8 KV pool's per-layer (K, V) scales: the checkpoint's (compressed-tensors'
    kv_cache_scheme, tensor strategy: `model.layers.i.self_attn.k_scale` / `v_scale`, llm-compressor's
    names) fitted into +-240 (quantization.kv_scale_for_neuron); () where it has none (1.0, a direct
    cast, as NxD Inference's kv_cache_quant). Per-head scales are refused by name."""
    quant = getattr(hf_config, "quantization_config", None)
    quant = (quant if isinstance(quant, dict) else quant.to_dict()) if quant is not None else {}
    scheme = quant.get("kv_cache_scheme")
    if not scheme:
        return ()
    if scheme.get("strategy", "tensor") != "tensor":
        raise UnsupportedQuantizationError(
            f"the checkpoint's KV-cache scales are per {scheme.get('strategy')} (kv_cache_scheme): an fp8 KV "
            "pool takes one K and one V scale a layer (strategy tensor); export with --kv-cache-dtype auto."
        )
    names = [f"model.layers.{i}.self_attn.{w}_scale" for i in range(layers) for w in "kv"]
    missing = [n for n in names if n not in files]
    if missing:
        raise UnsupportedQuantizationError(f"the checkpoint has a kv_cache_scheme but no {missing[0]}.")
    values = [kv_scale_for_neuron(files.read(n).float().reshape(-1)[0]) for n in names]
    return tuple(zip(values[::2], values[1::2], strict=True))


def export_quantization(requested: str | None, source: SourceQuantization | None) -> str:
    """--quantization as exported: as asked for a checkpoint in full precision; fp8 for an FP8
    checkpoint (its weights, kept), which int8 would quantize twice."""
    if source is None or not source.fp8:
        return requested or ""
    if requested not in (None, "fp8"):
        raise UnsupportedQuantizationError(
            f"--quantization {requested} on an FP8 checkpoint would round its FP8 weights again: omit "
            "--quantization (or pass fp8) to keep them, or export the unquantized original with --quantization int8."
        )
    return "fp8"


def kept_modules(tensors: Mapping[str, TensorInfo], source: SourceQuantization) -> tuple[str, ...]:
    """Projections of an FP8 checkpoint the export keeps in --dtype (NeuronConfig.quantization_skip),
    from its tensors' headers: those it holds unquantized (its `ignore` list), and FP8 ones whose
    shape is not whole blocks (compressed-tensors allows a partial last block; Neuron's block-wise
    layers take whole ones), dequantized by their scales (`dequantized`), said in one line."""
    ignored, partial = [], []
    for name, info in tensors.items():
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or module.rsplit(".", 1)[-1] not in QUANTIZED_MODULES:
            continue
        module = module if module.startswith("model.") else f"model.{module}"
        if info.dtype != torch.float8_e4m3fn:
            ignored.append(module)
        elif source.block is not None and _partial_blocks(info.shape, source.block):
            if ".experts." in module:
                raise UnsupportedQuantizationError(
                    f"the expert weight {name} {list(info.shape)} is not whole {source.block} blocks: "
                    f"{ORIGINAL_HINT}."
                )
            partial.append(module)
    if partial:
        logger.warning(
            "%d FP8 projections kept in --dtype, their shapes not whole %s blocks: %s",
            len(partial),
            "x".join(map(str, source.block)),
            ", ".join(sorted(partial)[:4]) + (", ..." if len(partial) > 4 else ""),
        )
    return tuple(sorted(ignored + partial))


def _partial_blocks(shape: tuple[int, ...], block: tuple[int, int]) -> bool:
    return shape[-2] % block[0] != 0 or shape[-1] % block[1] != 0


def source_scale(weight: torch.Tensor, scale: torch.Tensor, source: SourceQuantization) -> torch.Tensor:
    """The checkpoint's scale of `weight` [out, in] as quantization.py holds it: float32 [out, 1]
    per channel (a per-tensor scale repeated), [out / bo, in / bi] block-wise (whole blocks:
    kept_modules keeps the others in --dtype)."""
    out, inner = weight.shape
    scale = scale.float()
    if source.block is not None:
        bo, bi = source.block
        if _partial_blocks((out, inner), source.block) or tuple(scale.shape) != (out // bo, inner // bi):
            raise UnsupportedQuantizationError(
                f"a [{out}, {inner}] FP8 weight is not whole {bo}x{bi} blocks (scale {tuple(scale.shape)}): "
                f"{ORIGINAL_HINT}."
            )
        return scale
    return scale.reshape(-1, 1).expand(out, 1).contiguous() if scale.numel() == 1 else scale.reshape(out, 1)


def dequantized(weight: torch.Tensor, scale: torch.Tensor, source: SourceQuantization) -> torch.Tensor:
    """An FP8 weight [out, in] times its scale, in float32; block-wise, the last blocks may be
    partial (the scale [ceil(out / bo), ceil(in / bi)] cut to the weight)."""
    if source.block is None or not _partial_blocks(tuple(weight.shape), source.block):
        return dequantize(weight, source_scale(weight, scale, source), torch.float32)
    (out, inner), (bo, bi) = weight.shape, source.block
    if tuple(scale.shape) != (ceil_div(out, bo), ceil_div(inner, bi)):
        raise UnsupportedQuantizationError(
            f"a [{out}, {inner}] FP8 weight has a scale {tuple(scale.shape)}, not one per {bo}x{bi} block"
        )
    expanded = scale.float().repeat_interleave(bo, 0).repeat_interleave(bi, 1)[:out, :inner]
    return weight.float() * expanded


__all__ = [
    "SourceQuantization",
    "UnsupportedQuantizationError",
    "dequantized",
    "dropped_notes",
    "export_quantization",
    "kept_modules",
    "source_quantization",
    "source_scale",
]
