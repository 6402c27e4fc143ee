"""PEFT LoRA adapters (adapter_config.json + adapter_model.safetensors, as peft's save_pretrained
writes them) read into the slot tensors of an export (modeling/lora.py), or refused by name.

peft's rules followed (peft 0.21, tuners/lora/layer.py `update_layer`, utils/other.py
`get_pattern_key`): a module's rank and alpha come from `rank_pattern` / `alpha_pattern` where a
key matches the end of its name, else `r` / `lora_alpha`; its scaling is alpha / r, or
alpha / sqrt(r) with `use_rslora`. Targets are the modules whose tensors are present, so regex
`target_modules` and `layers_to_transform` are honoured as peft applied them. vLLM reads the same
format itself (lora/peft_helper.py) and refuses bias and DoRA as we do.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from .lora_targets import ATTENTION_TARGETS, MLP_TARGETS, PACKED, TARGETS, slot_name
from .modeling.family import FamilySpec
from .modeling.lora import LoraSpec, full_shapes, tp_share
from .modeling.parallel import ShardLayout

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


class LoraConfigError(ValueError):
    """An adapter that cannot be served by this export; the message says why."""


_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.(?P<which>lora_A|lora_B)\.weight$")


@dataclass(frozen=True)
class LoraAdapter:
    """An adapter as a slot holds it: per projection (our module name) the full (unsharded)
    a [R, in] and b [R, out] (lora_B transposed, scaling folded in), zero-padded to rank R."""

    path: str
    rank: int  # the largest LoRA rank of its projections
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def read_adapter(path: str | Path, spec: FamilySpec, lora_spec: LoraSpec, dtype: torch.dtype) -> LoraAdapter:
    """The adapter in folder `path`, checked against the export's base and slots; LoraConfigError
    names what cannot be served."""
    folder = Path(path)
    config = _read_config(folder)
    tensors = _read_tensors(folder)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        for module in ("embed_tokens", "lm_head"):  # refused by name, before the key's form is checked
            if f".{module}." in key:
                raise LoraConfigError(
                    f"{folder}: {key}: LoRA on {module} is not served (attention and dense MLP projections are)"
                )
        if match is None:
            raise LoraConfigError(f"{folder}: tensor {key} is not a LoRA A / B weight of a linear projection")
        pairs.setdefault(match["module"], {})[match["which"]] = tensor
    weights, most = {}, 0
    for module, pair in pairs.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise LoraConfigError(f"{folder}: {module} has {sorted(pair)} but not both lora_A and lora_B")
        lora_rank, alpha = _rank_alpha(config, module)
        scale = alpha / math.sqrt(lora_rank) if config.get("use_rslora") else alpha / lora_rank
        for name, a, b in _split_packed(module, pair["lora_A"], pair["lora_B"], spec):
            _check_module(folder, name, a, b, spec, lora_spec)
            weights[name] = _padded(a, b * scale, lora_spec.rank, dtype)
            most = max(most, a.shape[0])
    if not weights:
        raise LoraConfigError(f"{folder}: the adapter holds no LoRA weights")
    return LoraAdapter(str(folder), most, weights)


def _read_config(folder: Path) -> dict:
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, ValueError) as e:
        raise LoraConfigError(f"{folder}: cannot read {CONFIG_FILE} ({type(e).__name__}: {e})") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraConfigError(f"{folder}: a {config['peft_type']} adapter; only LoRA adapters are served")
    refusals = [
        (config.get("use_dora"), "DoRA (use_dora) is not supported: serve a plain LoRA adapter"),
        (
            config.get("bias", "none") != "none",
            f"bias={config.get('bias')!r}: only bias='none' adapters are served",
        ),
        (
            config.get("modules_to_save"),
            f"modules_to_save {config.get('modules_to_save')}: whole modules are not served",
        ),
    ]
    for refused, why in refusals:
        if refused:
            raise LoraConfigError(f"{folder}: {why}")
    return config


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        file = folder / name
        if not file.is_file():
            continue
        try:
            if name.endswith(".safetensors"):
                return load_file(file)
            return torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:  # a damaged file: say which
            raise LoraConfigError(f"{file}: unreadable ({type(e).__name__}: {e})") from None
    raise LoraConfigError(f"{folder}: no {' or '.join(WEIGHT_FILES)}")


def _pattern_value(patterns: dict, module: str, default):
    """peft's get_pattern_key: the first key that matches the end of the module's name."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _rank_alpha(config: dict, module: str) -> tuple[int, float]:
    lora_rank = _pattern_value(config.get("rank_pattern"), module, config.get("r", 8))
    return lora_rank, _pattern_value(config.get("alpha_pattern"), module, config.get("lora_alpha", 8))


def _split_packed(module: str, a: torch.Tensor, b: torch.Tensor, spec: FamilySpec):
    """(projection, a, b) of a module: phi3's fused qkv_proj / gate_up_proj split over the
    projections this decoder holds (hf_state.split_fused_projections), one A shared."""
    prefix, _, name = module.rpartition(".")
    if name not in PACKED:
        return [(module, a, b)]
    if name == "qkv_proj":
        shapes = full_shapes(spec)
        sizes = [shapes[part][1] for part in PACKED[name]]  # q, k, v widths
    else:
        sizes = [b.shape[0] // 2] * 2
    if sum(sizes) != b.shape[0]:
        raise LoraConfigError(f"{module}: lora_B has {b.shape[0]} rows, the base's {name} {sum(sizes)}")
    return [(f"{prefix}.{part}", a, rows) for part, rows in zip(PACKED[name], b.split(sizes), strict=True)]


def _check_module(folder: Path, module: str, a, b, spec: FamilySpec, lora_spec: LoraSpec) -> None:
    parts = module.split(".")
    projection = parts[-1]
    where = f"{folder}: {module}"
    if "experts" in parts:  # embed_tokens and lm_head: refused by key (read_adapter)
        raise LoraConfigError(
            f"{where}: LoRA on expert (MoE) projections is not served (attention and dense MLP projections are)"
        )
    layer = int(parts[2]) if parts[:2] == ["model", "layers"] and parts[2].isdigit() else None
    if projection not in TARGETS or layer is None or layer >= spec.num_layers:
        raise LoraConfigError(
            f"{where}: not an attention or dense MLP projection of this base model ({spec.model_type}, "
            f"{spec.num_layers} layers); adapters may target {', '.join(TARGETS)}"
        )
    if projection not in lora_spec.targets:
        raise LoraConfigError(
            f"{where}: the export has no slots on {projection} (its --lora-target-modules: "
            f"{', '.join(lora_spec.targets)}); export again with {projection} among them"
        )
    if projection in MLP_TARGETS and not spec.dense_mlp(layer):
        raise LoraConfigError(
            f"{where}: layer {layer}'s MLP is a mixture of experts; expert projections take no adapters"
        )
    if a.shape[0] > lora_spec.rank:
        raise LoraConfigError(
            f"{where}: rank {a.shape[0]} exceeds the export's --max-lora-rank {lora_spec.rank}"
        )
    inner, outer = full_shapes(spec)[projection]
    if a.shape != (a.shape[0], inner) or b.shape != (outer, a.shape[0]):
        raise LoraConfigError(
            f"{where}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the base's {projection} "
            f"({inner} -> {outer}): the adapter was trained on another base model"
        )


def _padded(a: torch.Tensor, b: torch.Tensor, slot_rank: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """a [r, in], b [out, r] -> a [R, in], b.T [R, out], zero rows r..R, in `dtype`."""
    r = a.shape[0]
    a_slot = torch.zeros(slot_rank, a.shape[1], dtype=torch.float32)
    b_slot = torch.zeros(slot_rank, b.shape[0], dtype=torch.float32)
    a_slot[:r], b_slot[:r] = a.float(), b.float().t()
    return a_slot.to(dtype), b_slot.to(dtype)


def slot_tensors(
    adapter: LoraAdapter, spec: FamilySpec, lora_spec: LoraSpec, tp_degree: int = 1, tp_rank: int = 0
) -> dict:
    """The adapter as rank `tp_rank`'s slot parameters (lora_targets.slot_name -> [R, in] / [R, out]
    one slot's share, lora.tp_share). Targets the adapter lacks are zero."""
    layout = ShardLayout.of(spec, tp_degree)
    shapes = full_shapes(spec)
    out = {}
    for i in range(spec.num_layers):
        for projection in lora_spec.targets:
            block = "self_attn" if projection in ATTENTION_TARGETS else "mlp"
            if block == "mlp" and not spec.dense_mlp(i):
                continue
            module = f"model.layers.{i}.{block}"
            inner, outer = shapes[projection]
            a, b = adapter.weights.get(f"{module}.{projection}", (None, None))
            if a is None:
                a, b = torch.zeros(lora_spec.rank, inner), torch.zeros(lora_spec.rank, outer)
            a, b = tp_share(projection, a, b, layout, tp_rank)
            out[slot_name(module, projection, "a")], out[slot_name(module, projection, "b")] = a, b
    return out


def empty_slots(spec: FamilySpec, lora_spec: LoraSpec, dtype, tp_degree: int = 1, tp_rank: int = 0) -> dict:
    """Rank `tp_rank`'s slot parameters, every slot zero (lora_targets.slot_name -> [S, R, in] /
    [S, R, out]): what a backend that loads weights by name binds before any adapter is written."""
    one = slot_tensors(LoraAdapter("", 0, {}), spec, lora_spec, tp_degree, tp_rank)
    return {name: torch.zeros(lora_spec.slots, *t.shape, dtype=dtype) for name, t in one.items()}
