"""Tensor parallelism: how a decoder's weights split across `tp_degree` ranks, and the layer
factories that build the same model code with plain torch layers (tp 1) or sharded layers.

Sharding (Megatron style, as neuronx-distributed's parallel layers do it):
- column-parallel (q/k/v, gate/up, lm_head): rank r holds rows [r*out/tp, (r+1)*out/tp);
  each rank computes its own heads / intermediate slice, no communication;
- row-parallel (o_proj, down_proj): rank r holds input columns of the same slice; partial
  outputs are summed across ranks (all-reduce), the bias is added once after the sum;
- embedding: split along the hidden dimension, outputs gathered;
- lm_head: vocabulary padded to a multiple of tp_degree, logits gathered then trimmed.

KV heads: split across ranks when tp_degree divides them; when there are fewer KV heads
than ranks (and tp_degree is a multiple of them) each is replicated so every rank holds one;
otherwise the model is converted to multi-head attention (every query head gets its own
copy of its KV head). A rank's query heads always use KV heads held by that rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..config import NeuronConfigError, ceil_div
from . import quantization

if TYPE_CHECKING:  # family.py imports layers.py, whose lora.py imports this module
    from .family import FamilySpec

# Weight name suffix -> dimension split across ranks (absent: replicated on every rank).
PARTITION_DIMS = {
    "q_proj.weight": 0,
    "q_proj.bias": 0,
    "k_proj.weight": 0,
    "k_proj.bias": 0,
    "v_proj.weight": 0,
    "v_proj.bias": 0,
    "o_proj.weight": 1,
    "gate_proj.weight": 0,
    "gate_proj.bias": 0,
    "up_proj.weight": 0,
    "up_proj.bias": 0,
    "down_proj.weight": 1,
    "embed_tokens.weight": 1,
    "lm_head.weight": 0,
    # MoE experts (moe.py): every expert's intermediate dimension, as NxD's Experts split it
    "experts.gate_proj": 1,
    "experts.up_proj": 1,
    "experts.gate_bias": 1,
    "experts.up_bias": 1,
    "experts.down_proj": 2,
    "self_attn.sinks": 0,  # gpt-oss: one sink per query head
}
# Quantized weights' scales (quantization.py) split along their weight's dimension; a scale of
# size 1 there (per-channel scales of row-parallel weights) is replicated.
PARTITION_DIMS |= {
    quantization.scale_name(weight): dim
    for weight, dim in list(PARTITION_DIMS.items())
    if weight.endswith((".weight", "_proj")) and not weight.startswith(("embed", "lm_head"))
}


@dataclass(frozen=True)
class ShardLayout:
    tp_degree: int
    num_heads: int
    num_kv_heads: int  # in the checkpoint
    kv_heads: int  # held by all ranks together, after replication
    head_dim: int
    vocab_size: int
    padded_vocab: int

    @classmethod
    def of(cls, spec: FamilySpec, tp_degree: int) -> ShardLayout:
        tp, heads, kv = tp_degree, spec.num_heads, spec.num_kv_heads
        _check_divisible("num_attention_heads", heads, tp)
        _check_divisible("intermediate_size", spec.intermediate_size, tp)
        _check_divisible("hidden_size", spec.hidden_size, tp)
        if spec.moe is not None:
            _check_divisible("the experts' intermediate_size", spec.moe.intermediate_size, tp)
        if kv % tp == 0:
            kv_heads = kv
        elif tp % kv == 0:
            kv_heads = tp
        else:
            kv_heads = heads
        padded_vocab = ceil_div(spec.vocab_size, tp) * tp
        return cls(tp, heads, kv, kv_heads, spec.head_dim, spec.vocab_size, padded_vocab)

    @property
    def heads_per_rank(self) -> int:
        return self.num_heads // self.tp_degree

    @property
    def kv_heads_per_rank(self) -> int:
        return self.kv_heads // self.tp_degree

    def kv_source(self) -> torch.Tensor:
        """[kv_heads]: the checkpoint KV head each held KV head copies."""
        queries_per_held = self.num_heads // self.kv_heads
        queries_per_source = self.num_heads // self.num_kv_heads
        return torch.arange(self.kv_heads) * queries_per_held // queries_per_source

    def replicated_kv(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """A K / V tensor with the checkpoint's KV heads along `dim` -> the held KV heads
        (kv_source), each head's entries kept together; float8 too."""
        if self.kv_heads == self.num_kv_heads:
            return tensor
        dim, shape = dim % tensor.dim(), tensor.shape
        per_head = tensor.reshape(*shape[:dim], self.num_kv_heads, -1, *shape[dim + 1 :])
        return per_head.index_select(dim, self.kv_source()).reshape(*shape[:dim], -1, *shape[dim + 1 :])


def _check_divisible(what: str, value: int, tp: int) -> None:
    if value % tp:
        options = [d for d in range(1, value + 1) if value % d == 0 and d <= 64]
        raise NeuronConfigError(
            f"{what} ({value}) is not divisible by --tensor_parallel_size {tp}: "
            f"choose a tensor parallel size among {options}."
        )


def check_block_shards(spec: FamilySpec, block: tuple[int, int], tp_degree: int) -> None:
    """Block-wise scales shard with their weights only where every rank's slice is whole
    blocks (a KV head copied to several ranks: whole blocks per head). Projections not whole
    blocks at full size are kept in --dtype (quantized_checkpoint.kept_modules): not checked."""
    layout = ShardLayout.of(spec, tp_degree)
    bo, bi = block
    hidden, inter, tp = spec.hidden_size, spec.intermediate_size, tp_degree
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    kv_rows = layout.kv_heads * spec.head_dim // tp  # replicated KV heads: whole blocks per head
    head_rows = spec.head_dim if layout.kv_heads != layout.num_kv_heads else kv_rows
    # [out, in] as stored, experts too: not lora.full_shapes (LoRA's targets, (in, out), no experts)
    checks = [  # (what, the projection's full [out, in], per rank, block side)
        ("q_proj rows", (q, hidden), q // tp, bo),
        ("k_proj/v_proj rows", (kv, hidden), kv_rows, bo),
        ("a KV head's rows", (kv, hidden), head_rows, bo),
        ("o_proj columns", (hidden, q), q // tp, bi),
        ("gate_proj/up_proj rows", (inter, hidden), inter // tp, bo),
        ("down_proj columns", (hidden, inter), inter // tp, bi),
    ]
    if spec.moe is not None:
        experts = spec.moe.intermediate_size
        checks += [
            ("the experts' gate/up rows", (experts, hidden), experts // tp, bo),
            ("the experts' down_proj columns", (hidden, experts), experts // tp, bi),
        ]
    for what, (out, inner), size, unit in checks:
        if out % bo == 0 and inner % bi == 0 and size % unit:
            raise NeuronConfigError(
                f"{what} per rank ({size}) is not a whole number of the checkpoint's {bo}x{bi} "
                f"scale blocks at --tensor_parallel_size {tp_degree}: choose a tensor parallel size "
                "that splits every projection into whole blocks, or export the unquantized original "
                "with --quantization fp8 (per-channel scales shard at any size)."
            )


def tp_checkpoint(full: dict[str, torch.Tensor], layout: ShardLayout) -> dict[str, torch.Tensor]:
    """The tp-1 checkpoint with KV heads replicated and the vocabulary padded, so that every
    partitioned weight splits into tp_degree equal contiguous slices. Each tensor converts on
    its own: `full` may hold any subset of the names (checkpoint_stream passes one at a time)."""
    out = dict(full)
    kv_tensors = tuple(f"{p}_proj.{t}" for p in "kv" for t in ("weight", "bias", "scale"))
    for name, tensor in full.items():
        if name.endswith(kv_tensors):  # block-wise scales: head_dim / block rows a head
            out[name] = layout.replicated_kv(tensor)
    # the target's lm_head (absent when a streamed export converts other tensors), and an EAGLE3
    # head's over its draft vocabulary (draft.lm_head.weight)
    for name in [n for n in out if n.endswith("lm_head.weight")]:
        lm_head = out[name]
        missing = ceil_div(lm_head.shape[0], layout.tp_degree) * layout.tp_degree - lm_head.shape[0]
        if missing:
            out[name] = torch.cat([lm_head, lm_head.new_zeros(missing, lm_head.shape[1])])
    return out


def partition_dim(name: str) -> int | None:
    for suffix, dim in PARTITION_DIMS.items():
        if name.endswith(suffix):
            return dim
    return None


def rank_shard(tp_state: dict[str, torch.Tensor], tp_degree: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s slice of a `tp_checkpoint` (replicated weights are shared, not copied)."""
    shard = {}
    for name, tensor in tp_state.items():
        dim = partition_dim(name)
        replicated = dim is None or (tensor.shape[dim] == 1 and name.endswith("scale"))
        shard[name] = tensor if replicated else tensor.chunk(tp_degree, dim=dim)[rank].contiguous()
    return shard


class TorchLayers:
    """tp 1: plain torch layers (cpu, eager and xla backends); `linear` builds each projection
    (Kernels.linear: nn.Linear, or the backend's own)."""

    tp_degree = 1

    def __init__(self, linear: Callable[[int, int, bool], nn.Module] | None = None):
        self.linear = linear or nn.Linear

    def column(self, in_features: int, out_features: int, bias: bool, gather_output: bool = False):
        return self.linear(in_features, out_features, bias)

    def row(self, in_features: int, out_features: int, bias: bool):
        return self.linear(in_features, out_features, bias)

    def embedding(self, vocab_size: int, hidden_size: int):
        return nn.Embedding(vocab_size, hidden_size)

    @staticmethod
    def quantized(linear: nn.Module, spec: quantization.QuantSpec) -> nn.Module:
        return quantization.QuantizedLinear(linear, spec)

    @staticmethod
    def reduce(x: torch.Tensor) -> torch.Tensor:
        """Sum of the ranks' partial outputs: one rank holds them all."""
        return x
