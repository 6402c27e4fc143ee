"""Sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral, gpt-oss) in static shapes.

Experts are stored stacked: gate/up [E, I, H], down [E, H, I] (+ biases for gpt-oss), so a
graph can either gather the k selected experts of each token or run every expert densely.
Which one is a static choice by the graph's token count M, as neuronx-distributed makes it
(ExpertMLPsV2.forward, modules/moe/expert_mlps_v2.py, Release 2.29 / 0.18.0: selective
loading while M * top_k / E < 1): a decode step of B rows reads B * k experts' weights, not
E. The threshold is a per-backend choice (Kernels.expert_selection).

Tensor parallelism as NxD's default (Experts in modules/moe/experts.py): every expert's
intermediate dimension is split across ranks (gate/up column-parallel, down row-parallel),
and one all-reduce sums the combined output; the down bias is added once after it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .quantization import dequantize


@dataclass(frozen=True)
class MoeSpec:
    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    sparse_layers: tuple[bool, ...]  # per layer: False = the family's dense MLP (qwen3_moe)
    normalize_top_k: bool  # renormalise the k routing weights to sum to 1
    softmax_over_top_k: bool = False  # gpt-oss: top-k of the router logits, softmax over those k
    router_bias: bool = False  # gpt-oss
    expert_bias: bool = False  # gpt-oss
    swiglu_limit: float | None = None  # gpt-oss: clamped SwiGLU (up + 1) * g * sigmoid(alpha * g)
    swiglu_alpha: float = 1.702

    def selects_experts(self, tokens: int, fraction: float = 1.0) -> bool:
        """Gather the selected experts' weights rather than run all E: while the selections
        are under `fraction` of the experts (Kernels.expert_selection)."""
        return tokens * self.top_k < self.num_experts * fraction


def moe_spec(config) -> MoeSpec | None:
    """The MoE shape of an HF config (None for a dense family)."""
    n = config.num_hidden_layers
    if config.model_type == "qwen3_moe":
        step, dense = config.decoder_sparse_step, set(getattr(config, "mlp_only_layers", None) or [])
        sparse = tuple(i not in dense and config.num_experts > 0 and (i + 1) % step == 0 for i in range(n))
        return MoeSpec(
            config.num_experts,
            config.num_experts_per_tok,
            config.moe_intermediate_size,
            sparse,
            bool(config.norm_topk_prob),
        )
    if config.model_type == "mixtral":
        return MoeSpec(
            config.num_local_experts, config.num_experts_per_tok, config.intermediate_size, (True,) * n, True
        )
    if config.model_type == "gpt_oss":
        return MoeSpec(
            config.num_local_experts,
            config.num_experts_per_tok,
            config.intermediate_size,
            (True,) * n,
            normalize_top_k=False,
            softmax_over_top_k=True,
            router_bias=True,
            expert_bias=True,
            swiglu_limit=float(getattr(config, "swiglu_limit", 7.0)),  # 4.x: GptOssExperts.limit = 7.0
            swiglu_alpha=float(getattr(config, "swiglu_alpha", 1.702)),
        )
    return None


class Router(nn.Module):
    def __init__(self, hidden: int, spec: MoeSpec):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(spec.num_experts, hidden))
        self.bias = nn.Parameter(torch.zeros(spec.num_experts)) if spec.router_bias else None
        self.spec = spec

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[M, H] -> (routing weights [M, k] in x's dtype, expert indices [M, k])."""
        logits = nn.functional.linear(x, self.weight, self.bias)
        if self.spec.softmax_over_top_k:  # GptOssTopKRouter
            top, experts = torch.topk(logits, self.spec.top_k, dim=-1)
            return torch.softmax(top, dim=-1), experts
        probs = torch.softmax(logits.float(), dim=-1)  # Qwen3Moe / Mixtral routers: fp32 softmax
        top, experts = torch.topk(probs, self.spec.top_k, dim=-1)
        if self.spec.normalize_top_k:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(x.dtype), experts


class Experts(nn.Module):
    """This rank's slice of every expert: [E, I/tp, H] gate/up, [E, H, I/tp] down."""

    def __init__(self, hidden: int, spec: MoeSpec, tp_degree: int):
        super().__init__()
        e, i = spec.num_experts, spec.intermediate_size // tp_degree
        self.gate_proj = nn.Parameter(torch.zeros(e, i, hidden))
        self.up_proj = nn.Parameter(torch.zeros(e, i, hidden))
        self.down_proj = nn.Parameter(torch.zeros(e, hidden, i))
        if spec.expert_bias:
            self.gate_bias = nn.Parameter(torch.zeros(e, i))
            self.up_bias = nn.Parameter(torch.zeros(e, i))
            self.down_bias = nn.Parameter(torch.zeros(e, hidden))
        else:
            self.gate_bias = self.up_bias = self.down_bias = None
        self.spec = spec
        self.blockwise = False  # quantization.quantize_experts

    def activation(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        limit = self.spec.swiglu_limit
        if limit is None:
            return nn.functional.silu(gate) * up
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)  # GptOssExperts._apply_gate
        return (up + 1) * gate * torch.sigmoid(gate * self.spec.swiglu_alpha)

    def _weights(self, name: str, idx: torch.Tensor | None, dtype: torch.dtype):
        """The `name` weights of every expert (idx None) or of experts idx, in `dtype`, and the
        per-channel scale their outputs take (None: unquantized, or block-wise and dequantized
        here): quantization.quantize_experts's `<name>_scale`. Gathered by index_select, which
        has a float8 kernel on CPU where indexing has none (torch 2.9)."""
        weights, scale = getattr(self, name), getattr(self, f"{name}_scale", None)
        if idx is not None:
            weights = weights.index_select(0, idx)
            scale = None if scale is None else scale.index_select(0, idx)
        if scale is None:
            return weights.to(dtype), None
        if self.blockwise:
            return dequantize(weights, scale, dtype), None
        return weights.to(dtype), scale[..., 0]

    def _project(self, name: str, x: torch.Tensor, idx: torch.Tensor | None = None) -> torch.Tensor:
        """idx None: x [M, in] or [E, M, in] through every expert -> [E, M, out]; else column r
        of x [M*k, in, 1] through expert idx[r] -> [M*k, out]."""
        w, scale = self._weights(name, idx, x.dtype)
        if idx is None:
            y, scale = torch.matmul(x, w.transpose(1, 2)), None if scale is None else scale[:, None]
        else:
            y = torch.bmm(w, x)[..., 0]
        return y if scale is None else (y * scale).to(x.dtype)

    def selected(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x [M, H], experts [M, k] -> partial outputs [M, k, H] of the selected experts only."""
        m, k = experts.shape
        idx = experts.reshape(-1)
        xk = x.repeat_interleave(k, dim=0)[:, :, None]  # [M*k, H, 1]
        gate, up = self._project("gate_proj", xk, idx), self._project("up_proj", xk, idx)  # [M*k, I]
        if self.gate_bias is not None:
            gate, up = gate + self.gate_bias[idx], up + self.up_bias[idx]
        return self._project("down_proj", self.activation(gate, up)[:, :, None], idx).view(m, k, -1)

    def every(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, H] -> partial outputs [E, M, H] of every expert."""
        gate, up = self._project("gate_proj", x), self._project("up_proj", x)  # [E, M, I]
        if self.gate_bias is not None:
            gate, up = gate + self.gate_bias[:, None], up + self.up_bias[:, None]
        return self._project("down_proj", self.activation(gate, up))


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, spec: MoeSpec, layers, selection: float = 1.0):
        super().__init__()
        self.selection = selection
        self.router = Router(hidden, spec)
        self.experts = Experts(hidden, spec, layers.tp_degree)
        self.reduce = layers.reduce
        self.spec = spec

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, experts = self.router(flat)
        if self.spec.selects_experts(flat.shape[0], self.selection):
            out = (self.experts.selected(flat, experts) * weights[..., None]).sum(1)
        else:
            # [M, E] routing weights, zero for experts not selected (one-hot, no scatter)
            dense = (
                (experts[..., None] == torch.arange(self.spec.num_experts, device=experts.device))
                * weights[..., None]
            ).sum(1)
            out = (self.experts.every(flat) * dense.t()[..., None]).sum(0)
        out = self.reduce(out)
        if self.experts.down_bias is not None:
            out = out + (self.experts.down_bias[experts] * weights[..., None]).sum(1)
        return out.view(shape)


def moe_state_from_hf(
    hf_state: dict[str, torch.Tensor], model_type: str, spec: MoeSpec
) -> dict[str, torch.Tensor]:
    """The sparse layers' weights of an HF state dict in this module's names and layout.

    Layouts read: one module per expert (transformers 4.x: qwen3_moe gate/up/down_proj,
    mixtral `block_sparse_moe` w1/w3/w2), stacked [E, 2I, H] gate_up_proj (5.x qwen3_moe and
    mixtral: gate rows then up rows) and gpt-oss's [E, H, 2I] with gate and up interleaved
    (GptOssExperts._apply_gate: gate = [..., ::2], up = [..., 1::2]) and [E, I, H] down."""
    state = dict(hf_state)
    for i, sparse in enumerate(spec.sparse_layers):
        if sparse:
            state.update(moe_layer_from_hf(state, i, model_type, spec))
    return state


def moe_layer_from_hf(state: dict[str, torch.Tensor], layer: int, model_type: str, spec: MoeSpec) -> dict:
    """Sparse layer `layer`'s weights in this module's names and layout; the HF tensors it
    consumed are popped from `state` (which may hold this layer's tensors only)."""
    dst = f"model.layers.{layer}.mlp"
    src = (
        f"model.layers.{layer}.block_sparse_moe"
        if f"model.layers.{layer}.block_sparse_moe.gate.weight" in state
        else dst
    )
    converted = _gpt_oss_experts(state, src) if model_type == "gpt_oss" else _swiglu_experts(state, src, spec)
    return {f"{dst}.{name}": tensor.contiguous() for name, tensor in converted.items()}


def _gpt_oss_experts(state: dict, src: str) -> dict[str, torch.Tensor]:
    gate_up, gate_up_bias = (
        state.pop(f"{src}.experts.gate_up_proj"),
        state.pop(f"{src}.experts.gate_up_proj_bias"),
    )
    return {
        "router.weight": state.pop(f"{src}.router.weight"),
        "router.bias": state.pop(f"{src}.router.bias"),
        "experts.gate_proj": gate_up[..., ::2].transpose(1, 2),
        "experts.up_proj": gate_up[..., 1::2].transpose(1, 2),
        "experts.down_proj": state.pop(f"{src}.experts.down_proj").transpose(1, 2),
        "experts.gate_bias": gate_up_bias[:, ::2],
        "experts.up_bias": gate_up_bias[:, 1::2],
        "experts.down_bias": state.pop(f"{src}.experts.down_proj_bias"),
    }


def _swiglu_experts(state: dict, src: str, spec: MoeSpec) -> dict[str, torch.Tensor]:
    router = state.pop(f"{src}.gate.weight")
    if f"{src}.experts.gate_up_proj" in state:  # transformers 5.x
        gate, up = state.pop(f"{src}.experts.gate_up_proj").chunk(2, dim=1)
        down = state.pop(f"{src}.experts.down_proj")
    else:  # transformers 4.x: one module per expert
        names = (
            ("w1", "w3", "w2") if src.endswith("block_sparse_moe") else ("gate_proj", "up_proj", "down_proj")
        )
        gate, up, down = (
            torch.stack([state.pop(f"{src}.experts.{e}.{name}.weight") for e in range(spec.num_experts)])
            for name in names
        )
    return {
        "router.weight": router,
        "experts.gate_proj": gate,
        "experts.up_proj": up,
        "experts.down_proj": down,
    }
