"""Manual check for a Neuron developer: our decoder built with neuronx-distributed's own
parallel layers, from NxD's public source, without the closed SDK.

    PJRT_DEVICE=CPU .venv-xla/bin/python tests/nxd_source_check.py PATH_TO_NXD_SOURCE

PATH_TO_NXD_SOURCE is a checkout of aws-neuron/neuronx-distributed (its `src/` folder holds
the package; checked with Release 2.29 = 0.18.0). The closed SDK modules NxD imports at import
time (torch_neuronx, neuronxcc, libneuronxla, nki, nkilib) are stubbed: nothing here
compiles or runs on Neuron. For llama and qwen3 at tp 1 and 2, inside `NxDParallelState` as
the neuron backend builds it, the script checks that
  - the bundle's parameter names and shapes (as NxD's checkpoint loader walks them: every
    tensor once) equal those of every per-rank shard file `NeuronBackend.save_weights` writes;
  - at tp 1, every graph of the bundle, run on torch-xla's CPU device with its int32 example
    inputs, equals the eager graph on the unsharded model.
Not in CI: NxD's source is not on the package registry.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import tempfile
import types
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")
# Compile-host convention (NxD utils/utils.py `hardware`): the target when there is no device.
os.environ.setdefault("NEURON_PLATFORM_TARGET_OVERRIDE", "trn1")

import torch  # noqa: E402
import torch_xla  # noqa: E402, F401  (before the stubs: torch_xla probes libneuronxla at import)

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

CLOSED = ("torch_neuronx", "neuronxcc", "libneuronxla", "nki", "nkilib")
# Names NxD calls at import or while building layers, with what they must return.
STUB_VALUES = {"get_platform_target": lambda: "trn1"}


class _Placeholder(type):
    """A closed class or function: callable, subclassable, and its attributes are more of them
    (NxD names them in annotations and at import; nothing here runs them)."""

    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(name)


def _placeholder(name: str) -> type:
    def call(self, *args, **kwargs):  # an instance used as a decorator returns what it decorates
        return args[0] if len(args) == 1 and callable(args[0]) else _placeholder(name)

    def item(self, key):
        return _placeholder(name)()

    methods = {"__init__": lambda self, *args, **kwargs: None, "__call__": call}
    methods |= {"__getattr__": item, "__getitem__": item, "__iter__": lambda self: iter(())}
    return _Placeholder(name, (), methods)


class _Stub(types.ModuleType):
    """A closed module: every attribute is a placeholder, or a value from STUB_VALUES."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = STUB_VALUES.get(name) or _placeholder(name)
        setattr(self, name, value)
        return value


class _ClosedSdkFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, stubbed: tuple[str, ...]):
        self.stubbed = stubbed

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in self.stubbed:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Stub(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def install_stubs(nxd_source: Path) -> None:
    # imported by NxD's trainer at import (checkpoint storage), not needed here
    unneeded = tuple(m for m in ("boto3", "botocore", "tenacity") if importlib.util.find_spec(m) is None)
    sys.meta_path.insert(0, _ClosedSdkFinder(CLOSED + unneeded))
    # nxd_model.py and spmd.py name torch.classes.neuron.* in annotations at import.
    torch.classes.neuron = _Stub("torch.classes.neuron")
    sys.path.insert(0, str(nxd_source / "src"))


def check_family(family: str, tp: int) -> list[str]:
    from fixtures.export_models import checkpoint_path
    from neuronx_distributed import NxDParallelState
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from optimum_neuron_chunked.backends.neuron.backend import GraphBundle, NeuronBackend
    from optimum_neuron_chunked.backends.neuron.layers import NxdLayers
    from optimum_neuron_chunked.config import NeuronConfig
    from optimum_neuron_chunked.graphs import graph_specs
    from optimum_neuron_chunked.modeling import build_model

    path = checkpoint_path(family)
    hf_config = AutoConfig.from_pretrained(path)
    config = NeuronConfig(
        batch_size=2,
        sequence_length=64,
        prefill_chunk_size=16,
        context_buckets=(32, 64),
        backend="neuron",
        instance_type="trn1",
        tp_degree=tp,
    )
    full = build_model(hf_config, NeuronConfig(batch_size=2, sequence_length=64))
    full.load_weights(full.weights_from_hf(AutoModelForCausalLM.from_pretrained(path)))
    problems = []
    with tempfile.TemporaryDirectory() as out, NxDParallelState(world_size=tp, tensor_model_parallel_size=tp):
        NeuronBackend().save_weights(full, config, Path(out))
        sharded = build_model(hf_config, config, NxdLayers(tp), functional_cache=True)
        bundle = GraphBundle(sharded, config, graph_specs(config))
        aliases = [n for n in bundle.state_dict() if n.endswith("master_weight")]
        # NxD's view: shard_children walks named_parameters() (each Parameter once), and
        # preprocess_checkpoint keeps state_dict() keys, persistent buffers included.
        state = bundle.state_dict(keep_vars=True)
        expected = {n: tuple(t.shape) for n, t in bundle.named_parameters()}
        expected |= {n: tuple(t.shape) for n, t in state.items() if not isinstance(t, torch.nn.Parameter)}
        for rank, file in enumerate(NeuronBackend().weight_files(config)):
            shard = {n: tuple(t.shape) for n, t in load_file(Path(out) / file).items()}
            if shard != expected:
                problems.append(
                    f"{family} tp{tp} rank {rank}: shard {sorted(shard.items() ^ expected.items())}"
                )
        print(
            f"{family} tp{tp}: {len(expected)} weights per rank, {len(aliases)} master_weight aliases skipped"
        )
        if tp == 1 and not problems:
            problems += check_forward(family, full, sharded, config)
    return problems


def check_forward(family, full, sharded, config) -> list[str]:
    """tp 1: the NxD-layer bundle on the XLA device equals the eager graphs, graph by graph."""
    from xla_device import XlaGraphs

    from optimum_neuron_chunked.graphs import example_inputs, graph_module, graph_specs

    sharded.load_weights(sharded.rank_weights(full.unsharded_weights(), 0))
    xla = XlaGraphs(sharded.eval(), config)
    problems = []
    for spec in graph_specs(config):
        inputs = example_inputs(spec, config)
        got = xla.run(spec.name, *inputs)
        with torch.no_grad():
            want = graph_module(full, spec, config)(*inputs)
        for a, b in zip(_tuple(got), _tuple(want), strict=True):
            if not torch.allclose(a.to(b.dtype), b, atol=1e-4, rtol=0):
                problems.append(f"{family} {spec.name}: max diff {(a.to(b.dtype) - b).abs().max()}")
    print(f"{family} tp1: {len(graph_specs(config))} graphs on XLA == eager" if not problems else problems)
    return problems


def _tuple(x):
    return x if isinstance(x, tuple) else (x,)


def main() -> int:
    if len(sys.argv) != 2 or not (Path(sys.argv[1]) / "src" / "neuronx_distributed").is_dir():
        print(__doc__)
        return 2
    install_stubs(Path(sys.argv[1]))
    problems = [p for family in ("llama", "qwen3") for tp in (1, 2) for p in check_family(family, tp)]
    print("\n".join(problems) if problems else "OK: bundle names == shard files; tp 1 forward == eager")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
