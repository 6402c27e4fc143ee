"""Neuron backend (neuronx-distributed). Its imports stay lazy: the package works on CPU
hosts without the Neuron SDK."""

from __future__ import annotations

import importlib.util

from .base import Backend, BackendUnavailableError

SDK_MODULES = ("torch_neuronx", "neuronx_distributed")


def require_neuron_sdk() -> None:
    missing = [m for m in SDK_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise BackendUnavailableError(
            f"the neuron backend needs the Neuron SDK ({', '.join(missing)} not importable). On a "
            "Trainium/Inferentia host: pip install 'optimum-neuron-chunked[neuron]' with the Neuron "
            "pip repository configured; on this host use --backend cpu or eager."
        )


class NeuronBackend(Backend):
    name = "neuron"

    def compile(self, model, config, specs, out_dir, on_graph):
        require_neuron_sdk()
        raise BackendUnavailableError("the neuron backend's compile path is not implemented yet (issue 5).")

    def load(self, model, config, specs, export_dir):
        require_neuron_sdk()
        raise BackendUnavailableError("the neuron backend's load path is not implemented yet (issue 5).")
