from .base import Backend, BackendUnavailableError


def get_backend(name: str) -> Backend:
    if name == "cpu":
        from .cpu import CpuBackend

        return CpuBackend()
    if name == "eager":
        from .eager import EagerBackend

        return EagerBackend()
    if name == "neuron":
        from .neuron import NeuronBackend

        return NeuronBackend()
    raise ValueError(f"unknown backend {name!r}: choose cpu, eager or neuron")


__all__ = ["Backend", "BackendUnavailableError", "get_backend"]
