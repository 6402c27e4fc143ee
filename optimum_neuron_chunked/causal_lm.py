"""The model a user loads from an export folder: the transformers-style facade."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import GenerationConfig

from .adapter_slots import SlotTable
from .block_pool import BlockPool
from .config import InvalidExportError
from .graph_runner import GraphRunner
from .hub import is_repo_id, resolve_export
from .lora_adapter import LoraAdapter
from .modeling.lora import NO_ADAPTER, LoraSpec

BASE = "__base__"  # peft's name for the base model in adapter_names (tuners/lora/model.py)

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
        self.adapters: dict[str, LoraAdapter] = {}  # load_adapter's, by name
        lora_spec = LoraSpec.of(runner.config)  # None: no slots (every row the base)
        self._slots = SlotTable(lora_spec.slots if lora_spec is not None else 0)

    def load_adapter(self, path: str | Path, adapter_name: str) -> None:
        """A PEFT LoRA adapter (peft's save_pretrained folder, or its Hub id) under `adapter_name`, for
        `generate(..., adapter_names=[...])`; refused by name where the export's slots cannot hold
        it (lora_adapter.LoraConfigError)."""
        if adapter_name == BASE:
            raise ValueError(f"{BASE!r} names the base model: choose another adapter_name")
        if not Path(path).is_dir() and is_repo_id(
            str(path)
        ):  # a Hub id: its snapshot (offline: the HF cache)
            from huggingface_hub import snapshot_download

            path = snapshot_download(str(path))
        adapter = self.runner.read_adapter(path)
        self._slots.release(adapter_name)  # a reload under the same name: its slot is stale
        self.adapters[adapter_name] = adapter

    def delete_adapter(self, adapter_name: str) -> None:
        self.adapters.pop(adapter_name, None)
        self._slots.drop(adapter_name)

    def adapter_slots(self, adapter_names: list[str] | None, rows: int) -> list[int]:
        """Each row's LoRA slot for `adapter_names` (BASE or None: the base), the adapters written
        into slots they do not hold yet (least recently used first out)."""
        if adapter_names is None:
            return [NO_ADAPTER] * rows
        if len(adapter_names) != rows:
            raise ValueError(
                f"adapter_names has {len(adapter_names)} entries for {rows} prompts: give one per row"
            )
        unknown = sorted({n for n in adapter_names if n != BASE and n not in self.adapters})
        if unknown:
            raise ValueError(f"adapters {unknown} are not loaded: load_adapter(path, adapter_name=...) first")
        wanted = [n for n in adapter_names if n != BASE]
        if len(set(wanted)) > self._slots.slots:
            raise ValueError(
                f"{len(set(wanted))} adapters in one generate call, the export has {self._slots.slots} "
                "slots (--max-loras): split the batch"
            )
        keys = [None if n == BASE else n for n in adapter_names]
        return self._slots.place_rows(
            keys, lambda slot, name: self.runner.write_adapter(slot, self.adapters[name])
        )

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
            from .export.pipeline import check_options
            from .export_cache import cached_export

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
