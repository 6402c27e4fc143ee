"""Multi-LoRA on static graphs: the one LoRA rule every backend shares.

An export with `--max-loras S --max-lora-rank r` holds, beside each targeted projection, S
adapter slots as two parameters. They are weights as every backend binds them - never constants
inside a compiled graph - but not stored in the export: zero at load (DecoderModel.load_weights),
written in place when an adapter enters a slot (NxD Inference swaps its slots the same way, into
`nxd_model.weights[rank][name][slot]`: modules/lora_serving/lora_model.py `rank_swap`):
  a  [S, r, in]   lora_A of the slot's adapter, its rank zero-padded to r
  b  [S, r, out]  lora_B transposed, times the adapter's scaling (alpha / r, or alpha / sqrt(r))
Each row of a graph call names its slot (NO_ADAPTER: the base) in one extra column of its block
table (`with_adapter_column`): rows of different adapters share one call. A token's delta is

  ((x @ a.view(S*r, in).T) * mask) @ b.view(S*r, out),   mask [R, S*r] one-hot by slot

which reads every slot's a / b once per call (S*r extra columns of each projection: static
shapes, no gather of weights per token) and is exactly zero for base rows.

Under tensor parallelism the slots shard with the projection they modify, as NxD Inference's
lora_serving does (modules/lora_serving/lora_layer.py): column-parallel (q/k/v, gate/up) split b
on its output; row-parallel (o_proj, down_proj) split a on its input, and the [R, S*r] partial
products are summed across ranks before b (the layer factory's `reduce`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..config import NeuronConfigError
from ..lora_targets import ATTENTION_TARGETS, MLP_TARGETS
from .parallel import ShardLayout, partition_dim

if TYPE_CHECKING:  # family.py imports layers.py, which imports this module
    from .family import FamilySpec

NO_ADAPTER = -1  # a row's slot when it runs the base model


@dataclass(frozen=True)
class LoraSpec:
    """The slots an export compiles: `slots` adapters at once, of rank <= `rank`, on `targets`."""

    slots: int
    rank: int  # the LoRA rank (--max-lora-rank); a TP rank is `tp_rank` (tp_share)
    targets: tuple[str, ...]

    @classmethod
    def of(cls, config) -> LoraSpec | None:
        if not config.has_lora_slots:
            return None
        return cls(config.max_loras, config.max_lora_rank, tuple(config.lora_target_modules))

    def summary(self, spec) -> str:
        """One line for the export's first lines and its model card: the slots a model of family
        `spec` gets. Refuses targets no layer has (every MLP a mixture of experts)."""
        layers = spec.num_layers
        dense = sum(spec.dense_mlp(i) for i in range(layers))
        if not dense and all(t in MLP_TARGETS for t in self.targets):
            raise NeuronConfigError(
                f"--lora-target-modules {','.join(self.targets)}: every MLP of {spec.model_type} is a mixture "
                f"of experts, which take no adapters; target attention projections ({','.join(ATTENTION_TARGETS)})."
            )
        mlp = "" if dense == layers else f" (MLP projections on the {dense} dense layers of {layers})"
        return f"LoRA: {self.slots} adapter slots of rank <= {self.rank} on {', '.join(self.targets)}{mlp}"


def row_slots(config, adapters: Sequence[int] | None, rows: int) -> list[int] | None:
    """The adapter column of `rows` rows: each row's slot (`adapters`; None: every row the base)
    where the export has slots, else None (its block tables take no column)."""
    if not config.has_lora_slots:
        return None
    return [NO_ADAPTER] * rows if adapters is None else list(adapters)


def with_adapter_column(tables: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Block tables [N, cols] and each row's slot [N] -> `tables_and_slot` [N, cols + 1], a LoRA
    export's row input. The slot rides on the block table because a graph input of its own does
    not fit: MX graphs with on-device sampling already take the neuron bundle's 8 inputs
    (GraphBundle.forward's input0..7)."""
    return torch.cat([tables, slots.to(tables.dtype)[:, None]], dim=1)


def split_adapter_column(tables_and_slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `with_adapter_column`: (block tables [N, cols], slots [N])."""
    return tables_and_slot[:, :-1], tables_and_slot[:, -1]


def split_tables(
    tables_and_slot: torch.Tensor, lora_spec: LoraSpec | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A row input's (block tables, each row's slot): the adapter column split off where the
    export has slots (`lora_spec`), else the input as it is and None."""
    if lora_spec is None:
        return tables_and_slot, None
    return split_adapter_column(tables_and_slot)


def attention_shapes(width: int, q: int, kv: int, hidden: int) -> dict[str, tuple[int, int]]:
    """(in, out) of the attention projections: `width` in (EAGLE3's head: 2 * hidden), `q` and
    `kv` the query and K / V heads' widths, `hidden` out of o_proj."""
    return {"q_proj": (width, q), "k_proj": (width, kv), "v_proj": (width, kv), "o_proj": (q, hidden)}


def mlp_shapes(hidden: int, intermediate: int) -> dict[str, tuple[int, int]]:
    """(in, out) of a dense MLP's projections."""
    return {
        "gate_proj": (hidden, intermediate),
        "up_proj": (hidden, intermediate),
        "down_proj": (intermediate, hidden),
    }


def full_shapes(spec: FamilySpec) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection adapters may target, unsharded (the checkpoint's KV heads)."""
    hidden, d = spec.hidden_size, spec.head_dim
    attention = attention_shapes(hidden, spec.num_heads * d, spec.num_kv_heads * d, hidden)
    return attention | mlp_shapes(hidden, spec.intermediate_size)


def tp_share_shape(projection: str, inner: int, outer: int, tp_degree: int) -> tuple[int, int]:
    """(in, out) of one TP rank's share of `projection`'s slots: split where its weight is
    (parallel.PARTITION_DIMS), on the input (`a`) for row-parallel projections, on the output
    (`b`) for the others."""
    if partition_dim(f"{projection}.weight") == 1:
        return inner // tp_degree, outer
    return inner, outer // tp_degree


def tp_share(
    projection: str, a: torch.Tensor, b: torch.Tensor, layout: ShardLayout, tp_rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """TP rank `tp_rank`'s share (tp_share_shape) of one slot's full a [.., in] / b [.., out], K / V
    heads replicated first as the weights are (ShardLayout.replicated_kv)."""
    if projection in ("k_proj", "v_proj"):
        b = layout.replicated_kv(b, dim=-1)
    inner, outer = tp_share_shape(projection, a.shape[-1], b.shape[-1], layout.tp_degree)
    return _share(a, inner, tp_rank), _share(b, outer, tp_rank)


def _share(x: torch.Tensor, size: int, tp_rank: int) -> torch.Tensor:
    return x if size == x.shape[-1] else x.narrow(-1, tp_rank * size, size).contiguous()


def token_mask(
    row_slots: list[torch.Tensor], tokens_per_row: list[int], lora_spec: LoraSpec, dtype
) -> torch.Tensor:
    """Each part's row slots [N_i] with T_i tokens a row -> [R, S*r]: 1 in the columns of a
    token's slot, 0 elsewhere (all 0 for base rows)."""
    slots = torch.cat(
        [s[:, None].expand(-1, t).reshape(-1) for s, t in zip(row_slots, tokens_per_row, strict=True)]
    )
    one_hot = slots[:, None] == torch.arange(lora_spec.slots, device=slots.device)[None]  # [R, S]
    return one_hot.to(dtype).repeat_interleave(lora_spec.rank, dim=1)


class LoraSlots(nn.Module):
    """One projection's adapter slots, this rank's share (module docstring)."""

    def __init__(self, lora_spec: LoraSpec, in_features: int, out_features: int, reduce=None):
        super().__init__()
        self.reduce = reduce  # row-parallel: sums the ranks' partial [R, S*r] products
        shape = (lora_spec.slots, lora_spec.rank)
        self.a = nn.Parameter(torch.zeros(*shape, in_features), requires_grad=False)
        self.b = nn.Parameter(torch.zeros(*shape, out_features), requires_grad=False)

    def delta(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [1, R, in] -> [1, R, out]: each token's adapter applied, zero for base tokens."""
        slots, lora_rank, inner = self.a.shape
        h = x @ self.a.reshape(slots * lora_rank, inner).t()  # [1, R, S*r]
        if self.reduce is not None:
            h = self.reduce(h)
        return (h * mask) @ self.b.reshape(slots * lora_rank, -1)


def slot_modules(lora_spec: LoraSpec | None, layers, shapes: dict[str, tuple[int, int]]) -> nn.ModuleDict:
    """Slots of the targeted projections among `shapes` (name -> full (in, out)), this rank's
    share (tp_share_shape over `layers.tp_degree`); a split input sums the ranks' partial products."""
    slots = nn.ModuleDict()
    if lora_spec is None:
        return slots
    tp = layers.tp_degree
    for name, (inner, outer) in shapes.items():
        if name not in lora_spec.targets:
            continue
        share = tp_share_shape(name, inner, outer, tp)
        reduce = layers.reduce if tp > 1 and share[0] < inner else None
        slots[name] = LoraSlots(lora_spec, *share, reduce)
    return slots


def project(linear: nn.Module, slots: nn.ModuleDict, name: str, x: torch.Tensor, mask) -> torch.Tensor:
    """linear(x), plus the adapter delta of each token where `name` has slots."""
    y = linear(x)
    if mask is None or name not in slots:
        return y
    return y + slots[name].delta(x, mask)
