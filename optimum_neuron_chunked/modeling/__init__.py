from __future__ import annotations

import torch

from ..config import NeuronConfig
from .decoder import DecoderModel
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
) -> DecoderModel:
    """An empty decoder (zero KV cache, uninitialised weights) shaped by the export config.

    `layers` is the layer factory (parallel.py); plain torch layers by default.
    """
    return model_from_spec(family_spec(hf_config), config, layers, functional_cache, kernels)


def model_from_spec(
    spec: FamilySpec,
    config: NeuronConfig,
    layers=None,
    functional_cache: bool = False,
    kernels: Kernels | None = None,
    device: str = "cpu",
) -> DecoderModel:
    """The one place an export config shapes a decoder: cache rings or blocks, dtype, and how it computes
    (`kernels`: the backend's strategy, Backend.kernels; the reference unless given). `device`
    "meta": the names, shapes and dtypes alone (a streamed export holds no weights it does not
    need)."""
    with torch.device(device):
        return DecoderModel(
            spec,
            KVLayout.of(config, spec),
            layers,
            functional_cache,
            kernels,
            QuantSpec.of(config),
            LoraSpec.of(config),
        )


def torch_dtype(config: NeuronConfig) -> torch.dtype:
    return getattr(torch, config.dtype)


__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "DecoderModel",
    "FamilySpec",
    "KVLayout",
    "Kernels",
    "UnsupportedArchitectureError",
    "build_model",
    "model_from_spec",
    "family_spec",
    "torch_dtype",
]
