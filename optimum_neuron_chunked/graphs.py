"""The graph set of an export: which graphs, their static shapes, and the one padding rule
that turns real inputs into those shapes.

  ce_w{P}  [1, P]  context encoding of a whole prompt (standard exports), P = prompt bucket
  cp_w{W}  [1, C]  one prefill chunk attending over context bucket W (chunked exports)
  cp_w{W}_c{N}  [1, N]  the same for chunks of at most N < C tokens (`prefill_widths`)
  tg_w{W}  [B, 1]  one decode step for up to B slots attending over context bucket W
  tg_w{W}_r{N}  [N, 1]  the same for steps of at most N < B rows (`decode_widths`)
  mx_w{W}  [B, 1] + [1, C]  a mixed step: decode rows and one full chunk in one call
                   (`mixed_step`): projections and MLP once over B + C rows, attention per part
  copy     [1, C]  copies C positions' K/V from one slot to another, every layer (chunked
                   exports: prefix caching puts a cached prefix into a new request's slot)

Prefill graphs return the logits of the last real token (host sampling), or of every
position when the export serves prompt logprobs (`prompt_logits`); TG graphs sample
on device and also return their logits, so a batch with a request that needs more than
on-device sampling offers can be sampled on the host instead. Graph outputs may stay on the
device until `.cpu()` (the neuron backend runs TG asynchronously): a step sampled on device
fetches its tokens only, never the [B, V] logits - one TG graph per bucket serves both cases,
at no extra graph or compile time.

Integer inputs (token ids, positions, slots) are `INDEX_DTYPE` on every backend: the Neuron
runtime takes int32, and one input signature for all backends keeps the cpu and eager tests
on the path Neuron compiles. The decoder widens them once (DecoderModel.hidden_states).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .config import NeuronConfig
from .modeling.decoder import DecoderModel
from .modeling.sampler import sample

INDEX_DTYPE = torch.int32


@dataclass(frozen=True)
class GraphSpec:
    kind: str  # "ce" | "cp" | "tg" | "mx" | "copy"
    batch: int  # rows (mx: decode rows)
    width: int  # tokens per row (mx: of its chunk; copy: positions per call)
    window: int  # context bucket: positions attended over (copy: 0, it attends over nothing)
    narrow: bool = False  # a CP graph narrower than the chunk size, a TG graph than the batch

    @property
    def name(self) -> str:
        if self.kind == COPY:
            return self.kind
        if not self.narrow:
            return f"{self.kind}_w{self.window}"
        return f"{self.kind}_w{self.window}" + (f"_r{self.batch}" if self.kind == "tg" else f"_c{self.width}")


COPY = "copy"


def cp_spec(config: NeuronConfig, width: int, window: int) -> GraphSpec:
    return GraphSpec("cp", 1, width, window, narrow=width < config.prefill_chunk_size)


def tg_spec(config: NeuronConfig, rows: int, window: int) -> GraphSpec:
    return GraphSpec("tg", rows, 1, window, narrow=rows < config.batch_size)


def mx_spec(config: NeuronConfig, window: int) -> GraphSpec:
    return GraphSpec("mx", config.batch_size, config.prefill_chunk_size, window)


def ce_spec(window: int) -> GraphSpec:
    return GraphSpec("ce", 1, window, window)


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
    if config.chunked:
        specs.append(GraphSpec(COPY, 1, config.prefill_chunk_size, 0))
    return specs


class PrefillGraph(nn.Module):
    """CE or CP: [1, T] tokens -> logits [1, V] of the last real token, or [1, T, V] of every
    position (`all_positions`)."""

    def __init__(self, model: DecoderModel, window: int, all_positions: bool = False):
        super().__init__()
        self.model, self.window, self.all_positions = model, window, all_positions

    def forward(self, input_ids, position_ids, seq_ids):
        hidden = self.model.hidden_states(input_ids, position_ids, seq_ids, self.window)
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

    def forward(self, input_ids, position_ids, seq_ids, sampling_params=None, rand=None):
        # B rows, one per slot: attention reads the cache in slot order (no gather)
        hidden = self.model.hidden_states(
            input_ids, position_ids, seq_ids, self.window, one_row_per_slot=True
        )
        logits = self.model.logits(hidden[:, 0])
        if not self.on_device_sampling:
            return logits
        return sample(logits, sampling_params, rand, self.max_topk), logits


class MixedGraph(nn.Module):
    """MX: decode rows [B, 1] and a chunk [1, C] of another slot in one call ->
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
        seq_ids,
        chunk_ids,
        chunk_positions,
        chunk_seq_ids,
        sampling_params=None,
        rand=None,
    ):
        decode, chunk = self.model.parts_hidden_states(
            ((input_ids, position_ids, seq_ids, True), (chunk_ids, chunk_positions, chunk_seq_ids, False)),
            self.window,
        )
        last = torch.argmax(chunk_positions, dim=1)  # padding repeats the last real position
        logits = self.model.logits(torch.cat([decode[:, 0], chunk[0, last]]))
        decode_logits, chunk_logits = logits[:-1], logits[-1:]
        if not self.on_device_sampling:
            return decode_logits, chunk_logits
        return sample(decode_logits, sampling_params, rand, self.max_topk), decode_logits, chunk_logits


class CopyGraph(nn.Module):
    """copy: positions [1, C] of slot seq_ids[0] -> the same positions of slot seq_ids[1]."""

    def __init__(self, model: DecoderModel):
        super().__init__()
        self.model = model

    def forward(self, position_ids, seq_ids):
        self.model.copy_positions(position_ids, seq_ids)
        # an output of its own: graph compilers drop graphs (and runtimes calls) with none
        return position_ids.max(dim=1).values.to(INDEX_DTYPE)


def graph_module(model: DecoderModel, spec: GraphSpec, config: NeuronConfig) -> nn.Module:
    if spec.kind == COPY:
        return CopyGraph(model)
    if spec.kind == "tg":
        return DecodeGraph(model, spec.window, config.on_device_sampling, config.max_topk)
    if spec.kind == "mx":
        return MixedGraph(model, spec.window, config.on_device_sampling, config.max_topk)
    return PrefillGraph(model, spec.window, config.prompt_logits)


def example_inputs(spec: GraphSpec, config: NeuronConfig) -> tuple[torch.Tensor, ...]:
    """Inputs of the static shapes a graph is traced and compiled with."""
    if spec.kind == COPY:
        return torch.arange(spec.width, dtype=INDEX_DTYPE)[None], torch.arange(2, dtype=INDEX_DTYPE)
    if spec.kind == "mx":  # decode rows in slots 0..B-1, the chunk in slot 0 (shapes only)
        inputs = _token_inputs(spec.batch, 1) + _token_inputs(1, spec.width)
    else:
        inputs = _token_inputs(spec.batch, spec.width)
    if spec.kind in ("tg", "mx") and config.on_device_sampling:
        inputs += (torch.zeros(spec.batch, 3), torch.zeros(spec.batch))
    return inputs


def _token_inputs(rows: int, width: int) -> tuple[torch.Tensor, ...]:
    """(token ids, positions [rows, width], slots [rows])"""
    positions = torch.arange(width, dtype=INDEX_DTYPE)[None].expand(rows, -1).contiguous()
    return torch.zeros(rows, width, dtype=INDEX_DTYPE), positions, torch.arange(rows, dtype=INDEX_DTYPE)


def pad_repeat_last(x: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """The padding rule, the only one: repeat the last entry along `dim` up to `length`.

    Applied to a chunk's tokens and positions, padded copies are exact duplicates of the last
    real token (see modeling/attention.py); applied to decode rows, padded rows repeat the
    last real row and so rewrite exactly what it writes.
    """
    missing = length - x.shape[dim]
    if missing < 0:
        raise ValueError(f"{x.shape[dim]} entries do not fit a graph dimension of {length}")
    if missing == 0:
        return x
    last = x.narrow(dim, x.shape[dim] - 1, 1)
    return torch.cat([x, last.expand(*[missing if d == dim else -1 for d in range(x.dim())])], dim=dim)


class GraphRunner:
    """Pads real inputs to the static shapes and picks the smallest bucket that covers them.

    `graphs` maps graph names to callables from the backend. Outputs may alias runtime
    buffers, so what is returned is cloned.
    """

    def __init__(self, config: NeuronConfig, graphs: dict[str, Callable]):
        self.config = config
        self.graphs = graphs

    def prefill(self, token_ids: torch.Tensor, start: int, seq_id: int) -> torch.Tensor:
        """Tokens [T] at positions start.. of slot seq_id -> logits [V] after the last one.

        Chunked exports take T <= prefill_chunk_size; standard ones take a whole prompt.
        """
        logits = self._prefill(token_ids, start, seq_id)
        last = logits[0, token_ids.shape[0] - 1] if self.config.prompt_logits else logits[0]
        return last.clone()

    def prefill_positions(self, token_ids: torch.Tensor, start: int, seq_id: int) -> torch.Tensor:
        """Like `prefill`, but the logits after every token: [T, V] (exports with prompt_logits)."""
        if not self.config.prompt_logits:
            raise ValueError(
                "this export returns the last position's logits only: re-export with --prompt-logprobs"
            )
        return self._prefill(token_ids, start, seq_id)[0, : token_ids.shape[0]].clone()

    def _prefill(self, token_ids: torch.Tensor, start: int, seq_id: int) -> torch.Tensor:
        t = token_ids.shape[0]
        end = start + t
        window = self.config.bucket_for(end)
        limit = self.config.prefill_chunk_size or window
        if t == 0 or t > limit:
            raise ValueError(
                f"a {'cp' if self.config.chunked else 'ce'} call takes 1 to {limit} tokens, got {t}"
            )
        if self.config.chunked:
            spec = cp_spec(self.config, self.config.width_for(t), window)
        else:
            spec = ce_spec(window)
        positions = torch.arange(start, end, dtype=INDEX_DTYPE)
        ids = pad_repeat_last(token_ids.to(INDEX_DTYPE)[None], spec.width, dim=1)
        pos = pad_repeat_last(positions[None], spec.width, dim=1)
        seq = torch.tensor([seq_id], dtype=INDEX_DTYPE)
        return self.graphs[spec.name](ids, pos, seq)  # callers clone what they keep

    def copy_prefix(self, src_slot: int, dst_slot: int, length: int) -> int:
        """Copy positions [0, length) of every layer's K/V from one slot to another, in calls of
        the copy graph's width (the last padded by the one rule). Returns the calls made."""
        if not self.config.chunked:
            raise ValueError("only chunked exports have the copy graph")
        if src_slot == dst_slot or length <= 0:
            return 0
        if length > self.config.sequence_length:
            raise ValueError(f"{length} positions exceed sequence_length {self.config.sequence_length}")
        width = self.config.prefill_chunk_size
        slots = torch.tensor([src_slot, dst_slot], dtype=INDEX_DTYPE)
        calls = 0
        for start in range(0, length, width):
            positions = torch.arange(start, min(start + width, length), dtype=INDEX_DTYPE)
            self.graphs[COPY](pad_repeat_last(positions[None], width, dim=1), slots)
            calls += 1
        return calls

    def decode(
        self,
        token_ids: torch.Tensor,  # [N]
        positions: torch.Tensor,  # [N]
        seq_ids: torch.Tensor,  # [N]
        params: torch.Tensor,  # [N, 3]
        rand: torch.Tensor,  # [N]
        need_logits: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One TG step for N <= batch_size slots -> (tokens [N], logits [N, V] or None), in the
        narrowest TG graph that holds N rows.

        Logits are fetched from the graph's outputs only if `need_logits` (or if the export
        samples on the host, where the tokens come from them)."""
        n = self._check_decode_rows(seq_ids)
        spec = tg_spec(
            self.config, self.config.decode_width_for(n), self.config.bucket_for(int(positions.max()) + 1)
        )
        inputs = [
            pad_repeat_last(x, spec.batch, dim=0) for x in (token_ids[:, None], positions[:, None], seq_ids)
        ]
        outputs = self.graphs[spec.name](*self._decode_inputs(inputs, params, rand, spec.batch))
        if not self.config.on_device_sampling:
            outputs = (outputs,)
        return self._decode_outputs(outputs, n, params, rand, need_logits)

    def decode_with_chunk(
        self,
        token_ids: torch.Tensor,  # [N]
        positions: torch.Tensor,  # [N]
        seq_ids: torch.Tensor,  # [N]
        params: torch.Tensor,  # [N, 3]
        rand: torch.Tensor,  # [N]
        chunk_ids: torch.Tensor,  # [C]: a full chunk
        chunk_start: int,
        chunk_seq_id: int,
        need_logits: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """A decode step and a full prefill chunk of another slot in one MX call (mixed_step
        exports) -> (tokens [N], decode logits [N, V] or None, the chunk's last logits [V])."""
        n, c = self._check_decode_rows(seq_ids), self.config.prefill_chunk_size
        if not self.config.mixed_step or chunk_ids.shape[0] != c or chunk_seq_id in seq_ids.tolist():
            raise ValueError(
                f"a mixed step takes decode rows and a full chunk of {c} tokens of another slot "
                f"(mixed_step exports): got {chunk_ids.shape[0]} tokens in slot {chunk_seq_id}, "
                f"decoding slots {seq_ids.tolist()}, mixed_step={self.config.mixed_step}"
            )
        chunk_end = chunk_start + c
        spec = mx_spec(self.config, self.config.bucket_for(max(int(positions.max()) + 1, chunk_end)))
        rows = [
            pad_repeat_last(x, spec.batch, dim=0) for x in (token_ids[:, None], positions[:, None], seq_ids)
        ]
        chunk = [
            chunk_ids[None],
            torch.arange(chunk_start, chunk_end)[None],
            torch.tensor([chunk_seq_id]),
        ]
        outputs = self.graphs[spec.name](*self._decode_inputs(rows + chunk, params, rand, spec.batch))
        tokens, logits = self._decode_outputs(outputs[:-1], n, params, rand, need_logits)
        return tokens, logits, outputs[-1].cpu()[0].clone()

    def _check_decode_rows(self, seq_ids: torch.Tensor) -> int:
        n, batch = seq_ids.shape[0], self.config.batch_size
        if not 0 < n <= batch:
            raise ValueError(f"a decode step takes 1 to {batch} rows, got {n}")
        if len(set(seq_ids.tolist())) != n:
            # two rows of one slot would write the same cache row; one would get the other's result
            raise ValueError(f"a decode step takes distinct slots, got {seq_ids.tolist()}")
        return n

    def _decode_inputs(self, tokens: list, params: torch.Tensor, rand: torch.Tensor, batch: int) -> list:
        """A decode graph's inputs as traced: integers INDEX_DTYPE, and the sampling inputs
        padded to the graph's rows where it samples on device."""
        inputs = [x.to(INDEX_DTYPE) for x in tokens]
        if self.config.on_device_sampling:
            inputs += [pad_repeat_last(x.float(), batch, dim=0) for x in (params, rand)]
        return inputs

    def _decode_outputs(self, outputs: tuple, n: int, params, rand, need_logits: bool):
        """(tokens, logits) or (logits,) of a decode graph -> (tokens [N], logits [N, V] or None)."""
        if self.config.on_device_sampling:
            tokens, logits = outputs
            return tokens.cpu()[:n].clone(), logits.cpu()[:n].clone() if need_logits else None
        logits = outputs[0].cpu()[:n].clone()
        return sample(logits, params.float(), rand.float(), self.config.max_topk), logits
