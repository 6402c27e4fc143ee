"""FP8 checkpoints made locally from a tiny fp32 one, in the two layouts users download:
transformers' fine-grained FP8 (`quant_method: fp8`, blocks, `weight_scale_inv`) and
compressed-tensors' float-quantized per channel (llm-compressor's FP8_DYNAMIC: `weight_scale`,
dynamic activations). Scales are amax / 448 (OCP e4m3fn's range, as those tools write them), so
values beyond Neuron's +-240 occur. One projection stays in full precision, listed as ignored."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

E4M3FN_MAX = 448.0
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
KEPT = "model.layers.0.mlp.down_proj"  # in the checkpoint's ignore list


def _block_scales(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    out, inner = w.shape
    bo, bi = block
    amax = w.abs().reshape(out // bo, bo, inner // bi, bi).amax(dim=(1, 3))
    return amax / E4M3FN_MAX


def _quantized(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out, inner = w.shape
    expanded = scale.repeat_interleave(out // scale.shape[0], 0).repeat_interleave(inner // scale.shape[1], 1)
    return (w / expanded).clamp(-E4M3FN_MAX, E4M3FN_MAX).to(torch.float8_e4m3fn)


def fp8_checkpoint(source: Path, out: Path, layout: str, block: tuple[int, int] = (32, 32)) -> Path:
    """`source` (a model.safetensors checkpoint) as an FP8 checkpoint in `out`; `layout`
    "block" (fine-grained, `block` sized) or "channel" (compressed-tensors)."""
    from safetensors.torch import load_file, save_file

    if (out / "config.json").is_file():
        return out
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(source, staging)
    state = load_file(staging / "model.safetensors")
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
    save_file(state, staging / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((staging / "config.json").read_text())
    config["quantization_config"] = _block_config(block) if layout == "block" else _channel_config()
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    staging.rename(out)
    return out


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


def load_dequantized(folder: Path):
    """transformers 5 running its own dequantization of the checkpoint, in fp32 on the cpu
    (fine-grained FP8: quantizers/quantizer_finegrained_fp8.py dequantizes without a GPU;
    compressed-tensors: CompressedTensorsConfig(dequantize=True), its activation fake-quantization
    off: the export quantizes weights only)."""
    from transformers import AutoModelForCausalLM

    method = json.loads((Path(folder) / "config.json").read_text())["quantization_config"]["quant_method"]
    if method == "fp8":
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    from compressed_tensors.quantization import disable_quantization
    from transformers import CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
    )
    model.apply(disable_quantization)
    return model.eval()
