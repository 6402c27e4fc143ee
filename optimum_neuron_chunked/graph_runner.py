"""The engine of one export: real inputs padded to the graphs' static shapes by the one
padding rule, in the bucket and width that hold them (graphs.py describes the set).

Every operation takes rows as tokens, positions and KV blocks: a request's KV address is its
pool blocks in position order (at least one block per P positions it writes; longer is fine;
one whole-sequence block). One internal path (GraphRunner._call)
checks them, pads them, builds the block tables once at the graph's ceil(W / P) columns
(graph_inputs.py, modeling/kv_cache.py), calls the graph and returns the real rows' outputs in the
caller's order. Nothing is sampled here beyond what a graph samples on the device: sampling is
the callers' (the vLLM runner, generation.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig

from .backends import get_backend
from .backends.base import SlotWriter
from .config import NeuronConfig, prefill_slices
from .draft_rows import CalledRows, draft_graph, shifted, shifted_rows
from .export_folder import ExportCapabilities, check_export
from .graph_inputs import INDEX_DTYPE, last_index_input, pad_repeat_last, row_inputs
from .graphs import (
    COPY,
    GraphKind,
    GraphSpec,
    ce_spec,
    cp_spec,
    graph_specs,
    mx_spec,
    samples_on_device,
    tg_spec,
    vf_spec,
)
from .lora_adapter import LoraAdapter, read_adapter, slot_tensors
from .modeling.family import family_spec
from .modeling.kv_layout import KVPool, row_blocks
from .modeling.lora import NO_ADAPTER, LoraSpec, row_slots

logger = logging.getLogger(__name__)


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
        write_slot: SlotWriter | None = None,
    ):
        self.config = config
        self.graphs = graphs
        self.write_slot = write_slot
        self.hf_config = hf_config
        self.capabilities = ExportCapabilities.of(config, hf_config) if hf_config is not None else None
        self.pool = KVPool.of(config)
        self.calls = 0  # graph calls so far: a draft call must follow the call whose rows it drafts for
        self.last_chunk: CalledRows | None = None  # the latest CP call's rows (draft_after_chunk)
        self.last_verify: CalledRows | None = None  # the latest VF call's rows (draft_after_verify)

    @classmethod
    def load(
        cls, model_dir: str | Path, backend: str | None = None, verify_weights: bool = False
    ) -> GraphRunner:
        """The export in local folder `model_dir`, checked (check_export, once per process and
        file state: integrity._digest_of) then loaded: every graph bound to one set of weights
        and one KV cache."""
        config = check_export(model_dir, backend, verify_weights)
        if config.nki_attention:
            logger.warning(
                "%s: prefill chunks attend through nkilib attention_cte in %s; the reference attention elsewhere",
                model_dir,
                ", ".join(config.nki_attention),
            )
        if config.quantization:
            scales = "block-wise" if config.quantization_block else "per output channel"
            kept = (
                f"; kept in {config.dtype}: {', '.join(config.quantization_skip)}"
                if config.quantization_skip
                else ""
            )
            logger.warning(
                "%s: %s projection weights, scales %s%s", model_dir, config.quantization, scales, kept
            )
        hf_config = AutoConfig.from_pretrained(model_dir)
        graphs, write_slot = get_backend(config.backend).load(
            hf_config, config, graph_specs(config), Path(model_dir)
        )
        return cls(config, graphs, hf_config, write_slot)

    def read_adapter(self, path) -> LoraAdapter:
        """The PEFT adapter in folder `path` as this export's slots hold it (lora_adapter.read_adapter:
        LoraConfigError names what they cannot hold)."""
        lora_spec = LoraSpec.of(self.config)
        if lora_spec is None:
            raise ValueError("this export has no LoRA adapter slots: export it again with --max-loras N")
        return read_adapter(path, family_spec(self.hf_config), lora_spec, getattr(torch, self.config.dtype))

    def write_adapter(self, slot: int, adapter: LoraAdapter) -> None:
        """Put `adapter` (lora_adapter.read_adapter) into LoRA slot `slot` of every graph: a write
        of that slot's tensors, never a recompile; rows naming the slot run it from the next call."""
        lora_spec = LoraSpec.of(self.config)
        if lora_spec is None or self.write_slot is None:
            raise ValueError("this export has no adapter slots: export again with --max-loras N")
        if not 0 <= slot < lora_spec.slots:
            raise ValueError(f"slot {slot} is not one of the export's {lora_spec.slots} adapter slots")
        spec, tp = family_spec(self.hf_config), self.config.tp_degree
        self.write_slot(slot, lambda tp_rank: slot_tensors(adapter, spec, lora_spec, tp, tp_rank))

    def prefill(
        self,
        token_ids: torch.Tensor,
        start: int,
        blocks: Sequence[int],
        every_position: bool = False,
        adapter: int = NO_ADAPTER,
    ) -> torch.Tensor:
        """Tokens [T] at positions start.. of the request with KV blocks `blocks` -> logits [V]
        after the last one, or [T, V] after every one if `every_position` (exports with
        prompt_logprobs). Chunked exports take T <= prefill_chunk_size; standard ones a whole
        prompt. `adapter`: the LoRA slot the tokens run under (NO_ADAPTER: the base)."""
        if every_position and not self.config.prompt_logprobs:
            raise ValueError(
                "this export returns the last position's logits only: re-export with --prompt-logprobs"
            )
        t, end = token_ids.shape[0], start + token_ids.shape[0]
        window = self.config.bucket_for(end)
        limit = self.config.prefill_chunk_size or window
        if t == 0 or t > limit:
            raise ValueError(
                f"a {'cp' if self.config.chunked else 'ce'} call takes 1 to {limit} tokens, got {t}"
            )
        width = self.config.width_for(t) if self.config.chunked else window
        spec = cp_spec(self.config, width, window) if self.config.chunked else ce_spec(window)
        (logits,), unsort = self._call(spec, [token_ids], [start], [blocks], adapters=[adapter])
        self.last_chunk = CalledRows(spec, [token_ids], [start], [blocks], [adapter], unsort, self.calls)
        if every_position:
            return logits[0, :t].clone()
        return (logits[0, t - 1] if self.config.prompt_logprobs else logits[0]).clone()

    def decode(
        self,
        token_ids: torch.Tensor,  # [N]
        positions: torch.Tensor,  # [N]
        blocks: Sequence[Sequence[int]],  # each row's KV blocks in position order
        sampling: tuple[torch.Tensor, torch.Tensor] | None = None,  # ([N, 3] params, [N] rand)
        need_logits: bool = True,
        adapters: Sequence[int] | None = None,  # each row's LoRA slot (None: the base)
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One TG step for N <= batch_size rows, in the narrowest TG graph that holds them ->
        (tokens [N] sampled on the device, or None where the export samples on the host;
        logits [N, V], or None unless `need_logits` or sampled on the host). On-device sampling
        takes `sampling` (modeling.sampler.sampling_params rows and uniform draws)."""
        n = len(self._decode_writes(positions, blocks))
        window = self.config.bucket_for(int(positions.max()) + 1)
        spec = tg_spec(self.config, self.config.decode_width_for(n), window)
        outputs, unsort = self._call(
            spec, list(token_ids[:, None]), positions.tolist(), blocks, sampling, adapters=adapters
        )
        return self._decode_outputs(outputs, unsort, need_logits)

    def decode_with_chunk(
        self,
        token_ids: torch.Tensor,  # [N]
        positions: torch.Tensor,  # [N]
        blocks: Sequence[Sequence[int]],
        sampling: tuple[torch.Tensor, torch.Tensor] | None,
        chunk_ids: torch.Tensor,  # [C]: a full chunk
        chunk_start: int,
        chunk_blocks: Sequence[int],
        need_logits: bool = True,
        adapters: Sequence[int] | None = None,  # each decode row's LoRA slot
        chunk_adapter: int = NO_ADAPTER,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        """A decode step and a full prefill chunk of another request in one MX call (mixed_step
        exports) -> (tokens, decode logits as `decode` returns them, the chunk's last logits [V])."""
        decode_writes = self._decode_writes(positions, blocks)
        c = self.config.prefill_chunk_size
        end = chunk_start + c
        chunk_writes = set(list(chunk_blocks)[self.pool.column(chunk_start) : self.pool.column(end - 1) + 1])
        if not self.config.mixed_step or chunk_ids.shape[0] != c or chunk_writes & decode_writes:
            raise ValueError(
                f"a mixed step takes decode rows and a full chunk of {c} tokens writing other blocks "
                f"(mixed_step exports): got {chunk_ids.shape[0]} tokens in blocks {list(chunk_blocks)}, "
                f"decoding rows with blocks {[list(b) for b in blocks]}, mixed_step={self.config.mixed_step}"
            )
        spec = mx_spec(self.config, self.config.bucket_for(max(int(positions.max()) + 1, end)))
        chunk = ([chunk_ids], [chunk_start], [chunk_blocks], [chunk_adapter])
        outputs, unsort = self._call(
            spec, list(token_ids[:, None]), positions.tolist(), blocks, sampling, chunk, adapters
        )
        tokens, logits = self._decode_outputs(outputs[:-1], unsort, need_logits)
        return tokens, logits, outputs[-1].cpu()[0].clone()

    def verify(
        self,
        token_rows: list[torch.Tensor],  # N rows of [1 + d]: a row's last token, then its d <= K drafts
        positions: torch.Tensor,  # [N]: the position of each row's first token
        blocks: Sequence[Sequence[int]],
        need_logits: bool = True,
        adapters: Sequence[int] | None = None,
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
        last = torch.tensor([int(p) + len(r) - 1 for p, r in zip(positions, token_rows, strict=True)])
        n = len(self._decode_writes(last, blocks))
        spec = vf_spec(
            self.config, self.config.decode_width_for(n), self.config.bucket_for(int(last.max()) + 1)
        )
        starts = positions.tolist()
        (argmax, logits), unsort = self._call(spec, token_rows, starts, blocks, adapters=adapters)
        self.last_verify = CalledRows(spec, token_rows, starts, blocks, adapters, unsort, self.calls)
        return argmax.cpu()[unsort].long(), logits.cpu()[unsort] if need_logits else None

    def draft_after_verify(
        self, verified: CalledRows, next_tokens: Sequence[int], accepted: Sequence[int]
    ) -> torch.Tensor:
        """EAGLE3 drafts [N, K] (exports with --speculation-head) for the rows of the VF call
        `verified` (`last_verify`, the latest call), in their order: `next_tokens` [N] follow each
        row's `accepted` [N] drafts (the bonus or correction token)."""
        rows = shifted_rows(verified.token_rows, next_tokens, accepted)
        return self._draft(verified, rows, [int(a) for a in accepted])

    def draft_after_chunk(
        self, tokens: torch.Tensor, next_token: int, start: int, last_index: int | None = None
    ) -> torch.Tensor:
        """EAGLE3 drafts [K] after the latest prefill chunk (`tokens` at `start`, in its blocks):
        `next_token` follows it (the next chunk's first, or the one sampled after the prompt);
        `last_index`: the index drafted from (default the last)."""
        chunk = self.last_chunk
        if chunk is None or chunk.starts != [start] or len(chunk.token_rows[0]) != len(tokens):
            raise ValueError(f"drafts after a chunk of {len(tokens)} at {start} follow its prefill")
        index = len(tokens) - 1 if last_index is None else last_index
        return self._draft(chunk, [shifted(tokens, next_token)], [index])[0]

    def _draft(self, called: CalledRows, rows: list[torch.Tensor], last_index: list[int]) -> torch.Tensor:
        """The DC / DV call after `called`, in the bucket holding every position it writes: its
        rows' positions, then the chain from each row's `last_index` (modeling/eagle3.chain_top)
        -> drafts [N, K] in the caller's order."""
        if not self.config.speculation_head:
            raise ValueError(
                "this export has no EAGLE3 head: re-export with --speculation-head HEAD --speculation-length K"
            )
        if called.call != self.calls:
            raise ValueError(
                f"EAGLE3 drafts follow the CP or VF call they draft from: {self.calls - called.call} "
                "graph calls ran since; draft right after it"
            )
        spec, tops = draft_graph(self.config, called, rows, last_index)
        # A guard: the rows' blocks hold the chain - vLLM's by vllm/limits.check_head_chain at
        # start-up (whole-sequence blocks hold every position), generate()'s by their chain_top.
        self._check_blocks(called.blocks, tops)
        (drafts,), unsort = self._call(
            spec, rows, called.starts, called.blocks, adapters=called.adapters, last_index=last_index
        )
        if not torch.equal(unsort, called.unsort):  # shifted rows keep their call's starts and lengths
            raise RuntimeError(
                "a draft call's rows must sort as its CP or VF call's rows did: the aux states it "
                "reads are in that call's row order"
            )
        return drafts.cpu()[unsort].long()

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
        spec = GraphSpec(GraphKind.COPY, 1, self.config.prefill_chunk_size, 0)
        pieces = prefill_slices(length, spec.width)
        for piece in pieces:  # rows: the source block and the destination, the same positions
            span = torch.arange(piece.start, piece.stop, dtype=INDEX_DTYPE)
            self._call(spec, [span, span], [piece.start] * 2, [[src_block], [dst_block]])
        return len(pieces)

    def _call(
        self,
        spec: GraphSpec,
        token_rows,
        starts,
        blocks,
        sampling=None,
        chunk=None,
        adapters=None,
        last_index=None,
    ) -> tuple:
        """The one path: rows (token ids [T_i] at positions starts[i].., KV blocks) checked
        against the pool, padded by the one rule to graph `spec`'s rows and width, its block
        tables built once at its columns; a mixed step's chunk after them, the sampling inputs
        last where the graph samples -> (the graph's outputs, the permutation back to the
        caller's row order). Decode rows go longest context first, so the padding repeats the
        shortest: where each row reads only its live context (the cpu backend's per_row_live),
        a padded row costs the least it can. LoRA exports: each row's adapter slot (`adapters`,
        None: the base) joins its block table as one more column (lora.row_slots); `last_index`: draft calls'."""
        self.calls += 1
        if spec.kind is GraphKind.COPY:  # no token read, no adapter run (no adapter column): the
            # positions of its source row, each row's one block
            inputs, order = self._row_inputs(
                2, spec.width, self.config.sequence_length, token_rows, starts, blocks
            )
            return (self.graphs[spec.name](inputs[1][:1], row_blocks(inputs[2])),), order
        slots = row_slots(self.config, adapters, len(token_rows))
        inputs, order = self._row_inputs(
            spec.batch, spec.width if chunk is None else 1, spec.window, token_rows, starts, blocks, slots
        )
        if chunk is not None:
            *chunk_rows, chunk_adapters = chunk
            chunk_slots = row_slots(self.config, chunk_adapters, 1)
            inputs += self._row_inputs(1, spec.width, spec.window, *chunk_rows, chunk_slots)[0]
        if samples_on_device(spec, self.config):
            if sampling is None:
                raise ValueError("this export samples on the device: pass sampling=(params, rand)")
            inputs += [pad_repeat_last(x[order].float(), spec.batch, dim=0) for x in sampling]
        if last_index is not None:
            inputs.append(last_index_input(last_index, order, spec.batch))
        outputs = self.graphs[spec.name](*inputs)
        return tuple(outputs) if isinstance(outputs, tuple | list) else (outputs,), torch.argsort(order)

    def _row_inputs(
        self, rows: int, width: int, window: int, token_rows, starts, blocks, slots=None
    ) -> tuple[list, torch.Tensor]:
        """graph_inputs.row_inputs over context bucket `window`, each row's blocks checked first."""
        last = torch.tensor([s + len(t) - 1 for s, t in zip(starts, token_rows, strict=True)])
        blocks = self._check_blocks(blocks, last)
        return row_inputs(rows, width, self.pool.blocks_holding(window), token_rows, starts, blocks, slots)

    def _decode_outputs(self, outputs: tuple, unsort: torch.Tensor, need_logits: bool) -> tuple:
        """(tokens, logits) or (logits,) of a decode graph -> (tokens [N] or None, logits [N, V]
        or None) of the real rows in the caller's order (indexing copies off the graph's buffers)."""
        if self.config.on_device_sampling:
            tokens, logits = outputs
            return tokens.cpu()[unsort], logits.cpu()[unsort] if need_logits else None
        return None, outputs[0].cpu()[unsort]

    def _decode_writes(self, last_positions: torch.Tensor, blocks: Sequence[Sequence[int]]) -> set[int]:
        """Decode rows checked (1 to batch_size, each writing a block of its own) -> the blocks
        they write (the one holding each row's last position)."""
        n, batch = len(blocks), self.config.batch_size
        if not 0 < n <= batch:
            raise ValueError(f"a decode step takes 1 to {batch} rows, got {n}")
        rows = self._check_blocks(blocks, last_positions)
        writes = {row[self.pool.column(int(p))] for p, row in zip(last_positions, rows, strict=True)}
        if len(writes) != n:
            # two rows writing one block: one would overwrite the other's positions
            raise ValueError(
                f"a decode step takes rows writing distinct blocks, got blocks {[list(b) for b in blocks]}"
            )
        return writes

    def _check_blocks(self, blocks: Sequence[Sequence[int]], last_positions: torch.Tensor) -> list[list[int]]:
        """Each row holds pool blocks (0..num_blocks - 1) for every position up to its last
        -> the rows as lists (a row may be given as a tensor, or one block as an int)."""
        size, pool = self.pool.block_size, self.pool.num_blocks
        rows = [torch.as_tensor(row).reshape(-1).tolist() for row in blocks]
        if len(rows) != len(last_positions):
            raise ValueError(f"{len(rows)} rows of blocks for {len(last_positions)} rows of tokens")
        for row, last in zip(rows, last_positions.tolist(), strict=True):
            if self.pool.blocks_holding(int(last) + 1) > len(row) or any(not 0 <= b < pool for b in row):
                raise ValueError(
                    f"blocks {rows} must hold pool blocks 0..{pool - 1} for positions up to "
                    f"{last_positions.tolist()} ({size} positions a block)"
                )
        return rows
