"""The graph set of an export: which graphs, their static shapes and what they compute
(graph_runner.py pads real inputs into those shapes, at run time).

  ce_w{P}  [1, P]  context encoding of a whole prompt (standard exports), P = prompt bucket
  cp_w{W}  [1, C]  one prefill chunk attending over context bucket W (chunked exports)
  cp_w{W}_c{N}  [1, N]  the same for chunks of at most N < C tokens (`prefill_widths`)
  tg_w{W}  [B, 1]  one decode step for up to B rows attending over context bucket W
  tg_w{W}_r{N}  [N, 1]  the same for steps of at most N < B rows (`decode_widths`)
  mx_w{W}  [B, 1] + [1, C]  a mixed step: decode rows and one full chunk in one call
                   (`mixed_step`): projections and MLP once over B + C rows, attention per part
  vf_w{W}  [B, K+1]  verify: each decode row's last token and up to K drafts (`speculation_length`),
                   padded by repeating the row's last position -> every position's argmax and logits
  vf_w{W}_r{N}  [N, K+1]  the same for steps of at most N < B rows (`decode_widths`)
  dc_w{W}  [1, C]  EAGLE3 (`speculation_head`): after a chunk, the head's pass over its tokens
                   shifted by one and K - 1 recurrent steps -> K drafts (dc_w{W}_c{N}: per CP width)
  dv_w{W}  [B, K+1]  the same after a verify call, from each row's last accepted token
                   (dv_w{W}_r{N}: per VF width)
  copy     [1, C]  copies C positions' K/V from one block to another, every layer (chunked
                   exports of whole-sequence blocks: prefix caching puts a cached prefix into a
                   new request's block; smaller blocks are shared instead)

Every row of every graph (copy aside) comes with its block table, [N, ceil(W / P)] int32
(row r's position p in block table[r, p // P], modeling/kv_cache.py): one column where a
block is a whole sequence (the default: one per batch row), W / P with --kv-block-size. LoRA
exports (--max-loras) add one column: the row's adapter slot (modeling/lora.py).

Prefill graphs return the logits of the last real token (host sampling), or of every
position when the export serves prompt logprobs (`prompt_logprobs`); TG graphs sample
on device and also return their logits, so a batch with a request that needs more than
on-device sampling offers can be sampled on the host instead. Graph outputs may stay on the
device until `.cpu()` (the neuron backend runs TG asynchronously): a step sampled on device
fetches its tokens only, never the [B, V] logits - one TG graph per bucket serves both cases,
at no extra graph or compile time.

Integer inputs (token ids, positions, block tables) are `INDEX_DTYPE` on every backend: the Neuron
runtime takes int32, and one input signature for all backends keeps the cpu and eager tests
on the path Neuron compiles. The decoder widens them once (DecoderModel.hidden_states).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

import torch
from torch import nn

from .config import NeuronConfig
from .graph_inputs import INDEX_DTYPE, last_index_input, row_inputs
from .modeling import eagle3
from .modeling.decoder import DecoderModel, PartInputs
from .modeling.kv_layout import KVPool
from .modeling.lora import row_slots
from .modeling.sampler import sample


class GraphKind(StrEnum):
    """What a graph computes (module docstring); its value is the prefix of the graph's name."""

    CE = "ce"
    CP = "cp"
    TG = "tg"
    MX = "mx"
    VF = "vf"
    DC = "dc"  # EAGLE3 drafts after a chunk (modeling/eagle3.py)
    DV = "dv"  # EAGLE3 drafts after a verify call
    COPY = "copy"

    @property
    def draft_twin(self) -> GraphKind | None:
        """EAGLE3's pairs, either way: DC <-> CP, DV <-> VF (a draft graph follows the call whose
        aux states it reads, with its rows and width); None for the other kinds."""
        return _DRAFT_TWINS.get(self)


_DRAFT_TWINS = {GraphKind.DC: GraphKind.CP, GraphKind.DV: GraphKind.VF}
_DRAFT_TWINS |= {call: draft for draft, call in _DRAFT_TWINS.items()}


@dataclass(frozen=True)
class GraphSpec:
    kind: GraphKind
    batch: int  # rows (mx: decode rows)
    width: int  # tokens per row (mx: of its chunk; copy: positions per call)
    window: int  # context bucket: positions attended over (copy: 0, it attends over nothing)
    narrow: bool = False  # a CP graph narrower than the chunk size, a TG graph than the batch

    def __post_init__(self):
        object.__setattr__(self, "kind", GraphKind(self.kind))  # "tg" -> GraphKind.TG

    @property
    def name(self) -> str:
        if self.kind == GraphKind.COPY:
            return str(self.kind)
        name = f"{self.kind}_w{self.window}"
        if not self.narrow:
            return name
        rows = self.kind in (GraphKind.TG, GraphKind.VF, GraphKind.DV)
        return name + (f"_r{self.batch}" if rows else f"_c{self.width}")


COPY = GraphKind.COPY.value  # the copy graph's name


def cp_spec(config: NeuronConfig, width: int, window: int) -> GraphSpec:
    return GraphSpec(GraphKind.CP, 1, width, window, narrow=width < config.prefill_chunk_size)


def tg_spec(config: NeuronConfig, rows: int, window: int) -> GraphSpec:
    return GraphSpec(GraphKind.TG, rows, 1, window, narrow=rows < config.batch_size)


def vf_spec(config: NeuronConfig, rows: int, window: int) -> GraphSpec:
    return GraphSpec(GraphKind.VF, rows, config.verify_width, window, narrow=rows < config.batch_size)


def draft_spec(called: GraphSpec, window: int) -> GraphSpec:
    """The EAGLE3 drafts after a `called` CP / VF graph (GraphKind.draft_twin: DC / DV): its rows
    and width (the aux states it left), attending over context bucket `window`."""
    return replace(called, kind=called.kind.draft_twin, window=window)


def mx_spec(config: NeuronConfig, window: int) -> GraphSpec:
    return GraphSpec(GraphKind.MX, config.batch_size, config.prefill_chunk_size, window)


def ce_spec(window: int) -> GraphSpec:
    return GraphSpec(GraphKind.CE, 1, window, window)


def graph_specs(config: NeuronConfig) -> list[GraphSpec]:
    specs = []
    for window in config.context_buckets:
        if config.chunked:
            specs += [cp_spec(config, width, window) for width in config.prefill_widths]
        else:
            specs.append(ce_spec(window))
        specs += [tg_spec(config, rows, window) for rows in config.decode_widths]
        if config.mixed_step:
            specs.append(mx_spec(config, window))
        if config.speculation_length:
            specs += [vf_spec(config, rows, window) for rows in config.decode_widths]
        if config.speculation_head:
            specs += [draft_spec(cp_spec(config, width, window), window) for width in config.prefill_widths]
            specs += [draft_spec(vf_spec(config, rows, window), window) for rows in config.decode_widths]
    if KVPool.of(config).copy_graph:  # smaller blocks are shared, never copied
        specs.append(GraphSpec(GraphKind.COPY, 1, config.prefill_chunk_size, 0))
    return specs


class PrefillGraph(nn.Module):
    """CE or CP: [1, T] tokens -> logits [1, V] of the last real token, or [1, T, V] of every
    position (`all_positions`)."""

    def __init__(self, model: DecoderModel, window: int, all_positions: bool = False):
        super().__init__()
        self.model, self.window, self.all_positions = model, window, all_positions

    def forward(self, input_ids, position_ids, tables_and_slot):
        hidden = self.model.hidden_states(input_ids, position_ids, tables_and_slot, self.window)
        if self.all_positions:
            return self.model.logits(hidden)
        # Padding repeats the last real position, so the first argmax is the last real token.
        last = torch.argmax(position_ids, dim=1)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        return self.model.logits(hidden[rows, last])


class DecodeGraph(nn.Module):
    """TG: [B, 1] tokens -> (sampled tokens [B], logits [B, V]) or logits alone without ODS."""

    def __init__(self, model: DecoderModel, window: int, on_device_sampling: bool, max_topk: int):
        super().__init__()
        self.model, self.window = model, window
        self.on_device_sampling, self.max_topk = on_device_sampling, max_topk

    def forward(self, input_ids, position_ids, tables_and_slot, sampling_params=None, rand=None):
        hidden = self.model.hidden_states(
            input_ids, position_ids, tables_and_slot, self.window, decode_rows=True
        )
        logits = self.model.logits(hidden[:, 0])
        if not self.on_device_sampling:
            return logits
        return sample(logits, sampling_params, rand, self.max_topk), logits


class VerifyGraph(nn.Module):
    """VF: decode rows [B, K+1] (a row's last token, then its drafts; a row with fewer drafts
    repeats its last token and position) -> (argmax [B, K+1], logits [B, K+1, V]). Each
    position attends causally within its row over the row's context. A greedy step fetches the
    argmax only; a step that samples on the host fetches the logits."""

    def __init__(self, model: DecoderModel, window: int):
        super().__init__()
        self.model, self.window = model, window

    def forward(self, input_ids, position_ids, tables_and_slot):
        hidden = self.model.hidden_states(
            input_ids, position_ids, tables_and_slot, self.window, decode_rows=True
        )
        logits = self.model.logits(hidden)
        return torch.argmax(logits, dim=-1).to(INDEX_DTYPE), logits


class MixedGraph(nn.Module):
    """MX: decode rows [B, 1] and a chunk [1, C] of another request in one call ->
    (sampled tokens [B], decode logits [B, V], chunk logits [1, V]) or the two logits alone
    without ODS. The chunk's logits are its last real token's, as PrefillGraph's."""

    def __init__(self, model: DecoderModel, window: int, on_device_sampling: bool, max_topk: int):
        super().__init__()
        self.model, self.window = model, window
        self.on_device_sampling, self.max_topk = on_device_sampling, max_topk

    def forward(
        self,
        input_ids,
        position_ids,
        tables_and_slot,
        chunk_ids,
        chunk_positions,
        chunk_tables_and_slot,
        sampling_params=None,
        rand=None,
    ):
        decode, chunk = self.model.parts_hidden_states(
            (
                PartInputs(input_ids, position_ids, tables_and_slot, decode_rows=True),
                PartInputs(chunk_ids, chunk_positions, chunk_tables_and_slot, decode_rows=False),
            ),
            self.window,
        )
        last = torch.argmax(chunk_positions, dim=1)  # padding repeats the last real position
        logits = self.model.logits(torch.cat([decode[:, 0], chunk[0, last]]))
        decode_logits, chunk_logits = logits[:-1], logits[-1:]
        if not self.on_device_sampling:
            return decode_logits, chunk_logits
        return sample(decode_logits, sampling_params, rand, self.max_topk), decode_logits, chunk_logits


class DraftGraph(nn.Module):
    """DC / DV: rows [N, T] of the previous call's tokens shifted left by one, the next token at
    each row's last accepted index `last_index` [N], at that call's positions -> the head's K
    drafts [N, K] (target ids) from index `last_index` (modeling/eagle3.propose)."""

    def __init__(self, model: DecoderModel, window: int, decode_rows: bool, steps: int):
        super().__init__()
        self.model, self.window, self.decode_rows, self.steps = model, window, decode_rows, steps

    def forward(self, input_ids, position_ids, tables_and_slot, last_index):
        drafts = eagle3.propose(
            self.model,
            input_ids,
            position_ids,
            tables_and_slot,
            last_index,
            self.window,
            self.decode_rows,
            self.steps,
        )
        return drafts.to(INDEX_DTYPE)


class CopyGraph(nn.Module):
    """copy: positions [1, C] of block blocks[0] -> the same positions of block blocks[1]."""

    def __init__(self, model: DecoderModel):
        super().__init__()
        self.model = model

    def forward(self, position_ids, blocks):
        self.model.copy_positions(position_ids, blocks)
        # an output of its own: graph compilers drop graphs (and runtimes calls) with none
        return position_ids.max(dim=1).values.to(INDEX_DTYPE)


def graph_module(model: DecoderModel, spec: GraphSpec, config: NeuronConfig) -> nn.Module:
    if spec.kind == GraphKind.COPY:
        return CopyGraph(model)
    if spec.kind == GraphKind.TG:
        return DecodeGraph(model, spec.window, config.on_device_sampling, config.max_topk)
    if spec.kind == GraphKind.MX:
        return MixedGraph(model, spec.window, config.on_device_sampling, config.max_topk)
    if spec.kind == GraphKind.VF:
        return VerifyGraph(model, spec.window)
    if spec.kind in (GraphKind.DC, GraphKind.DV):
        return DraftGraph(model, spec.window, spec.kind == GraphKind.DV, config.speculation_length)
    return PrefillGraph(model, spec.window, config.prompt_logprobs)


def example_inputs(spec: GraphSpec, config: NeuronConfig) -> tuple[torch.Tensor, ...]:
    """Inputs of the static shapes a graph is traced and compiled with."""
    if spec.kind == GraphKind.COPY:
        return torch.arange(spec.width, dtype=INDEX_DTYPE)[None], torch.arange(2, dtype=INDEX_DTYPE)

    if spec.kind == GraphKind.MX:  # decode rows and the chunk (shapes only)
        decode = example_rows(config, spec.batch, 1, spec.window)
        inputs = decode + example_rows(config, 1, spec.width, spec.window)
    else:
        inputs = example_rows(config, spec.batch, spec.width, spec.window)
    if samples_on_device(spec, config):
        inputs += (torch.zeros(spec.batch, 3), torch.zeros(spec.batch))
    if spec.kind in (GraphKind.DC, GraphKind.DV):  # each row's last accepted index
        inputs += (last_index_input([0] * spec.batch, torch.arange(spec.batch), spec.batch),)
    return inputs


def example_rows(config: NeuronConfig, rows: int, width: int, window: int) -> tuple[torch.Tensor, ...]:
    """The row inputs (graph_inputs.row_inputs) of `rows` base rows of `width` tokens at positions
    0.., each in pool blocks of its own where the pool has them (shapes only)."""
    pool = KVPool.of(config)
    columns = pool.blocks_holding(window)
    blocks = (torch.arange(rows * columns) % pool.num_blocks).view(rows, columns).tolist()
    tokens = [torch.zeros(width, dtype=INDEX_DTYPE)] * rows
    slots = row_slots(config, None, rows)
    return tuple(row_inputs(rows, width, columns, tokens, [0] * rows, blocks, slots)[0])


def samples_on_device(spec: GraphSpec, config: NeuronConfig) -> bool:
    """The graph samples its rows' tokens on the device (its inputs end with the sampling
    params and random numbers): TG and MX graphs of an export with on-device sampling."""
    return spec.kind in (GraphKind.TG, GraphKind.MX) and config.on_device_sampling
