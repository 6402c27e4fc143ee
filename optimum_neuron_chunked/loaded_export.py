"""One export folder before any graph loads: whether it is complete and of this version
(check_export), and what it serves, read off its two configs (ExportCapabilities). The graphs
load into a GraphRunner (graph_runner.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PretrainedConfig

from .backends import get_backend
from .config import CONFIG_NAME, InvalidExportError, NeuronConfig, NeuronConfigError
from .graphs import graph_specs
from .integrity import recorded_files, verify_files
from .modeling import family_spec, torch_dtype
from .modeling.kv_cache import cache_lengths
from .version import __version__


@dataclass(frozen=True)
class KVLayout:
    """The KV pool (modeling/kv_cache.py): `num_blocks` blocks of `block_size` positions, a
    layer's block that or its ring where shorter, with the checkpoint's KV heads (tensor
    parallelism may replicate them on the device). By default a block is a whole sequence,
    one per batch row."""

    num_kv_heads: int  # per layer
    head_dim: int
    dtype: torch.dtype
    cache_lengths: tuple[int, ...]  # per layer: the positions a sequence keeps (modeling/kv_cache.py)
    block_size: int
    num_blocks: int

    @property
    def one_block_per_row(self) -> bool:
        return self.block_size >= max(self.cache_lengths)

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block, every layer."""
        positions = sum(min(self.block_size, n) for n in self.cache_lengths)
        return 2 * positions * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def num_layers(self) -> int:
        return len(self.cache_lengths)


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
        spec = family_spec(hf_config)
        # the decoder's own rule (DecoderModel.cache_lengths), so the two cannot disagree
        lengths = cache_lengths(spec.sliding_windows, config.sequence_length, config.ring_width)
        kv = KVLayout(
            spec.num_kv_heads,
            spec.head_dim,
            torch_dtype(config),
            lengths,
            config.kv_block_positions,
            config.kv_pool_blocks,
        )
        return cls(
            config.sequence_length, kv, config.prompt_logprobs, config.on_device_sampling, config.max_topk
        )

    @property
    def ring_layers(self) -> tuple[int, ...]:
        """Layers whose cache is a ring of the last positions (sliding-window layers of chunked
        exports of whole-sequence blocks): there, a finished request's block no longer holds its
        whole prompt."""
        return tuple(i for i, n in enumerate(self.kv.cache_lengths) if n < self.sequence_length)


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
            f"export it again, from its source model M: {config.export_command(model_dir)}"
        )
    return config


def _check_complete(model_dir: Path, files: list[str]) -> None:
    missing = [f for f in files if not (model_dir / f).is_file()]
    if missing:
        raise InvalidExportError(f"{model_dir} is an incomplete export, missing {missing}: export it again.")
