"""One export folder before any graph loads: whether it is complete and of this version
(check_export), and what it serves, read off its two configs (ExportCapabilities). The graphs
load into a GraphRunner (graph_runner.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import PretrainedConfig

from .backends import get_backend
from .config import CONFIG_NAME, InvalidExportError, NeuronConfig, NeuronConfigError
from .graphs import graph_specs
from .head_checkpoint import HEAD_CONFIG
from .integrity import recorded_files, verify_files
from .modeling import family_spec
from .modeling.kv_layout import KVLayout
from .version import __version__


@dataclass(frozen=True)
class ExportCapabilities:
    """What an export serves beyond its compiled shapes. Read off its NeuronConfig and HF config
    alone: vLLM's platform decides with it at start-up, before any worker loads the graphs."""

    sequence_length: int
    kv: KVLayout
    prompt_logprobs: bool  # prefill graphs return every position's logits (prompt logprobs)
    on_device_sampling: bool  # TG graphs sample: greedy, temperature, top-k <= max_topk, top-p
    max_topk: int

    @classmethod
    def of(cls, config: NeuronConfig, hf_config: PretrainedConfig) -> ExportCapabilities:
        kv = KVLayout.of(config, family_spec(hf_config))  # the decoder's own layout
        return cls(
            config.sequence_length, kv, config.prompt_logprobs, config.on_device_sampling, config.max_topk
        )


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
    head = [HEAD_CONFIG] if config.speculation_head else []  # an EAGLE3 head's shapes
    _check_complete(model_dir, [CONFIG_NAME, "config.json", *weights, *graphs, *head])
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
            f"export it again, from its source model M: {config.export_command(model_dir)}"
        )
    return config


def _check_complete(model_dir: Path, files: list[str]) -> None:
    missing = [f for f in files if not (model_dir / f).is_file()]
    if missing:
        raise InvalidExportError(f"{model_dir} is an incomplete export, missing {missing}: export it again.")
