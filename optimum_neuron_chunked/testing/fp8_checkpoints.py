"""FP8 checkpoints made locally from a tiny fp32 one, in the layouts users download:
- compressed-tensors schemes (SCHEMES), written by the compressed-tensors library's own API
  (apply_quantization_config, calculate_qparams, ModelCompressor), as llm-compressor writes them;
- transformers' fine-grained FP8 (`quant_method: fp8`, blocks, `weight_scale_inv`), and
  compressed-tensors per channel for MoE models, written by hand: transformers 5 holds MoE
  experts as fused 3-D parameters, not the Linear modules compressed-tensors targets.
Hand-written scales are amax / 448 (OCP e4m3fn's range, as those tools write them), so values
beyond Neuron's +-240 occur. One projection stays in full precision, listed as ignored."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from .publish import published

E4M3FN_MAX = 448.0
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
KEPT = "model.layers.0.mlp.down_proj"  # in the checkpoint's ignore list
CT_BLOCK = (64, 32)  # FP8_BLOCK here: k_proj and v_proj [32, 64] end in a partial block, the rest whole

FP8_WEIGHTS = dict(num_bits=8, type="float", symmetric=True, dynamic=False)
SCHEMES = {  # compressed-tensors: a preset's name, or weight-only FP8 (labelled naive-quantized)
    "FP8_DYNAMIC": "FP8_DYNAMIC",  # per channel, dynamic activations
    "FP8_BLOCK": "FP8_BLOCK",  # blocks, dynamic per-group activations
    "FP8_STATIC_KV": "FP8",  # per tensor, static activation scales, and a KV-cache scheme
    "W8_CHANNEL": dict(strategy="channel"),
    "W8_TENSOR": dict(strategy="tensor"),
}


def fp8_checkpoint(source: Path, out: Path, layout: str, block: tuple[int, int] = (32, 32)) -> Path:
    """`source` (a model.safetensors checkpoint) as an FP8 checkpoint in `out`; `layout` a
    compressed-tensors scheme of SCHEMES, "block" (fine-grained, `block` sized) or "channel"
    (compressed-tensors per channel, by hand)."""
    if (out / "config.json").is_file():
        return out
    with published(out, "config.json") as staging:
        if layout in SCHEMES:
            _compressed_tensors_checkpoint(source, staging, layout)
        else:
            _hand_written(source, staging, layout, block)
    return out


def _compressed_tensors_checkpoint(source: Path, out: Path, layout: str) -> None:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    scheme = SCHEMES[layout]
    if isinstance(scheme, str):
        scheme = preset_name_to_scheme(scheme, ["Linear"])
    else:
        scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**FP8_WEIGHTS, **scheme))
    if layout == "FP8_BLOCK":
        scheme.weights.block_structure = list(CT_BLOCK)
    kv = QuantizationArgs(**FP8_WEIGHTS, strategy="tensor") if layout == "FP8_STATIC_KV" else None
    config = QuantizationConfig(
        config_groups={"group_0": scheme}, ignore=["lm_head", KEPT], kv_cache_scheme=kv
    )
    apply_quantization_config(model, config)
    for module in model.modules():
        args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
        if args is not None:
            scale, _ = calculate_qparams(*_weight_range(module.weight.data, args), args)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        for name in ("input_scale", "k_scale", "v_scale"):  # static scales: any calibration will do
            if hasattr(module, name):
                getattr(module, name).data.fill_(0.05)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)


def _weight_range(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """min and max of a weight [out, in] per scale group of `args` (a partial last block padded)."""
    strategy = str(getattr(args.strategy, "value", args.strategy))
    if strategy == "tensor":
        return w.min().reshape(1), w.max().reshape(1)
    if strategy == "channel":
        return w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    bo, bi = args.block_structure
    padded = torch.nn.functional.pad(w, (0, -w.shape[1] % bi, 0, -w.shape[0] % bo))
    blocks = padded.reshape(padded.shape[0] // bo, bo, padded.shape[1] // bi, bi)
    return blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))


def _hand_written(source: Path, out: Path, layout: str, block: tuple[int, int]) -> None:
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, out, dirs_exist_ok=True)  # into the staging folder
    state = load_file(out / "model.safetensors")
    for name in [n for n in state if n.endswith(".weight") and n.split(".")[-2] in PROJECTIONS]:
        module = name.removesuffix(".weight")
        if module == KEPT:
            continue
        w = state[name].float()
        if layout == "block":
            scale = _block_scales(w, block)
            state[name], state[f"{module}.weight_scale_inv"] = _quantized(w, scale), scale
        else:
            scale = w.abs().amax(-1, keepdim=True) / E4M3FN_MAX
            state[name], state[f"{module}.weight_scale"] = _quantized(w, scale), scale
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = _block_config(block) if layout == "block" else _channel_config()
    (out / "config.json").write_text(json.dumps(config, indent=2))


def _block_scales(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    out, inner = w.shape
    bo, bi = block
    amax = w.abs().reshape(out // bo, bo, inner // bi, bi).amax(dim=(1, 3))
    return amax / E4M3FN_MAX


def _quantized(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out, inner = w.shape
    expanded = scale.repeat_interleave(out // scale.shape[0], 0).repeat_interleave(inner // scale.shape[1], 1)
    return (w / expanded).clamp(-E4M3FN_MAX, E4M3FN_MAX).to(torch.float8_e4m3fn)


def _block_config(block: tuple[int, int]) -> dict:
    return {
        "quant_method": "fp8",
        "weight_block_size": list(block),
        "activation_scheme": "dynamic",
        "modules_to_not_convert": ["lm_head", KEPT],
    }


def _channel_config() -> dict:
    weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
    activations = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}
    group = {
        "targets": ["Linear"],
        "format": "float-quantized",
        "weights": weights,
        "input_activations": activations,
        "output_activations": None,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head", KEPT],
        "kv_cache_scheme": None,
    }
