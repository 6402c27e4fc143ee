"""The model a user loads from an export folder."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import GenerationConfig, PretrainedConfig

from .config import InvalidExportError, NeuronConfig, NeuronConfigError
from .graph_runner import GraphRunner, SlotOrBlocks
from .hub import resolve_export
from .loaded_export import ExportCapabilities, LoadedExport, check_export
from .modeling.sampler import sampling_params
from .slots import BlockPool, SlotPool

__all__ = [
    "ExportCapabilities",
    "InvalidExportError",
    "LoadedExport",
    "NeuronModelForCausalLM",
    "check_export",
    "sampling_params",
]


class NeuronModelForCausalLM:
    """Compiled graphs + weights + KV cache + slots of one export.

    Low-level calls address KV-cache slots (`seq_id`) explicitly, or for paged exports a
    request's block ids (`seq_ids`: block tables [N, M], graph_runner.py); `generate`
    acquires and releases them itself (`acquire_kv`). `sampling_params` builds the rows of
    `decode`'s `params`.
    """

    def __init__(self, export: LoadedExport, generation_config: GenerationConfig):
        self.export = export
        self.generation_config = generation_config
        config = export.config
        self.slots = None if config.paged else SlotPool(config.batch_size)
        self.blocks = BlockPool(config.kv_cache_blocks, config.kv_block_size) if config.paged else None

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        backend: str | None = None,
        revision: str | None = None,
        verify_weights: bool = False,
    ) -> NeuronModelForCausalLM:
        """An export folder, or the repo id of an export on the Hugging Face Hub (at `revision`).

        `verify_weights`: also check the weight files' SHA-256 (sizes and graphs always are)."""
        export = LoadedExport.load(resolve_export(model_dir, revision), backend, verify_weights)
        try:
            generation_config = GenerationConfig.from_pretrained(export.model_dir)
        except OSError:
            generation_config = GenerationConfig.from_model_config(export.hf_config)
        return cls(export, generation_config)

    @property
    def model_dir(self) -> Path:
        return self.export.model_dir

    @property
    def config(self) -> PretrainedConfig:
        """The HF config (transformers' name for it)."""
        return self.export.hf_config

    @property
    def neuron_config(self) -> NeuronConfig:
        return self.export.config

    @property
    def runner(self) -> GraphRunner:
        return self.export.runner

    # -- graph calls -------------------------------------------------------------------------

    def prefill_chunk(self, input_ids: torch.Tensor, start: int, seq_id: SlotOrBlocks) -> torch.Tensor:
        """One chunk (1 to prefill_chunk_size tokens) at positions start.. of slot seq_id (or
        block ids for paged exports) -> logits [V] after it."""
        if not self.neuron_config.chunked:
            raise NeuronConfigError("this is a standard export (no CP graph): use context_encode().")
        return self.runner.prefill(input_ids, start, seq_id)

    def context_encode(self, input_ids: torch.Tensor, seq_id: int) -> torch.Tensor:
        """A whole prompt through the CE graph -> logits [V] after its last token."""
        if self.neuron_config.chunked:
            raise NeuronConfigError(
                "this is a chunked export (no CE graph): use prefill_chunk() or prefill()."
            )
        return self.runner.prefill(input_ids, 0, seq_id)

    def prefill_at(self, input_ids: torch.Tensor, start: int, seq_id: SlotOrBlocks) -> torch.Tensor:
        """Tokens at positions start.. of slot seq_id (or block ids for paged exports) in one call of the export's prefill graph
        (a chunk of at most prefill_chunk_size tokens, or a standard export's prompt) -> logits
        [V] after the last one."""
        return self.runner.prefill(input_ids, start, seq_id)

    def prefill_positions(self, input_ids: torch.Tensor, start: int, seq_id: SlotOrBlocks) -> torch.Tensor:
        """Like `prefill_at`, but the logits after every token: [T, V] (exports with
        --prompt-logprobs)."""
        return self.runner.prefill_positions(input_ids, start, seq_id)

    def prefill(self, input_ids: torch.Tensor, seq_id: SlotOrBlocks) -> torch.Tensor:
        """A whole prompt into slot seq_id (or block ids for paged exports), chunk by chunk or
        through CE, whichever the export has -> logits [V]."""
        n = input_ids.shape[0]
        if not 0 < n <= self.neuron_config.sequence_length:
            raise ValueError(
                f"prompt of {n} tokens: must hold 1 to sequence_length={self.neuron_config.sequence_length} tokens"
            )
        if not self.neuron_config.chunked:
            return self.context_encode(input_ids, seq_id)
        chunk = self.neuron_config.prefill_chunk_size
        for start in range(0, n, chunk):
            logits = self.prefill_chunk(input_ids[start : start + chunk], start, seq_id)
        return logits

    def decode(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        seq_ids: torch.Tensor,
        params: torch.Tensor | None = None,
        rand: torch.Tensor | None = None,
        need_logits: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One token for each of N slots `seq_ids` [N] (paged exports: block tables [N, M], right-
        padded with 0) -> (sampled tokens [N], logits [N, V] or None if not `need_logits`);
        greedy by default."""
        n = input_ids.shape[0]
        if params is None:
            params = torch.tensor([sampling_params(temperature=0.0)] * n)
        if rand is None:
            rand = torch.zeros(n)
        return self.runner.decode(input_ids, positions, seq_ids, params, rand, need_logits)

    def decode_with_chunk(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        seq_ids: torch.Tensor,
        params: torch.Tensor,
        rand: torch.Tensor,
        chunk_ids: torch.Tensor,
        chunk_start: int,
        chunk_seq_id: SlotOrBlocks,
        need_logits: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """A decode step and a full prefill chunk of another slot (or block ids for paged
        exports) in one call (--mixed-step exports) -> (tokens [N], decode logits [N, V] or
        None, the chunk's last logits [V])."""
        return self.runner.decode_with_chunk(
            input_ids, positions, seq_ids, params, rand, chunk_ids, chunk_start, chunk_seq_id, need_logits
        )

    def copy_prefix(self, src_seq_id: int, dst_seq_id: int, length: int) -> int:
        """Copy the K/V of positions [0, length) from one slot to another (chunked slot
        exports; paged ones share blocks) -> the copy-graph calls made."""
        return self.runner.copy_prefix(src_seq_id, dst_seq_id, length)

    # -- KV for requests the host runs itself (generate) --------------------------------------

    def acquire_kv(self, positions: int) -> int | tuple[int, ...]:
        """KV for a request of up to `positions` positions: a free slot, or (paged) free blocks."""
        return self.blocks.acquire(positions) if self.blocks is not None else self.slots.acquire()

    def release_kv(self, kv: int | tuple[int, ...]) -> None:
        if self.blocks is not None:
            self.blocks.release(kv)
        else:
            self.slots.release(kv)

    def kv_rows(self, kvs: list) -> torch.Tensor:
        """Requests' KV as decode rows: slots [N], or block tables [N, M] padded with block 0."""
        if self.blocks is None:
            return torch.tensor(kvs)
        width = max(len(blocks) for blocks in kvs)
        return torch.tensor([list(blocks) + [0] * (width - len(blocks)) for blocks in kvs])

    def generate(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs
    ) -> torch.Tensor:
        """Like transformers' generate: prompt + new tokens, for left-padded batches."""
        from .generation import generate

        return generate(self, input_ids, attention_mask, **kwargs)
