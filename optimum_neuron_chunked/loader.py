"""The model a user loads from an export folder."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, GenerationConfig

from .backends import get_backend
from .config import CONFIG_NAME, InvalidExportError, NeuronConfig, NeuronConfigError
from .graph_runner import GraphRunner
from .graphs import graph_specs
from .hub import resolve_export
from .integrity import recorded_files, verify_files
from .modeling.sampler import sampling_params
from .slots import SlotPool
from .version import __version__


class NeuronModelForCausalLM:
    """Compiled graphs + weights + KV cache + slots of one export.

    Low-level calls address KV-cache slots (`seq_id`) explicitly; `generate` acquires and
    releases slots itself.
    """

    def __init__(
        self, model_dir: Path, hf_config, config: NeuronConfig, runner: GraphRunner, generation_config
    ):
        self.model_dir = model_dir
        self.config = hf_config
        self.neuron_config = config
        self.runner = runner
        self.generation_config = generation_config
        self.slots = SlotPool(config.batch_size)

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
        model_dir = resolve_export(model_dir, revision)
        config = check_export(model_dir, backend, verify_weights)
        impl = get_backend(config.backend)
        specs = graph_specs(config)
        hf_config = AutoConfig.from_pretrained(model_dir)
        runner = GraphRunner(config, impl.load(hf_config, config, specs, model_dir))
        try:
            generation_config = GenerationConfig.from_pretrained(model_dir)
        except OSError:
            generation_config = GenerationConfig.from_model_config(hf_config)
        return cls(model_dir, hf_config, config, runner, generation_config)

    # -- graph calls -------------------------------------------------------------------------

    def prefill_chunk(self, input_ids: torch.Tensor, start: int, seq_id: int) -> torch.Tensor:
        """One chunk (1 to prefill_chunk_size tokens) at positions start.. -> logits [V] after it."""
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

    def prefill(self, input_ids: torch.Tensor, seq_id: int) -> torch.Tensor:
        """A whole prompt, chunk by chunk or through CE, whichever the export has -> logits [V]."""
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
        """One token for each of N slots -> (sampled tokens [N], logits [N, V] or None if not
        `need_logits`); greedy by default."""
        n = input_ids.shape[0]
        if params is None:
            params = torch.tensor([sampling_params(temperature=0.0)] * n)
        if rand is None:
            rand = torch.zeros(n)
        return self.runner.decode(input_ids, positions, seq_ids, params, rand, need_logits)

    def generate(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs
    ) -> torch.Tensor:
        """Like transformers' generate: prompt + new tokens, for left-padded batches."""
        from .generation import generate

        return generate(self, input_ids, attention_mask, **kwargs)


def check_export(
    model_dir: str | Path, backend: str | None = None, verify_weights: bool = False
) -> NeuronConfig:
    """The config of a complete, undamaged export of this version (for `backend` if given), or
    InvalidExportError naming what is wrong."""
    model_dir = Path(model_dir)
    config = _load_neuron_config(model_dir)
    if backend is not None and backend != config.backend:
        raise InvalidExportError(
            f"{model_dir} was compiled for the {config.backend!r} backend, not {backend!r}: "
            f"re-export with --backend {backend}."
        )
    impl = get_backend(config.backend)
    graphs, weights = impl.graph_files(graph_specs(config)), impl.weight_files(config)
    _check_complete(model_dir, [CONFIG_NAME, "config.json", *weights, *graphs])
    hashed = set(graphs) | (set(weights) if verify_weights else set())
    verify_files(model_dir, recorded_files(model_dir), hashed)
    return config


def _load_neuron_config(model_dir: Path) -> NeuronConfig:
    if not model_dir.is_dir():
        raise InvalidExportError(
            f"{model_dir} is not a folder: pass the OUT folder of `optimum-cli export neuron`."
        )
    try:
        config = NeuronConfig.load(model_dir)
    except NeuronConfigError as e:
        raise InvalidExportError(str(e)) from e
    if config.package_version != __version__:
        raise InvalidExportError(
            f"{model_dir} was exported by optimum-neuron-chunked {config.package_version}, this is {__version__}: "
            "re-export it with this version."
        )
    return config


def _check_complete(model_dir: Path, files: list[str]) -> None:
    missing = [f for f in files if not (model_dir / f).is_file()]
    if missing:
        raise InvalidExportError(f"{model_dir} is an incomplete export, missing {missing}: export it again.")
