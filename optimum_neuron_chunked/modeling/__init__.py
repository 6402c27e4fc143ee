from __future__ import annotations

import torch

from ..config import NeuronConfig
from .decoder import DecoderModel
from .eagle3 import Eagle3Spec, aux_rows
from .family import SUPPORTED_ARCHITECTURES, FamilySpec, UnsupportedArchitectureError, family_spec
from .kernels import Kernels
from .kv_layout import KVLayout
from .lora import LoraSpec
from .quantization import QuantSpec


def build_model(
    hf_config,
    config: NeuronConfig,
    layers=None,
    functional_cache: bool = False,
    kernels: Kernels | None = None,
    eagle3: Eagle3Spec | None = None,
) -> DecoderModel:
    """An empty decoder (zero KV cache, uninitialised weights) shaped by the export config.

    `layers` is the layer factory (parallel.py); plain torch layers by default.
    """
    return model_from_spec(family_spec(hf_config), config, layers, functional_cache, kernels, eagle3=eagle3)


def model_from_spec(
    spec: FamilySpec,
    config: NeuronConfig,
    layers=None,
    functional_cache: bool = False,
    kernels: Kernels | None = None,
    device: str = "cpu",
    eagle3: Eagle3Spec | None = None,
) -> DecoderModel:
    """The one place an export config shapes a decoder: cache rings or blocks, dtype, and how it computes
    (`kernels`: the backend's strategy, Backend.kernels; the reference unless given). `device`
    "meta": the names, shapes and dtypes alone (a streamed export holds no weights it does not
    need). `eagle3`: the head of an export with --speculation-head (modeling/eagle3.py)."""
    if bool(config.speculation_head) != (eagle3 is not None):
        raise ValueError(f"speculation_head {config.speculation_head!r} and the head given {eagle3} disagree")
    with torch.device(device):
        return DecoderModel(
            spec,
            KVLayout.of(config, spec),
            layers,
            functional_cache,
            kernels,
            QuantSpec.of(config),
            LoraSpec.of(config),
            eagle3,
            aux_rows(config) if eagle3 is not None else 0,
        )


def torch_dtype(config: NeuronConfig) -> torch.dtype:
    return getattr(torch, config.dtype)


__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "DecoderModel",
    "Eagle3Spec",
    "FamilySpec",
    "KVLayout",
    "Kernels",
    "UnsupportedArchitectureError",
    "build_model",
    "model_from_spec",
    "family_spec",
    "torch_dtype",
]
