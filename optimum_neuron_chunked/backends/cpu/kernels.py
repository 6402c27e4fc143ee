"""The cpu backend's kernel strategy (modeling.kernels.Kernels): how AOTInductor computes the
shared math faster on a CPU. `KernelChoices()` (every flag off) computes exactly the reference;
tests turn the flags on one by one against it. Each choice's figure and the command that
reproduces it are in docs/performance.md ("cpu backend kernels"); the choices follow the vector
ISA of the compiling host (NeuronConfig.cpu_isa).

- sdpa_*_from_window: attention through SDPA (a fused kernel, no [T, W] scores) from this
  bucket on; decode graphs keep the masked softmax, whose setup costs less than SDPA saves.
- block_view, live_window, per_row_live: read a row's block (of a pool of whole-sequence blocks)
  or positions as scalars inside the graph and attend over a view of the live context instead
  of gathering the bucket. AOTInductor keeps
  such reads in the graph (unbacked symbols); XLA would sync the device, so the reference gathers.
- expert_selection: gather the selected experts only while M * top_k / E is below this (the
  gather copies weights on CPU; NxD's rule is 1.0).
- rowwise_linear_rows / onednn_linear: decode-width linears as fused dot products reading each
  weight row once; wider ones through oneDNN on the plain, shared weight (MKL sgemm uses no
  AVX-512 on AMD CPUs).
- onednn_chunk_attention_from_window: one-row prefill graphs of plain causal layers through the
  oneDNN chunk op (AVX-512 hosts, with keep_freed_heap).
- decode_attention_op / paged_decode_op: decode rows of plain causal fp32 layers through the C++
  op, each row over its own blocks up to its own position, every key read once per query group
  (whole-sequence blocks / smaller blocks); other reads of smaller blocks gather the live ones.
- realize_reused_values: store values with several consumers (realize_reads_threshold=0), so a
  decode graph's RMSNorm is not recomputed inside every dot-product kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from ...modeling.kernels import AttentionSpec, CacheRead, GraphPart, Kernels
from ...modeling.kv_cache import KVCache
from ...modeling.kv_layout import KVLayout, KVPool, row_blocks
from .attention import attend
from .host import host_cpu_capability
from .linear import CpuLinear


@dataclass(frozen=True)
class KernelChoices:
    sdpa_prefill_from_window: int | None = None
    sdpa_decode_from_window: int | None = None
    block_view: bool = False
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
    block_view=True,
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
    """CacheRead with what CpuKernels.cache_read chose for the call, the one place the cpu
    backend reads the layout. Pools of whole-sequence blocks:
    pool_order: decode rows attend over views of the pool in block order (kernels.attend_read);
    block: a one-row graph's block (block_view: attend over a view of it), else None (gather);
    rows: decode rows' (block, live) per row (per_row_live: each row attends over its own live
      context in a view of its block), else None.
    Smaller blocks: none of these; the blocks holding the live context are gathered."""

    block: int | torch.SymInt | None = None
    rows: tuple[tuple[int | torch.SymInt, int | torch.SymInt], ...] | None = None


class CpuKernels(Kernels):
    """The model's kernel strategy on the cpu backend, from its KernelChoices.

    `pool`: the export's pool (kv_layout.KVPool): whole-sequence blocks are read as views in
    place, smaller blocks gathered up to the live context."""

    def __init__(self, choices: KernelChoices, pool: KVPool):
        self.choices = choices
        self.expert_selection = choices.expert_selection
        self.calls_decode_op = (
            choices.decode_attention_op if pool.whole_sequence_blocks else choices.paged_decode_op
        )
        """Whether decode graphs may call decode_attention.decode_attention (load it first)."""

    def linear(self, in_features: int, out_features: int, bias: bool) -> nn.Module:
        choices = self.choices
        if choices.rowwise_linear_rows or choices.onednn_linear:
            return CpuLinear(
                in_features, out_features, bias, choices.rowwise_linear_rows, choices.onednn_linear
            )
        return super().linear(in_features, out_features, bias)

    def cache_read(
        self, kv: KVLayout, position_ids: torch.Tensor, tables: torch.Tensor, window: int, decode_rows: bool
    ) -> CpuCacheRead:
        """The scalar reads become unbacked symbols with bound checks under torch.export; padded
        rows/tokens repeat real ones, so the maximum is a real position."""
        live, block, rows = window, None, None
        if kv.fp8:  # a dequantized read of a data-dependent width fails AOTInductor's lowering
            # (GuardOnDataDependentSymNode, torch 2.13): an fp8 pool is read over the static bucket
            return CpuCacheRead(window, window)
        if self.choices.live_window:
            live = live_width(position_ids, window)
        if not kv.whole_sequence_blocks:  # smaller blocks: gathered up to the live context
            return CpuCacheRead(window, live)
        blocks = row_blocks(tables)  # a row's block is read in place (views)
        if self.choices.block_view and not decode_rows and tables.shape[0] == 1:
            block = blocks[0].item()
            torch._check(block >= 0)
        if self.choices.per_row_live and decode_rows:
            rows = tuple(_row_read(blocks[i], position_ids[i], window) for i in range(tables.shape[0]))
        return CpuCacheRead(window, live, kv.reads_pool_order(decode_rows), block, rows)

    def attend(
        self,
        spec: AttentionSpec,
        part: GraphPart,
        q: torch.Tensor,
        cache: KVCache,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        return attend(self.choices, self.calls_decode_op, spec, part, q, cache, sinks)


def _row_read(block_id: torch.Tensor, positions: torch.Tensor, window: int) -> tuple:
    """(block, live) of one row as scalars, with the bounds torch.export needs."""
    block = block_id.item()
    torch._check(block >= 0)
    return block, live_width(positions, window)


def live_width(positions: torch.Tensor, window: int):
    """1 + the largest of `positions`, read as a scalar (1..window). The largest position is
    declared a size: torch 2.9's fake tensors ask whether each 4-D view's strides exceed 1
    (_prims_common.are_strides_like_channels_last, size-obliviously), which a plain symbol that
    may be 0 cannot answer (GuardOnDataDependentSymNode on the attention mask's view)."""
    last = positions.max().item()
    torch._check_is_size(last, max=window - 1)
    return last + 1
