"""Per-backend choices of how the same math is computed, made here only. Each cpu choice was
set by measurement: docs/performance.md gives its current figure and the command that reproduces it.

- sdpa_prefill_from_window / sdpa_decode_from_window: prefill (CP, CE) / decode (TG) graphs
  whose bucket is at least this many positions compute attention with SDPA, which
  AOTInductor lowers to a fused CPU kernel that never materialises the [T, W] scores; below
  it, and on backends without it (None), the explicit masked softmax with MASK_VALUE (eager's
  reference; XLA / Neuron: exp of dtype-min NaNs there). On the cpu backend SDPA wins for
  prefill graphs at every bucket; decode graphs (one query row per call) keep the masked
  softmax, whose setup costs less than the scores SDPA avoids.
- slot_view: one-row graphs (CP, CE) read their slot id as a scalar and attend over a view
  of the slot's cache instead of gathering its window (a copy of every layer's K/V window
  per call); it pays on short chunks at wide windows. Only where the graph compiler keeps a
  scalar read inside the graph (AOTInductor: an unbacked symbol with bound checks); under XLA
  it would sync the device, and NxD traces through XLA, so eager/XLA/Neuron gather.
- live_window: every graph reads its positions' maximum as a scalar and attends over that
  many cache positions (attention.CacheRead) rather than the whole bucket: a chunk or decode
  step costs what its live context costs. Same condition as slot_view (a scalar read inside
  the graph), so cpu only.
- per_row_live: decode graphs (one row per slot) read each row's slot and position as scalars
  and attend per row over a view of its slot up to its own position, instead of every slot up
  to the longest row's: a step reads the sum of the rows' contexts (W2's rows hold 128-2048
  tokens each). Same condition as slot_view (scalar reads inside the graph), so cpu only; ring
  layers keep reading whole rings in slot order.
- expert_selection: a MoE graph of M tokens gathers its selected experts' weights while
  M * top_k / E < this fraction, else runs every expert densely. 1.0 is neuronx-distributed's
  rule (DEFAULT_SELECTIVE_LOADING_THRESHOLD, modules/moe/model_utils.py, Release 2.29 / 0.18.0).
  On CPU the gather copies the weights it selects (and first-touches new pages), so it pays
  only for small selections: 0.2 sits between the selections where gathering won (1/16, 1/8)
  and where it lost (1/4).
- rowwise_linear_rows: linear layers over at most this many rows (decode graphs: one row per
  slot) compute each output as a dot product, which AOTInductor fuses into one kernel reading
  each weight row once for all rows (layers.CpuLinear); ATen's GEMM (MKL sgemm) streams a
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
  head, so it pays only with backends.cpu.keep_freed_heap. Hosts with AVX-512 only: without
  it oneDNN's products lose to SDPA at every width.
- decode_attention_op: decode graphs (one row per slot) run plain causal fp32 layers through the
  C++ op decode_attention.decode_attention: one call a layer for all rows, each row over its
  own slot up to its own position (as per_row_live, without the scalar reads), reading every
  key and value once for the query heads of its group, instead of ATen's bmm with the group's
  2-4 query heads as its rows; TG graphs also compile without per-row unrolling. AVX2 hosts
  only (not measured with AVX-512, where bmm stays); rings, sliding windows, sinks and other
  dtypes keep the choices above.
- realize_reused_values: AOTInductor stores every value that more than one operation consumes
  (inductor config realize_reads_threshold=0) instead of recomputing it inside each consumer.
  By default it inlines a pointwise producer into its consumers: a decode graph's RMSNorm output
  feeds q, k and v (gate and up), so each dot-product kernel of layers.CpuLinear recomputed the
  norm for every weight row it read, and the linears ran compute-bound, not at the memory
  stream. Chunk graphs gain little: their linears are oneDNN calls, whose inputs are stored.

The cpu backend's choices follow the vector ISA of the host that compiles (an export records it
as NeuronConfig.cpu_isa); the other backends' do not depend on the host.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class KernelChoices:
    sdpa_prefill_from_window: int | None = None
    sdpa_decode_from_window: int | None = None
    slot_view: bool = False
    live_window: bool = False
    per_row_live: bool = False
    expert_selection: float = 1.0
    rowwise_linear_rows: int = 0
    onednn_linear: bool = False
    onednn_chunk_attention_from_window: int | None = None
    decode_attention_op: bool = False
    realize_reused_values: bool = False


# The oneDNN chunk op pays only with AVX-512: on an AVX2 host its per-head products lose to
# SDPA's flash kernel at every width (the linears are a wash there, so onednn_linear stays).
ONEDNN_CHUNK_OP_ISAS = ("AVX512",)
# The decode op is chosen only where it was measured to pay (AVX2); elsewhere bmm stays.
DECODE_ATTENTION_OP_ISAS = ("AVX2",)

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
    realize_reused_values=True,
)


def host_cpu_capability() -> str:
    """ATen's vector ISA on this host ("AVX512", "AVX2", ...; ATEN_CPU_CAPABILITY lowers it)."""
    return torch.backends.cpu.get_cpu_capability()


def kernel_choices(backend: str, cpu_capability: str | None = None) -> KernelChoices:
    """The backend's choices; the cpu backend's depend on the vector ISA of the host that
    compiles (this one unless given): an export is compiled for the host it runs on."""
    if backend != "cpu":
        return KernelChoices()
    capability = cpu_capability or host_cpu_capability()
    return replace(
        CPU,
        onednn_chunk_attention_from_window=(
            CPU.onednn_chunk_attention_from_window if capability in ONEDNN_CHUNK_OP_ISAS else None
        ),
        decode_attention_op=capability in DECODE_ATTENTION_OP_ISAS,
    )
