"""The runtime side of the graph set: real inputs padded to the graphs' static shapes by the
one padding rule, in the bucket and width that hold them (graphs.py describes the set)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .config import NeuronConfig
from .graphs import COPY, INDEX_DTYPE, ce_spec, cp_spec, mx_spec, tg_spec
from .modeling.sampler import sample


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


def _chunk_inputs(token_ids: torch.Tensor, start: int, seq_id: int, width: int) -> list[torch.Tensor]:
    """A prefill chunk's graph inputs: tokens [1, width] at positions start.. [1, width] of
    slot [1], padded by the one rule, integers INDEX_DTYPE."""
    positions = torch.arange(start, start + token_ids.shape[0], dtype=INDEX_DTYPE)
    ids = pad_repeat_last(token_ids.to(INDEX_DTYPE)[None], width, dim=1)
    return [ids, pad_repeat_last(positions[None], width, dim=1), torch.tensor([seq_id], dtype=INDEX_DTYPE)]


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
        last = logits[0, token_ids.shape[0] - 1] if self.config.prompt_logprobs else logits[0]
        return last.clone()

    def prefill_positions(self, token_ids: torch.Tensor, start: int, seq_id: int) -> torch.Tensor:
        """Like `prefill`, but the logits after every token: [T, V] (exports with prompt_logprobs)."""
        if not self.config.prompt_logprobs:
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
        # callers clone what they keep
        return self.graphs[spec.name](*_chunk_inputs(token_ids, start, seq_id, spec.width))

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
        rows, sampling, order = self._decode_inputs(spec.batch, token_ids, positions, seq_ids, params, rand)
        outputs = self.graphs[spec.name](*rows, *sampling)
        if not self.config.on_device_sampling:
            outputs = (outputs,)
        return self._decode_outputs(outputs, order, params, rand, need_logits)

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
        self._check_decode_rows(seq_ids)
        c = self.config.prefill_chunk_size
        if not self.config.mixed_step or chunk_ids.shape[0] != c or chunk_seq_id in seq_ids.tolist():
            raise ValueError(
                f"a mixed step takes decode rows and a full chunk of {c} tokens of another slot "
                f"(mixed_step exports): got {chunk_ids.shape[0]} tokens in slot {chunk_seq_id}, "
                f"decoding slots {seq_ids.tolist()}, mixed_step={self.config.mixed_step}"
            )
        spec = mx_spec(self.config, self.config.bucket_for(max(int(positions.max()) + 1, chunk_start + c)))
        rows, sampling, order = self._decode_inputs(spec.batch, token_ids, positions, seq_ids, params, rand)
        chunk = _chunk_inputs(chunk_ids, chunk_start, chunk_seq_id, c)
        outputs = self.graphs[spec.name](*rows, *chunk, *sampling)
        tokens, logits = self._decode_outputs(outputs[:-1], order, params, rand, need_logits)
        return tokens, logits, outputs[-1].cpu()[0].clone()

    def _check_decode_rows(self, seq_ids: torch.Tensor) -> int:
        """-> the number of rows, 1 to batch_size, each of its own slot."""
        n, batch = seq_ids.shape[0], self.config.batch_size
        if not 0 < n <= batch:
            raise ValueError(f"a decode step takes 1 to {batch} rows, got {n}")
        if len(set(seq_ids.tolist())) != n:
            # two rows of one slot would write the same cache row; one would get the other's result
            raise ValueError(f"a decode step takes distinct slots, got {seq_ids.tolist()}")
        return n

    def _decode_inputs(self, rows: int, token_ids, positions, seq_ids, params, rand) -> tuple:
        """Decode rows as a graph of `rows` rows takes them -> (token inputs, sampling inputs,
        order). Rows go longest context first, so the padding (the one rule: repeat the last
        row) repeats the shortest: where each row reads only its live context
        (the cpu backend's per_row_live), a padded row costs the least it can. Integers are INDEX_DTYPE;
        the sampling inputs are there where the graph samples on device."""
        order = torch.argsort(positions, descending=True, stable=True)
        tokens = [
            pad_repeat_last(x[order].to(INDEX_DTYPE), rows, dim=0)
            for x in (token_ids[:, None], positions[:, None], seq_ids)
        ]
        sampling = []
        if self.config.on_device_sampling:
            sampling = [pad_repeat_last(x[order].float(), rows, dim=0) for x in (params, rand)]
        return tokens, sampling, order

    def _decode_outputs(self, outputs: tuple, order: torch.Tensor, params, rand, need_logits: bool):
        """(tokens, logits) or (logits,) of a decode graph, rows in `order` -> (tokens [N],
        logits [N, V] or None) in the caller's row order (indexing copies off the graph's buffers)."""
        unsort = torch.argsort(order)
        if self.config.on_device_sampling:
            tokens, logits = outputs
            return tokens.cpu()[unsort], logits.cpu()[unsort] if need_logits else None
        logits = outputs[0].cpu()[unsort]
        return sample(logits, params.float(), rand.float(), self.config.max_topk), logits
