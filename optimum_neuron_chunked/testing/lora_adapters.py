"""Tiny LoRA adapters written by peft itself (save_pretrained), random and strong enough to change
the base model's greedy tokens, and peft's own mixed-batch reference (`adapter_names=`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from .publish import published


def write_adapter(base: Path, out: Path, seed: int, rank: int = 8, scale: float = 3.0, **lora) -> Path:
    """A peft LoRA adapter of checkpoint `base` in folder `out` (idempotent): LoraConfig(**lora,
    r=rank) with A and B drawn from seed `seed` at a std of `scale` / sqrt(fan-in)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    key = json.dumps([str(base), seed, rank, scale, lora], sort_keys=True, default=str)
    if (out / ".key").is_file() and (out / ".key").read_text() == key:
        return out
    shutil.rmtree(out, ignore_errors=True)  # written with other arguments
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora.setdefault(
        "target_modules", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    peft_model = get_peft_model(
        model, LoraConfig(r=rank, lora_alpha=lora.pop("lora_alpha", 2 * rank), **lora)
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name and param.dim() == 2:  # A and B (a DoRA magnitude stays as peft made it)
                std = scale / param.shape[1] ** 0.5
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    with published(out, ".key") as staging:
        peft_model.save_pretrained(staging)
        (staging / ".key").write_text(key)
    return out


def peft_reference(base: Path, adapters: dict[str, Path]):
    """The base model with every adapter loaded under its name (peft's PeftModel), fp32, eval."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    (first, path), *rest = adapters.items()
    peft_model = PeftModel.from_pretrained(model, path, adapter_name=first)
    for name, path in rest:
        peft_model.load_adapter(path, adapter_name=name)
    return peft_model.eval()


def peft_greedy(model, prompt: list[int], adapter: str, new_tokens: int) -> list[int]:
    """Greedy tokens of `prompt` under `adapter` ("__base__": the base) by peft's forward."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(input_ids=torch.tensor([ids]), adapter_names=[adapter]).logits
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt) :]
