"""Chunked prefill for LLM serving on AWS Neuron (and on CPU through AOTInductor)."""

from .config import NeuronConfig, NeuronConfigError
from .version import __version__


def __getattr__(name: str):
    # Lazy: importing the package (e.g. by vLLM's plugin discovery) must not pull in transformers.
    if name in ("NeuronModelForCausalLM", "InvalidExportError"):
        from . import causal_lm

        return getattr(causal_lm, name)
    raise AttributeError(name)


__all__ = ["InvalidExportError", "NeuronConfig", "NeuronConfigError", "NeuronModelForCausalLM", "__version__"]
