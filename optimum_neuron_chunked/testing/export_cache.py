"""The hash of the code that shapes compiled graphs: part of every cached test or benchmark
export's name, so that a code change re-exports."""

from __future__ import annotations

import hashlib
from pathlib import Path

from ..backends.cpu.host import host_cpu_capability
from ..config import BACKENDS

# The folder holding the package (the repository, in a checkout): sources below are relative to it.
ROOT = Path(__file__).resolve().parents[2]

# Files whose content shapes an export: a change to any of them invalidates the cache.
GRAPH_SOURCES = [
    "optimum_neuron_chunked/config.py",
    "optimum_neuron_chunked/graphs.py",
    "optimum_neuron_chunked/version.py",
    "optimum_neuron_chunked/modeling",
    "optimum_neuron_chunked/backends/__init__.py",
    "optimum_neuron_chunked/backends/base.py",
    "optimum_neuron_chunked/checkpoint_stream.py",
    "optimum_neuron_chunked/safetensors_io.py",
    "optimum_neuron_chunked/export/pipeline.py",
]
# Each backend's own files: editing one backend keeps the other backends' cached exports (an
# xla export holds weights only, a cpu one takes minutes of AOTInductor to rebuild).
BACKEND_SOURCES = {
    "cpu": ["optimum_neuron_chunked/backends/cpu"],
    "eager": ["optimum_neuron_chunked/backends/eager.py"],
    "neuron": ["optimum_neuron_chunked/backends/neuron"],
    "xla": ["optimum_neuron_chunked/backends/xla.py"],
}
assert set(BACKEND_SOURCES) == set(BACKENDS), "every backend names its sources"


def code_key(backend: str | None = None) -> str:
    """Hash of the code that shapes compiled graphs (`backend`'s own files, every backend's if
    None) and of the host's vector ISA, which picks the cpu backend's kernels
    (backends/cpu/kernels.py)."""
    h = hashlib.sha256(host_cpu_capability().encode())
    backends = [backend] if backend else list(BACKEND_SOURCES)
    for source in GRAPH_SOURCES + [s for b in backends for s in BACKEND_SOURCES[b]]:
        for path in sorted((ROOT / source).rglob("*.py")) if (ROOT / source).is_dir() else [ROOT / source]:
            h.update(path.read_bytes())
    return h.hexdigest()[:12]
