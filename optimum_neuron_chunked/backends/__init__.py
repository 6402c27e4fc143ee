from ..config import BACKENDS
from .base import Backend, BackendUnavailableError, KernelCompileError, describe_attention


def default_backend() -> tuple[str, str]:
    """(backend, why): neuron where the Neuron SDK is importable (compile-only build hosts
    too, as optimum-neuron's exporter), cpu elsewhere - except on a host with SDK 2.32's own
    stack, where a silent cpu export would surprise: that refuses, saying what works there.
    Only checks importability: the SDK itself is imported when the neuron backend compiles."""
    from .neuron.sdk import sdk_232_advice, sdk_232_stack
    from .neuron.target import SDK_MODULES, missing_sdk_modules

    missing = missing_sdk_modules()
    if not missing:
        return "neuron", f"the Neuron SDK is importable: {', '.join(SDK_MODULES)}"
    found = sdk_232_stack()
    if found:
        raise BackendUnavailableError(sdk_232_advice(found))
    return "cpu", f"the Neuron SDK is not importable: {', '.join(missing)} missing"


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
    if name == "xla":
        from .xla import XlaBackend

        return XlaBackend()
    raise ValueError(f"unknown backend {name!r}: choose one of {', '.join(BACKENDS)}")


def export_files(config) -> list[str]:
    """Weight and graph files (relative to the folder) of a complete export of `config`."""
    from ..graphs import graph_specs
    from ..head_checkpoint import HEAD_CONFIG

    impl = get_backend(config.backend)
    head = [HEAD_CONFIG] if config.speculation_head else []  # what vLLM's speculative_config names
    return impl.weight_files(config) + impl.graph_files(graph_specs(config)) + head


__all__ = [
    "BACKENDS",
    "Backend",
    "BackendUnavailableError",
    "KernelCompileError",
    "default_backend",
    "describe_attention",
    "export_files",
    "get_backend",
]
