"""Building blocks of the decoder. Linear layers come from a layer factory (parallel.py):
plain torch layers for cpu and eager, sharded ones under tensor parallelism."""

from __future__ import annotations

import functools

import torch
from torch import nn

from .lora import LoraSpec, mlp_shapes, project, slot_modules

# A large finite negative: exp() of it is exactly 0 in fp32, while finfo.min turns into NaN
# on Neuron XLA once max-subtraction overflows.
MASK_VALUE = -1e9


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the stored weight is an offset from 1, and the scale is applied in
    fp32 before the cast (Gemma3RMSNorm, transformers 4.57 and 5.x)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


def rms_norm(dim: int, eps: float, offset: bool) -> RMSNorm:
    return OffsetRMSNorm(dim, eps) if offset else RMSNorm(dim, eps)


class Rotary(nn.Module):
    """Rotary embedding with inv_freq taken from the HF model (covers every rope_type)."""

    def __init__(self, head_dim: int):
        super().__init__()
        self.register_buffer("inv_freq", torch.zeros(head_dim // 2))
        self.register_buffer("attention_scaling", torch.ones(()))

    def cos_sin(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids.float()[..., None] * self.inv_freq  # [N, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(dtype)[:, None]  # [N, 1, T, D]
        sin = (emb.sin() * self.attention_scaling).to(dtype)[:, None]
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# HF activation name -> function (transformers' ACT2FN entries for these names)
ACTIVATIONS = {
    "silu": nn.functional.silu,
    "swish": nn.functional.silu,
    "gelu_pytorch_tanh": functools.partial(nn.functional.gelu, approximate="tanh"),
}


class MLP(nn.Module):
    def __init__(
        self,
        hidden: int,
        intermediate: int,
        bias: bool,
        layers,
        act: str = "silu",
        lora_spec: LoraSpec | None = None,
    ):
        super().__init__()
        shapes = mlp_shapes(hidden, intermediate)
        self.gate_proj = layers.column(*shapes["gate_proj"], bias=bias)
        self.up_proj = layers.column(*shapes["up_proj"], bias=bias)
        self.down_proj = layers.row(*shapes["down_proj"], bias=bias)
        self.act = ACTIVATIONS[act]
        self.lora = slot_modules(lora_spec, layers, shapes)  # lora_targets.SLOTS

    def forward(self, x: torch.Tensor, lora_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [1, R, H]; `lora_mask` [R, S*r]: each token's adapter slot (lora.py)."""
        gate = project(self.gate_proj, self.lora, "gate_proj", x, lora_mask)
        h = self.act(gate) * project(self.up_proj, self.lora, "up_proj", x, lora_mask)
        return project(self.down_proj, self.lora, "down_proj", h, lora_mask)
