"""The runtime side of the graph set: real inputs padded to the graphs' static shapes by the
one padding rule, in the bucket and width that hold them (graphs.py describes the set).

A request's KV address is its pool blocks in position order (a sequence of ints, at least one
block per P positions it writes; longer is fine): one block, its slot, where a block is a
whole sequence. Several requests' KV is a tensor of block tables [N, M] (block_pool.block_table).
Each graph gets the tables cut or padded by the one rule to its bucket's ceil(W / P) columns
(modeling/kv_cache.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig

from .backends import get_backend
from .config import NeuronConfig
from .export_folder import ExportCapabilities, check_export
from .graphs import COPY, INDEX_DTYPE, GraphSpec, ce_spec, cp_spec, graph_specs, mx_spec, tg_spec, vf_spec
from .modeling.sampler import sample, sampling_params


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


def _chunk_inputs(token_ids: torch.Tensor, start: int, table: torch.Tensor, width: int) -> list[torch.Tensor]:
    """A prefill chunk's graph inputs: tokens [1, width] at positions start.. [1, width] of the
    request with block table [1, ceil(W / P)], padded by the one rule, integers INDEX_DTYPE."""
    positions = torch.arange(start, start + token_ids.shape[0], dtype=INDEX_DTYPE)
    ids = pad_repeat_last(token_ids.to(INDEX_DTYPE)[None], width, dim=1)
    return [ids, pad_repeat_last(positions[None], width, dim=1), table]


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
        self, token_ids: torch.Tensor, start: int, blocks: Sequence[int], every_position: bool = False
    ) -> torch.Tensor:
        """Tokens [T] at positions start.. of the request with KV blocks `blocks` -> logits [V] after the last one, or [T, V] after every one if `every_position` (exports
        with prompt_logprobs).

        Chunked exports take T <= prefill_chunk_size; standard ones take a whole prompt.
        """
        if every_position and not self.config.prompt_logprobs:
            raise ValueError(
                "this export returns the last position's logits only: re-export with --prompt-logprobs"
            )
        logits = self._prefill(token_ids, start, blocks)
        if every_position:
            return logits[0, : token_ids.shape[0]].clone()
        last = logits[0, token_ids.shape[0] - 1] if self.config.prompt_logprobs else logits[0]
        return last.clone()

    def _prefill(self, token_ids: torch.Tensor, start: int, blocks: Sequence[int]) -> torch.Tensor:
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
        table = self._request_table(blocks, window, end)
        # callers clone what they keep
        return self.graphs[spec.name](*_chunk_inputs(token_ids, start, table, spec.width))

    def copy_prefix(self, src_block: int, dst_block: int, length: int) -> int:
        """Copy positions [0, length) of every layer's K/V from one whole-sequence block to
        another, in calls of the copy graph's width (the last padded by the one rule). Returns
        the calls made."""
        if COPY not in self.graphs:
            raise ValueError(
                "only chunked exports without --kv-block-size have the copy graph (smaller blocks are shared instead)"
            )
        if src_block == dst_block or length <= 0:
            return 0
        if length > self.config.sequence_length:
            raise ValueError(f"{length} positions exceed sequence_length {self.config.sequence_length}")
        width = self.config.prefill_chunk_size
        blocks = torch.tensor([src_block, dst_block], dtype=INDEX_DTYPE)
        calls = 0
        for start in range(0, length, width):
            positions = torch.arange(start, min(start + width, length), dtype=INDEX_DTYPE)
            self.graphs[COPY](pad_repeat_last(positions[None], width, dim=1), blocks)
            calls += 1
        return calls

    def decode(
        self,
        token_ids: torch.Tensor,  # [N]
        positions: torch.Tensor,  # [N]
        tables: torch.Tensor,  # [N, M] block tables
        params: torch.Tensor | None = None,  # [N, 3] (sampling.sampling_params rows); greedy
        rand: torch.Tensor | None = None,  # [N]
        need_logits: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One TG step for N <= batch_size rows -> (tokens [N], logits [N, V] or None), in the
        narrowest TG graph that holds N rows.

        Logits are fetched from the graph's outputs only if `need_logits` (or if the export
        samples on the host, where the tokens come from them)."""
        n = len(self._decode_writes(tables, positions))
        if params is None:
            params = torch.tensor([sampling_params(temperature=0.0)] * n)
        if rand is None:
            rand = torch.zeros(n)
        spec = tg_spec(
            self.config, self.config.decode_width_for(n), self.config.bucket_for(int(positions.max()) + 1)
        )
        rows, sampling, order = self._decode_inputs(
            spec, token_ids[:, None], positions[:, None], tables, params, rand
        )
        outputs = self.graphs[spec.name](*rows, *sampling)
        if not self.config.on_device_sampling:
            outputs = (outputs,)
        return self._decode_outputs(outputs, order, params, rand, need_logits)

    def decode_with_chunk(
        self,
        token_ids: torch.Tensor,  # [N]
        positions: torch.Tensor,  # [N]
        tables: torch.Tensor,  # [N, M] block tables
        params: torch.Tensor,  # [N, 3]
        rand: torch.Tensor,  # [N]
        chunk_ids: torch.Tensor,  # [C]: a full chunk
        chunk_start: int,
        chunk_blocks: Sequence[int],
        need_logits: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """A decode step and a full prefill chunk of another request in one MX call (mixed_step
        exports) -> (tokens [N], decode logits [N, V] or None, the chunk's last logits [V])."""
        decode_writes = self._decode_writes(tables, positions)
        c = self.config.prefill_chunk_size
        end = chunk_start + c
        chunk_writes = self._chunk_writes(chunk_blocks, chunk_start, end)
        if not self.config.mixed_step or chunk_ids.shape[0] != c or set(chunk_writes) & set(decode_writes):
            raise ValueError(
                f"a mixed step takes decode rows and a full chunk of {c} tokens writing other blocks "
                f"(mixed_step exports): got {chunk_ids.shape[0]} tokens in blocks {list(chunk_blocks)}, "
                f"decoding with block tables {tables.tolist()}, mixed_step={self.config.mixed_step}"
            )
        spec = mx_spec(self.config, self.config.bucket_for(max(int(positions.max()) + 1, end)))
        rows, sampling, order = self._decode_inputs(
            spec, token_ids[:, None], positions[:, None], tables, params, rand
        )
        chunk = _chunk_inputs(chunk_ids, chunk_start, self._request_table(chunk_blocks, spec.window, end), c)
        outputs = self.graphs[spec.name](*rows, *chunk, *sampling)
        tokens, logits = self._decode_outputs(outputs[:-1], order, params, rand, need_logits)
        return tokens, logits, outputs[-1].cpu()[0].clone()

    def verify(
        self,
        token_rows: list[torch.Tensor],  # N rows of [1 + d]: a row's last token, then its d <= K drafts
        positions: torch.Tensor,  # [N]: the position of each row's first token
        tables: torch.Tensor,  # [N, M] block tables
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
        n = len(self._decode_writes(tables, pos[:, -1]))
        spec = vf_spec(
            self.config, self.config.decode_width_for(n), self.config.bucket_for(int(pos.max()) + 1)
        )
        rows, _, order = self._decode_inputs(spec, ids, pos, tables)
        argmax, logits = self.graphs[spec.name](*rows)
        unsort = torch.argsort(order)
        return argmax.cpu()[unsort].long(), logits.cpu()[unsort] if need_logits else None

    def _decode_writes(self, tables: torch.Tensor, positions: torch.Tensor) -> list[int]:
        """Checked decode rows (1 to batch_size, each writing a block of its own) -> the block
        each row writes: the one holding its position."""
        n, batch = tables.shape[0], self.config.batch_size
        if not 0 < n <= batch:
            raise ValueError(f"a decode step takes 1 to {batch} rows, got {n}")
        self._check_tables(tables, positions)
        column = torch.div(positions.long(), self.config.kv_block_positions, rounding_mode="floor")
        writes = tables.long().gather(1, column[:, None])[:, 0].tolist()
        if len(set(writes)) != n:
            # two rows writing one block: one would overwrite the other's positions
            raise ValueError(
                f"a decode step takes rows writing distinct blocks, got block tables {tables.tolist()}"
            )
        return writes

    def _request_table(self, blocks: Sequence[int], window: int, end: int) -> torch.Tensor:
        """One request's block table [1, ceil(window / P)] for a graph writing positions below `end`."""
        table = self._block_ids(blocks)[None]
        self._check_tables(table, torch.tensor([end - 1]))
        return self._fit_tables(table, window)

    def _chunk_writes(self, blocks: Sequence[int], start: int, end: int) -> list[int]:
        """The blocks a chunk at positions start..end-1 writes."""
        size = self.config.kv_block_positions
        return self._block_ids(blocks)[start // size : (end - 1) // size + 1].tolist()

    def _block_ids(self, blocks: Sequence[int]) -> torch.Tensor:
        return torch.as_tensor(blocks).long().reshape(-1)

    def _check_tables(self, tables: torch.Tensor, last_positions: torch.Tensor) -> None:
        """Each row [N, M] holds pool blocks (0..kv_pool_blocks - 1) for every position up to its last."""
        size, pool = self.config.kv_block_positions, self.config.kv_pool_blocks
        if tables.dim() != 2 or tables.shape[0] != last_positions.shape[0]:
            raise ValueError(f"block tables are [rows, blocks], got {tuple(tables.shape)}")
        needed = int(last_positions.long().max()) // size + 1
        if needed > tables.shape[1] or bool(((tables < 0) | (tables >= pool)).any()):
            raise ValueError(
                f"block tables {tables.tolist()} must hold pool blocks 0..{pool - 1} for positions up to "
                f"{last_positions.tolist()} ({size} positions a block)"
            )

    def _fit_tables(self, tables: torch.Tensor, window: int) -> torch.Tensor:
        """Block tables [N, M] cut, or padded by the one rule, to ceil(window / P) columns."""
        columns = self.config.table_columns(window)
        return pad_repeat_last(tables.to(INDEX_DTYPE)[:, :columns], columns, dim=1).contiguous()

    def _decode_inputs(self, spec: GraphSpec, token_ids, positions, tables, params=None, rand=None) -> tuple:
        """Decode rows (token ids and positions [N, T], block tables [N, M]) as graph `spec` takes
        them (spec.batch rows, tables fit to its window) -> (token inputs, sampling inputs, order).
        Rows go longest context first, so the padding (the one rule: repeat the last row) repeats
        the shortest: where each row reads only its live context (the cpu backend's
        per_row_live), a padded row costs the least it can.
        Integers are INDEX_DTYPE; the sampling inputs are there where the graph samples on device."""
        rows, tables = spec.batch, self._fit_tables(tables, spec.window)
        order = torch.argsort(positions[:, -1], descending=True, stable=True)
        tokens = [
            pad_repeat_last(x[order].to(INDEX_DTYPE), rows, dim=0) for x in (token_ids, positions, tables)
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
