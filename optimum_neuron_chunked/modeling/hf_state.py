"""A transformers checkpoint's tensors in the decoder's layout: the rotary buffers of its HF
model, and phi3's fused projections split (the in-memory and streamed exports share them)."""

from __future__ import annotations

import torch
from torch import nn

from .family import FamilySpec


def rotary_buffer(hf_model: nn.Module, module: str, which: str) -> torch.Tensor | None:
    """inv_freq or attention_scaling of our rotary `module` (rotary_emb, or gemma3's
    rotary_emb_local) from the HF model: gemma3 under transformers 5.x keeps one set per layer
    type in `rotary_emb`; 4.57 has a second module `rotary_emb_local`."""
    rotary = hf_model.model.rotary_emb
    layer_type = "sliding_attention" if module == "rotary_emb_local" else "full_attention"
    if layer_type not in getattr(rotary, "layer_types", [layer_type]):
        return None  # 5.x: no layer of this type, so no layer reads this rotary
    if hasattr(rotary, f"{layer_type}_inv_freq"):
        inv_freq = getattr(rotary, f"{layer_type}_inv_freq")
        scaling = getattr(rotary, f"{layer_type}_attention_scaling", 1.0)
    else:
        rotary = getattr(hf_model.model, module)
        inv_freq, scaling = rotary.inv_freq, getattr(rotary, "attention_scaling", 1.0)
    if which == "inv_freq":
        return inv_freq.detach().clone()
    return torch.tensor(float(scaling))


def split_fused_projections(hf_state: dict[str, torch.Tensor], spec: FamilySpec) -> dict[str, torch.Tensor]:
    """phi3's qkv_proj ([q; k; v] rows) and gate_up_proj ([gate; up] rows, Phi3MLP chunks the
    output in two) as the separate projections this decoder holds (and shards)."""
    q_rows, kv_rows = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    state = dict(hf_state)
    for name in [n for n in hf_state if n.endswith(("qkv_proj.weight", "gate_up_proj.weight"))]:
        fused, prefix = state.pop(name), name.rsplit(".", 2)[0]
        if name.endswith("qkv_proj.weight"):
            q, k, v = fused.split([q_rows, kv_rows, kv_rows])
            state |= {
                f"{prefix}.q_proj.weight": q,
                f"{prefix}.k_proj.weight": k,
                f"{prefix}.v_proj.weight": v,
            }
        else:
            gate, up = fused.chunk(2)
            state |= {f"{prefix}.gate_proj.weight": gate, f"{prefix}.up_proj.weight": up}
    return state
