"""The model a user loads from an export folder: the transformers-style facade."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import GenerationConfig

from .block_pool import BlockPool
from .config import InvalidExportError
from .graph_runner import GraphRunner
from .hub import resolve_export

__all__ = ["InvalidExportError", "NeuronModelForCausalLM"]


class NeuronModelForCausalLM:
    """One loaded export as transformers users know a model: `from_pretrained`, `generate`,
    `config` (the HF config). Its graphs are called through `runner` (GraphRunner: prefill,
    decode, decode_with_chunk, copy_prefix), which addresses KV blocks explicitly; `generate` acquires and releases them from `kv_pool` itself."""

    def __init__(self, runner: GraphRunner, model_dir: Path, generation_config: GenerationConfig):
        self.runner = runner
        self.model_dir = model_dir
        self.config = runner.hf_config  # transformers' name for the HF config
        self.neuron_config = runner.config
        self.generation_config = generation_config
        self.kv_pool = BlockPool(runner.pool)

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        backend: str | None = None,
        revision: str | None = None,
        verify_weights: bool = False,
        trust_remote_code: bool = False,
        export: bool = False,
        **export_options,
    ) -> NeuronModelForCausalLM:
        """An export folder, or the repo id of an export on the Hugging Face Hub (at `revision`).
        With `export=True`: a plain checkpoint (folder or repo id), exported with
        `export_options` (NeuronConfig's names, `optimum-cli export neuron`'s defaults;
        batch_size and sequence_length required) through the export cache (cache/), so a second
        call with the same options loads what the first built.

        `verify_weights`: also check the weight files' SHA-256 (sizes and graphs always are).
        `trust_remote_code`: consent to load a Hub export whose files run code (cpu, neuron)."""
        if export:
            from .cache import cached_export
            from .export.pipeline import check_options

            options = export_options | ({"backend": backend} if backend else {})
            check_options(options)
            model_dir = cached_export(str(model_dir), options, revision)
        elif export_options:
            raise TypeError(
                f"from_pretrained() got export options {', '.join(sorted(export_options))}: they "
                "export a plain checkpoint, with export=True."
            )
        model_dir = Path(resolve_export(model_dir, revision, trust_remote_code))
        runner = GraphRunner.load(model_dir, backend, verify_weights)
        try:
            generation_config = GenerationConfig.from_pretrained(model_dir)
        except OSError:
            generation_config = GenerationConfig.from_model_config(runner.hf_config)
        return cls(runner, model_dir, generation_config)

    def generate(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs
    ) -> torch.Tensor:
        """Like transformers' generate: prompt + new tokens, for left-padded batches."""
        from .generation import generate

        return generate(self, input_ids, attention_mask, **kwargs)
