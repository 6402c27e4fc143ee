"""Random EAGLE3 heads for the tiny llama (testing/checkpoints.py), in the layouts heads ship in:
yuhuili's (`midlayer.*`, LlamaForCausalLMEagle3) or speculators' (`layers.0.*`). For math and
parity checks only: a random head's drafts are mostly rejected (acceptance claims use the
trained pair, testing/eagle3_heads.py)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from .publish import published

# The tiny llama's head: aux ids 0..L as the trained fixture's (the default (2, L // 2, L - 3)
# needs L >= 4; the tiny llama has 2 layers).
TINY_LLAMA_HEAD = dict(
    architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=64, intermediate_size=128,
    num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1, vocab_size=512, rms_norm_eps=1e-6,
    max_position_embeddings=4096, rope_theta=10000.0, eagle_aux_hidden_state_layer_ids=[0, 1, 2],
)  # fmt: skip


def random_head(config: dict, seed: int, layer_prefix: str = "midlayer.") -> dict[str, torch.Tensor]:
    """A random head's tensors as a checkpoint names them (no embed_tokens: the target's); d2t
    where the draft vocabulary is smaller, mapping to a random subset of the target's."""
    g = torch.Generator().manual_seed(seed)
    h, i = config["hidden_size"], config["intermediate_size"]
    q, kv = h, h // config["num_attention_heads"] * config["num_key_value_heads"]  # head_dim * heads
    draft, aux = (
        config.get("draft_vocab_size", config["vocab_size"]),
        len(config["eagle_aux_hidden_state_layer_ids"]),
    )
    shapes = {"fc.weight": (h, aux * h), "self_attn.q_proj.weight": (q, 2 * h),
              "self_attn.k_proj.weight": (kv, 2 * h), "self_attn.v_proj.weight": (kv, 2 * h),
              "self_attn.o_proj.weight": (h, q), "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h),
              "mlp.down_proj.weight": (h, i), "lm_head.weight": (draft, h)}  # fmt: skip
    tensors = {}
    for name, shape in shapes.items():
        full = name if name in ("fc.weight", "lm_head.weight") else layer_prefix + name
        tensors[full] = torch.randn(shape, generator=g) * shape[1] ** -0.5
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        tensors[f"{layer_prefix}{norm}.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    tensors["norm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    if draft < config["vocab_size"]:
        selected = torch.randperm(config["vocab_size"], generator=g)[:draft].sort().values
        tensors["d2t"] = selected - torch.arange(draft)
        tensors["t2d"] = torch.zeros(config["vocab_size"], dtype=torch.bool).index_fill(0, selected, True)
    return tensors


def cached_head(cache_dir: Path, config: dict, seed: int) -> Path:
    """A random head written as yuhuili ships one (config.json, model.safetensors), under
    `cache_dir`, named by its content."""
    from safetensors.torch import save_file

    key = hashlib.sha256(json.dumps([config, seed], sort_keys=True).encode()).hexdigest()[:12]
    folder = Path(cache_dir) / "heads" / f"random-{key}"
    if not (folder / "config.json").is_file():
        with published(folder, "config.json") as staging:
            save_file(random_head(config, seed), staging / "model.safetensors")
            (staging / "config.json").write_text(json.dumps(config))
    return folder
