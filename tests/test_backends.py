"""The backend registry: every backend a config accepts loads by name without its runtime's
packages, and a backend whose packages are missing says how to install them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from optimum_neuron_chunked.backends import BackendUnavailableError, get_backend
from optimum_neuron_chunked.config import BACKENDS


def test_every_backend_loads_by_name_without_torch_xla():
    code = (
        "import sys\n"
        "from optimum_neuron_chunked.backends import get_backend\n"
        "from optimum_neuron_chunked.config import BACKENDS\n"
        "assert [get_backend(b).name for b in BACKENDS] == list(BACKENDS)\n"
        "print(sorted(m for m in sys.modules if m.startswith('torch_xla')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_unknown_backend_names_the_choices():
    with pytest.raises(ValueError, match=", ".join(BACKENDS)):
        get_backend("tpu")


def test_xla_backend_without_torch_xla_names_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_xla", None)  # import torch_xla raises ImportError
    with pytest.raises(BackendUnavailableError, match=r"torch-xla built for this torch .*\[xla\]"):
        get_backend("xla").check_available()


def test_only_the_cpu_backend_computes_other_than_the_reference():
    """eager, xla and neuron build the model with the reference kernels (what XLA lowers and the
    Neuron gate checks); the cpu backend's strategy is its own, and off the neuron path."""
    from optimum_neuron_chunked.backends.cpu.kernels import CpuKernels
    from optimum_neuron_chunked.config import NeuronConfig
    from optimum_neuron_chunked.modeling.kernels import Kernels

    config = NeuronConfig(batch_size=1, sequence_length=64)
    for name in BACKENDS:
        kernels = get_backend(name).kernels(config)
        assert type(kernels) is (CpuKernels if name == "cpu" else Kernels), name
