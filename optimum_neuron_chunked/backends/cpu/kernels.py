"""The cpu backend's kernel strategy (modeling.kernels.Kernels): how AOTInductor computes the
shared math faster on a CPU. Each choice was set by measurement: docs/performance.md gives its
current figure and the command that reproduces it. `KernelChoices()` (every flag off) computes
exactly the reference; tests turn the flags on one by one against it.

- sdpa_prefill_from_window / sdpa_decode_from_window: prefill (CP, CE) / decode (TG) graphs
  whose bucket is at least this many positions compute attention with SDPA, which
  AOTInductor lowers to a fused CPU kernel that never materialises the [T, W] scores; below
  it (None: never), the explicit masked softmax with MASK_VALUE (the
  reference). On the cpu backend SDPA wins for
  prefill graphs at every bucket; decode graphs (one query row per call) keep the masked
  softmax, whose setup costs less than the scores SDPA avoids.
- slot_view: one-row graphs (CP, CE) read their slot id as a scalar and attend over a view
  of the slot's cache instead of gathering its window (a copy of every layer's K/V window
  per call); it pays on short chunks at wide windows. Only where the graph compiler keeps a
  scalar read inside the graph (AOTInductor: an unbacked symbol with bound checks); under XLA
  it would sync the device, and NxD traces through XLA: the reference gathers.
- live_window: every graph reads its positions' maximum as a scalar and attends over that
  many cache positions (CpuCacheRead.live) rather than the whole bucket: a chunk or decode
  step costs what its live context costs. Same condition as slot_view (a scalar read inside
  the graph).
- per_row_live: decode graphs (one row per slot) read each row's slot and position as scalars
  and attend per row over a view of its slot up to its own position, instead of every slot up
  to the longest row's: a step reads the sum of the rows' contexts (W2's rows hold 128-2048
  tokens each). Same condition as slot_view (scalar reads inside the graph); ring layers keep
  reading whole rings in slot order.
- expert_selection: a MoE graph of M tokens gathers its selected experts' weights while
  M * top_k / E < this fraction, else runs every expert densely (the reference: 1.0, NxD's
  rule, modeling/kernels.py). On CPU the gather copies the weights it selects (and first-touches new pages), so it pays
  only for small selections: 0.2 sits between the selections where gathering won (1/16, 1/8)
  and where it lost (1/4).
- rowwise_linear_rows: linear layers over at most this many rows (decode graphs: one row per
  slot) compute each output as a dot product, which AOTInductor fuses into one kernel reading
  each weight row once for all rows (linear.CpuLinear); ATen's GEMM (MKL sgemm) streams a
  decode step's weights at a fraction of the memory stream (it uses no AVX-512 on AMD CPUs).
  0: always ATen.
- onednn_linear: linear layers over more rows (chunks) call oneDNN's matmul
  (torch.ops.mkldnn._linear_pointwise) on the plain weight instead of ATen's MKL sgemm, which
  does not use AVX-512 on AMD CPUs. The weight stays the one shared constant (no prepacked
  copy per graph: AOTInductor's own prepacking needs frozen weights, one copy per graph).
- onednn_chunk_attention_from_window: one-row prefill graphs (CP, CE) whose bucket is at least
  this many positions run their causal attention as the custom op
  chunk_attention.chunk_attention (oneDNN products per query head) instead of SDPA, whose CPU
  flash kernel runs its products on MKL sgemm. Below it the op's ~60 dispatches a layer cost
  more than oneDNN saves (break-even near a live width of 1024). Plain causal layers only:
  sliding windows, rings and sinks keep the choices above. It allocates its score blocks per
  head, so it pays only with backend.keep_freed_heap. Hosts with AVX-512 only: without
  it oneDNN's products lose to SDPA at every width.
- decode_attention_op: decode graphs (one row per slot) run plain causal fp32 layers through the
  C++ op decode_attention.decode_attention: one call a layer for all rows, each row over its
  own slot up to its own position (as per_row_live, without the scalar reads), reading every
  key and value once for the query heads of its group, instead of ATen's bmm with the group's
  2-4 query heads as its rows; TG graphs also compile without per-row unrolling. Hosts with
  AVX2 or AVX-512, where it was measured (its AVX2 loops serve both); rings, sliding windows,
  sinks and other dtypes keep the choices above.
- paged_decode_op: decode rows of paged exports (--kv-cache-blocks) run plain causal fp32 layers
  through the same op, reading each row's blocks in place up to its own position, on every ISA:
  the reference gathers every row's whole bucket window first (a 32-row step took 26x the
  8-slot step, docs/performance.md). Other paged reads (chunks; decode rows the op does not
  cover) gather only the blocks holding the live context (live_window), not the bucket's.
- realize_reused_values: AOTInductor stores every value that more than one operation consumes
  (inductor config realize_reads_threshold=0) instead of recomputing it inside each consumer.
  By default it inlines a pointwise producer into its consumers: a decode graph's RMSNorm output
  feeds q, k and v (gate and up), so each dot-product kernel of layers.CpuLinear recomputed the
  norm for every weight row it read, and the linears ran compute-bound, not at the memory
  stream. Chunk graphs gain little: their linears are oneDNN calls, whose inputs are stored.

The choices follow the vector ISA of the host that compiles (an export records it as
NeuronConfig.cpu_isa).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from ...modeling.kernels import AttentionSpec, CacheRead, GraphPart, Kernels
from ...modeling.kv_cache import KVCache
from .attention import attend, attend_paged
from .host import host_cpu_capability
from .linear import CpuLinear


@dataclass(frozen=True)
class KernelChoices:
    sdpa_prefill_from_window: int | None = None
    sdpa_decode_from_window: int | None = None
    slot_view: bool = False
    live_window: bool = False
    per_row_live: bool = False
    expert_selection: float = Kernels.expert_selection
    rowwise_linear_rows: int = 0
    onednn_linear: bool = False
    onednn_chunk_attention_from_window: int | None = None
    decode_attention_op: bool = False
    paged_decode_op: bool = False
    realize_reused_values: bool = False


# The oneDNN chunk op pays only with AVX-512: on an AVX2 host its per-head products lose to
# SDPA's flash kernel at every width (the linears are a wash there, so onednn_linear stays).
ONEDNN_CHUNK_OP_ISAS = ("AVX512",)
# The decode op is chosen only where it was measured to pay; elsewhere bmm stays.
DECODE_ATTENTION_OP_ISAS = ("AVX2", "AVX512")

CPU = KernelChoices(
    sdpa_prefill_from_window=1,
    sdpa_decode_from_window=None,
    slot_view=True,
    live_window=True,
    per_row_live=True,
    expert_selection=0.2,
    rowwise_linear_rows=8,
    onednn_linear=True,
    onednn_chunk_attention_from_window=2048,
    paged_decode_op=True,
    realize_reused_values=True,
)


def kernel_choices(cpu_capability: str | None = None) -> KernelChoices:
    """The cpu backend's choices for the vector ISA of the host that compiles (this one unless
    given): an export is compiled for the host it runs on."""
    capability = cpu_capability or host_cpu_capability()
    return replace(
        CPU,
        onednn_chunk_attention_from_window=(
            CPU.onednn_chunk_attention_from_window if capability in ONEDNN_CHUNK_OP_ISAS else None
        ),
        decode_attention_op=capability in DECODE_ATTENTION_OP_ISAS,
    )


@dataclass(frozen=True)
class CpuCacheRead(CacheRead):
    """CacheRead with the scalars read inside the graph:
    slot: a one-row graph's slot (slot_view: attend over a view of it), else None (gather);
    rows: a one-row-per-slot graph's (slot, live) per row (per_row_live: each row attends over
      its own live context in a view of its slot), else None."""

    slot: int | torch.SymInt | None = None
    rows: tuple[tuple[int | torch.SymInt, int | torch.SymInt], ...] | None = None


class CpuKernels(Kernels):
    """The model's kernel strategy on the cpu backend, from its KernelChoices.

    `paged`: the model's cache is a pool of blocks, read through block tables (attend_paged):
    slot views and per-row slot reads do not apply; linears and experts follow the choices."""

    def __init__(self, choices: KernelChoices, paged: bool = False):
        self.choices = choices
        self.expert_selection = choices.expert_selection
        self.paged = paged

    @property
    def calls_decode_op(self) -> bool:
        """Whether decode graphs may call decode_attention.decode_attention (load it first)."""
        return self.choices.paged_decode_op if self.paged else self.choices.decode_attention_op

    def linear(self, in_features: int, out_features: int, bias: bool) -> nn.Module:
        choices = self.choices
        if choices.rowwise_linear_rows or choices.onednn_linear:
            return CpuLinear(
                in_features, out_features, bias, choices.rowwise_linear_rows, choices.onednn_linear
            )
        return super().linear(in_features, out_features, bias)

    def cache_read(
        self, position_ids: torch.Tensor, seq_ids: torch.Tensor, window: int, one_row_per_slot: bool
    ) -> CpuCacheRead:
        """The scalar reads become unbacked symbols with bound checks under torch.export; padded
        rows/tokens repeat real ones, so the maximum is a real position."""
        live, slot, rows = window, None, None
        if self.choices.live_window:
            live = position_ids.max().item() + 1
            torch._check(live >= 1)
            torch._check(live <= window)
        if self.paged:
            return CpuCacheRead(window, live)
        if self.choices.slot_view and not one_row_per_slot and seq_ids.shape[0] == 1:
            slot = seq_ids[0].item()
            torch._check(slot >= 0)
        if self.choices.per_row_live and one_row_per_slot:
            rows = tuple(_row_read(seq_ids[i], position_ids[i], window) for i in range(seq_ids.shape[0]))
        return CpuCacheRead(window, live, slot, rows)

    def attend(
        self,
        spec: AttentionSpec,
        part: GraphPart,
        q: torch.Tensor,
        cache: KVCache,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        if self.paged:
            return attend_paged(self.choices, spec, part, q, cache, sinks)
        return attend(self.choices, spec, part, q, cache, sinks)


def _row_read(slot_id: torch.Tensor, positions: torch.Tensor, window: int) -> tuple:
    """(slot, live) of one row as scalars, with the bounds torch.export needs."""
    slot, live = slot_id.item(), positions.max().item() + 1
    torch._check(slot >= 0)
    torch._check(live >= 1)
    torch._check(live <= window)
    return slot, live
