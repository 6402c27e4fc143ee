"""The runtime side of the graph set: real inputs padded to the graphs' static shapes by the
one padding rule, in the bucket and width that hold them (graphs.py describes the set).

A request's KV is its slot (an int) or, in a paged export, its block ids (a list, tuple or 1-D
tensor, at least one block per P positions it writes; longer is fine); several requests' KV
is a tensor of slots [N] or of block tables [N, M] right-padded with the null block 0. Each
graph gets the tables cut or padded (with 0) to its bucket's W // P columns."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig

from .backends import get_backend
from .config import NeuronConfig
from .graphs import COPY, INDEX_DTYPE, ce_spec, cp_spec, graph_specs, mx_spec, tg_spec, vf_spec
from .loaded_export import ExportCapabilities, check_export
from .modeling.sampler import sample, sampling_params

SlotOrBlocks = int | Sequence[int] | torch.Tensor


def pad_repeat_last(x: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """The padding rule, the only one: repeat the last entry along `dim` up to `length`.

    Applied to a chunk's tokens and positions, padded copies are exact duplicates of the last
    real token (see modeling/kv_cache.py); applied to decode rows, padded rows repeat the
    last real row and so rewrite exactly what it writes.
    """
    missing = length - x.shape[dim]
    if missing < 0:
        raise ValueError(f"{x.shape[dim]} entries do not fit a graph dimension of {length}")
    if missing == 0:
        return x
    last = x.narrow(dim, x.shape[dim] - 1, 1)
    return torch.cat([x, last.expand(*[missing if d == dim else -1 for d in range(x.dim())])], dim=dim)


def _chunk_inputs(token_ids: torch.Tensor, start: int, kv: torch.Tensor, width: int) -> list[torch.Tensor]:
    """A prefill chunk's graph inputs: tokens [1, width] at positions start.. [1, width] of
    `kv` (slot [1] or block table [1, W // P]), padded by the one rule, integers INDEX_DTYPE."""
    positions = torch.arange(start, start + token_ids.shape[0], dtype=INDEX_DTYPE)
    ids = pad_repeat_last(token_ids.to(INDEX_DTYPE)[None], width, dim=1)
    return [ids, pad_repeat_last(positions[None], width, dim=1), kv]


class GraphRunner:
    """The engine of one export: its graphs, what it serves (`capabilities`), and one method per
    operation - prefill, decode, decode_with_chunk (a mixed step), verify (speculative decoding),
    copy_prefix. Pads real inputs to the static shapes and picks the smallest bucket that covers
    them.

    `graphs` maps graph names to callables from the backend. Outputs may alias runtime
    buffers, so what is returned is cloned.
    """

    def __init__(
        self,
        config: NeuronConfig,
        graphs: dict[str, Callable],
        hf_config: PretrainedConfig | None = None,
    ):
        self.config = config
        self.graphs = graphs
        self.hf_config = hf_config
        self.capabilities = ExportCapabilities.of(config, hf_config) if hf_config is not None else None

    @classmethod
    def load(
        cls, model_dir: str | Path, backend: str | None = None, verify_weights: bool = False
    ) -> GraphRunner:
        """The export in local folder `model_dir`, checked (check_export, once per process and
        file state: integrity._digest_of) then loaded: every graph bound to one set of weights
        and one KV cache."""
        config = check_export(model_dir, backend, verify_weights)
        hf_config = AutoConfig.from_pretrained(model_dir)
        graphs = get_backend(config.backend).load(hf_config, config, graph_specs(config), Path(model_dir))
        return cls(config, graphs, hf_config)

    def prefill(
        self, token_ids: torch.Tensor, start: int, seq_id: SlotOrBlocks, every_position: bool = False
    ) -> torch.Tensor:
        """Tokens [T] at positions start.. of slot seq_id (or block ids for paged exports) ->
        logits [V] after the last one, or [T, V] after every one if `every_position` (exports
        with prompt_logprobs).

        Chunked exports take T <= prefill_chunk_size; standard ones take a whole prompt.
        """
        if every_position and not self.config.prompt_logprobs:
            raise ValueError(
                "this export returns the last position's logits only: re-export with --prompt-logprobs"
            )
        logits = self._prefill(token_ids, start, seq_id)
        if every_position:
            return logits[0, : token_ids.shape[0]].clone()
        last = logits[0, token_ids.shape[0] - 1] if self.config.prompt_logprobs else logits[0]
        return last.clone()

    def _prefill(self, token_ids: torch.Tensor, start: int, seq_id: SlotOrBlocks) -> torch.Tensor:
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
        kv = self._request_kv(seq_id, window, end)
        # callers clone what they keep
        return self.graphs[spec.name](*_chunk_inputs(token_ids, start, kv, spec.width))

    def copy_prefix(self, src_slot: int, dst_slot: int, length: int) -> int:
        """Copy positions [0, length) of every layer's K/V from one slot to another, in calls of
        the copy graph's width (the last padded by the one rule). Returns the calls made."""
        if not self.config.chunked or self.config.paged:
            raise ValueError(
                "only chunked slot exports have the copy graph (paged exports share blocks instead)"
            )
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
        seq_ids: torch.Tensor,  # [N] slots, or block tables [N, M] for paged exports
        params: torch.Tensor | None = None,  # [N, 3] (sampling.sampling_params rows); greedy
        rand: torch.Tensor | None = None,  # [N]
        need_logits: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One TG step for N <= batch_size slots (paged: requests) -> (tokens [N], logits [N, V]
        or None), in the narrowest TG graph that holds N rows.

        Logits are fetched from the graph's outputs only if `need_logits` (or if the export
        samples on the host, where the tokens come from them)."""
        n = len(self._decode_writes(seq_ids, positions))
        if params is None:
            params = torch.tensor([sampling_params(temperature=0.0)] * n)
        if rand is None:
            rand = torch.zeros(n)
        spec = tg_spec(
            self.config, self.config.decode_width_for(n), self.config.bucket_for(int(positions.max()) + 1)
        )
        kv = self._fit_tables(seq_ids, spec.window) if self.config.paged else seq_ids
        rows, sampling, order = self._decode_inputs(
            spec.batch, token_ids[:, None], positions[:, None], kv, params, rand
        )
        outputs = self.graphs[spec.name](*rows, *sampling)
        if not self.config.on_device_sampling:
            outputs = (outputs,)
        return self._decode_outputs(outputs, order, params, rand, need_logits)

    def decode_with_chunk(
        self,
        token_ids: torch.Tensor,  # [N]
        positions: torch.Tensor,  # [N]
        seq_ids: torch.Tensor,  # [N] slots, or block tables [N, M] for paged exports
        params: torch.Tensor,  # [N, 3]
        rand: torch.Tensor,  # [N]
        chunk_ids: torch.Tensor,  # [C]: a full chunk
        chunk_start: int,
        chunk_seq_id: SlotOrBlocks,  # slot, or block ids for paged exports
        need_logits: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """A decode step and a full prefill chunk of another slot in one MX call (mixed_step
        exports) -> (tokens [N], decode logits [N, V] or None, the chunk's last logits [V])."""
        decode_writes = self._decode_writes(seq_ids, positions)
        c = self.config.prefill_chunk_size
        end = chunk_start + c
        chunk_writes = self._chunk_writes(chunk_seq_id, chunk_start, end) if self.config.mixed_step else []
        if not self.config.mixed_step or chunk_ids.shape[0] != c or set(chunk_writes) & set(decode_writes):
            raise ValueError(
                f"a mixed step takes decode rows and a full chunk of {c} tokens of another slot "
                f"(mixed_step exports): got {chunk_ids.shape[0]} tokens in slot {chunk_seq_id}, "
                f"decoding slots {seq_ids.tolist()}, mixed_step={self.config.mixed_step}"
            )
        spec = mx_spec(self.config, self.config.bucket_for(max(int(positions.max()) + 1, end)))
        kv = self._fit_tables(seq_ids, spec.window) if self.config.paged else seq_ids
        rows, sampling, order = self._decode_inputs(
            spec.batch, token_ids[:, None], positions[:, None], kv, params, rand
        )
        chunk = _chunk_inputs(chunk_ids, chunk_start, self._request_kv(chunk_seq_id, spec.window, end), c)
        outputs = self.graphs[spec.name](*rows, *chunk, *sampling)
        tokens, logits = self._decode_outputs(outputs[:-1], order, params, rand, need_logits)
        return tokens, logits, outputs[-1].cpu()[0].clone()

    def verify(
        self,
        token_rows: list[torch.Tensor],  # N rows of [1 + d]: a row's last token, then its d <= K drafts
        positions: torch.Tensor,  # [N]: the position of each row's first token
        seq_ids: torch.Tensor,  # [N] slots, or block tables [N, M] for paged exports
        need_logits: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One VF call (exports with speculation_length K) -> (argmax [N, K + 1], logits
        [N, K + 1, V] or None): entry j of a row is what follows its token j. A row with fewer
        than K drafts is padded by the one rule (its last token and position repeated), so
        entries past its own length repeat its last one. Logits are fetched only if wanted."""
        width = self.config.verify_width
        if not self.config.speculation_length:
            raise ValueError("this export has no verify graphs: re-export with --speculation-length K")
        if any(not 1 <= len(r) <= width for r in token_rows):
            raise ValueError(f"a verify row takes 1 to {width} tokens, got {[len(r) for r in token_rows]}")
        ids = torch.stack([pad_repeat_last(r.to(INDEX_DTYPE)[None], width, dim=1)[0] for r in token_rows])
        spans = [
            torch.arange(int(p), int(p) + len(r), dtype=INDEX_DTYPE)
            for p, r in zip(positions, token_rows, strict=True)
        ]
        pos = torch.stack([pad_repeat_last(s[None], width, dim=1)[0] for s in spans])
        n = len(self._decode_writes(seq_ids, pos[:, -1]))
        spec = vf_spec(
            self.config, self.config.decode_width_for(n), self.config.bucket_for(int(pos.max()) + 1)
        )
        kv = self._fit_tables(seq_ids, spec.window) if self.config.paged else seq_ids
        rows, _, order = self._decode_inputs(spec.batch, ids, pos, kv)
        argmax, logits = self.graphs[spec.name](*rows)
        unsort = torch.argsort(order)
        return argmax.cpu()[unsort].long(), logits.cpu()[unsort] if need_logits else None

    def _decode_writes(self, seq_ids: torch.Tensor, positions: torch.Tensor) -> list[int]:
        """Checked decode rows (1 to batch_size, each writing its own slot or block) -> what each
        row writes: its slot, or (paged) the block of its position."""
        n, batch = seq_ids.shape[0], self.config.batch_size
        if not 0 < n <= batch:
            raise ValueError(f"a decode step takes 1 to {batch} rows, got {n}")
        if seq_ids.dim() != (2 if self.config.paged else 1):
            raise ValueError(
                f"decode rows take slots [N] (paged exports: block tables [N, M]), got {tuple(seq_ids.shape)}"
            )
        writes = seq_ids.tolist()
        if self.config.paged:
            self._check_tables(seq_ids, positions)
            column = torch.div(positions.long(), self.config.kv_block_size, rounding_mode="floor")
            writes = seq_ids.long().gather(1, column[:, None])[:, 0].tolist()
        if len(set(writes)) != n:
            # two rows of one slot would write the same cache row; one would get the other's result
            raise ValueError(
                f"a decode step takes distinct slots (paged: rows writing distinct blocks), got {seq_ids.tolist()}"
            )
        return writes

    def _request_kv(self, seq_id: SlotOrBlocks, window: int, end: int) -> torch.Tensor:
        """One request's KV input to a graph of bucket `window` writing positions below `end`:
        its slot [1], or (paged) its block table [1, window // P]."""
        if not self.config.paged:
            if isinstance(seq_id, list | tuple):
                raise ValueError(f"a slot export takes a request's slot, not block ids ({seq_id})")
            return torch.tensor([seq_id], dtype=INDEX_DTYPE)
        table = self._block_ids(seq_id)[None]
        self._check_tables(table, torch.tensor([end - 1]))
        return self._fit_tables(table, window)

    def _chunk_writes(self, seq_id: SlotOrBlocks, start: int, end: int) -> list[int]:
        """What a chunk at positions start..end-1 writes: its slot, or (paged) its blocks."""
        if not self.config.paged:
            return [seq_id]
        size = self.config.kv_block_size
        return self._block_ids(seq_id)[start // size : (end - 1) // size + 1].tolist()

    def _block_ids(self, seq_id: SlotOrBlocks) -> torch.Tensor:
        if isinstance(seq_id, int):
            raise ValueError(f"a paged export takes a request's block ids, not a slot ({seq_id})")
        return torch.as_tensor(seq_id).long().reshape(-1)

    def _check_tables(self, tables: torch.Tensor, last_positions: torch.Tensor) -> None:
        """Each row [N, M] holds pool blocks (1..kv_cache_blocks, then 0 padding) for every
        position up to its last: block 0 is never written (modeling/kv_cache.py)."""
        size, pool = self.config.kv_block_size, self.config.kv_cache_blocks
        if tables.dim() != 2 or tables.shape[0] != last_positions.shape[0]:
            raise ValueError(f"block tables are [rows, blocks], got {tuple(tables.shape)}")
        needed = torch.div(last_positions.long(), size, rounding_mode="floor") + 1
        in_use = torch.arange(tables.shape[1]) < needed[:, None]
        out_of_pool = bool(((tables < 0) | (tables > pool)).any())
        if int(needed.max()) > tables.shape[1] or out_of_pool or bool(((tables == 0) & in_use).any()):
            raise ValueError(
                f"block tables {tables.tolist()} must hold pool blocks 1..{pool} for positions up to "
                f"{last_positions.tolist()} ({size} positions a block), padded with 0"
            )

    def _fit_tables(self, tables: torch.Tensor, window: int) -> torch.Tensor:
        """Block tables [N, M] cut or right-padded with block 0 to window // P columns."""
        columns = window // self.config.kv_block_size
        tables = tables.to(INDEX_DTYPE)[:, :columns]
        return torch.nn.functional.pad(tables, (0, columns - tables.shape[1])).contiguous()

    def _decode_inputs(self, rows: int, token_ids, positions, seq_ids, params=None, rand=None) -> tuple:
        """Decode rows (token ids and positions [N, T]) as a graph of `rows` rows takes them ->
        (token inputs, sampling inputs, order). Rows go longest context first, so the padding
        (the one rule: repeat the last row) repeats the shortest: where each row reads only its
        live context (the cpu backend's per_row_live), a padded row costs the least it can.
        Integers are INDEX_DTYPE; the sampling inputs are there where the graph samples on device."""
        order = torch.argsort(positions[:, -1], descending=True, stable=True)
        tokens = [
            pad_repeat_last(x[order].to(INDEX_DTYPE), rows, dim=0) for x in (token_ids, positions, seq_ids)
        ]
        sampling = []
        if params is not None and self.config.on_device_sampling:
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
