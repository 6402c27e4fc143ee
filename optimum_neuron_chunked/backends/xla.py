"""The neuron backend's graphs on torch-xla's device, without neuronx-cc or the Neuron runtime.

torch-neuronx is built on torch-xla: `ModelBuilder.trace` runs the neuron backend's
`GraphBundle` (graph_bundle.py: the decoder built with `functional_cache=True`) on the XLA device
with the graphs' example input types and hands the HLO to neuronx-cc. This backend runs that same
bundle on the device torch-xla's `PJRT_DEVICE` names (CPU by default), one XLA execution per
graph call, the KV cache kept on the device between calls: a graph that lowers to static HLO
and computes the right tokens here is what the Neuron compiler receives. Only the parallel
layers differ (plain torch layers at tp 1; tests/nxd_source_check.py runs NxD's own).

An export holds the weights alone, as the eager backend's; each graph is traced at its first
call, when its `HloReport` is recorded (`XlaRuntime.hlo`) and a graph that is not one static,
device-only HLO module is refused (`XlaLoweringError`): serving an xla export is a Neuron gate. torch_xla is imported only here,
inside functions: hosts without it still read such exports' configs.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch

from ..config import NeuronConfig
from ..graphs import GraphSpec, example_inputs
from ..modeling.decoder import DecoderModel
from .base import Backend, BackendUnavailableError, LoadedGraphs, OnGraph
from .graph_bundle import GraphBundle

# HLO that neuronx-cc cannot take as a static graph, or that would leave the device per call.
FORBIDDEN_HLO = ("custom-call", "while(", "infeed(", "outfeed(", "send(", "recv(", "host", "callback")
# An instruction: `%name = <type> opcode(`, the type an array `f32[2,64]{1,0}` or a tuple of them.
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%\S+\s+=\s+(.*?)\s+([\w-]+)\(", re.MULTILINE)
CENSUS_OPS = ("sort", "scatter", "gather", "dot", "reduce")


def require_torch_xla() -> ModuleType:
    """torch_xla, or BackendUnavailableError saying how to install it."""
    try:
        import torch_xla
    except (ImportError, OSError) as e:  # OSError: a build for another torch (undefined symbols)
        raise BackendUnavailableError(
            f"the xla backend needs torch-xla built for this torch ({torch.__version__}): {e}. "
            "Install the matching pair, e.g. the Neuron SDK mirror environment: "
            "pip install 'optimum-neuron-chunked[xla]' (torch 2.9.1, torch-xla 2.9.0), or `make install-sdk`."
        ) from e
    return torch_xla


class XlaBackend(Backend):
    name = "xla"
    runs_code_from_export = None  # safetensors weights: graphs are traced from this package's code

    def check_available(self) -> None:
        require_torch_xla()

    def compile(
        self,
        model: DecoderModel,
        config: NeuronConfig,
        specs: list[GraphSpec],
        out_dir: Path,
        on_graph: OnGraph,
    ) -> NeuronConfig:
        return config  # the weights are the export: each graph is traced on the device at its first call

    def load(self, hf_config, config: NeuronConfig, specs: list[GraphSpec], export_dir: Path) -> LoadedGraphs:
        require_torch_xla()
        model = self.torch_model(hf_config, config, export_dir, functional_cache=True)
        runtime = XlaRuntime(model, config, specs)
        return LoadedGraphs(runtime.graphs(), runtime.write_slot if config.has_lora_slots else None)


class XlaRuntime:
    """The neuron backend's bundle on the XLA device. A call checks its inputs against the
    traced signature (shapes, graphs.INDEX_DTYPE integers), runs as one XLA execution
    (`torch_xla.sync()`) and returns host copies; the functional cache writes reassign the
    cache buffers, which stay on the device."""

    def __init__(self, model: DecoderModel, config: NeuronConfig, specs: list[GraphSpec]):
        if not model.functional_cache:
            raise ValueError(
                "the xla backend runs the decoder the neuron backend traces: functional_cache=True"
            )
        torch_xla = require_torch_xla()
        self.device = torch_xla.device()
        self.bundle = GraphBundle(model.to(self.device).eval(), config, specs)
        self.signatures = {
            spec.name: [(tuple(x.shape), x.dtype) for x in example_inputs(spec, config)] for spec in specs
        }
        self.hlo: dict[str, HloReport] = {}  # graph -> what it lowered to, at its first call

    def graphs(self) -> dict[str, Callable]:
        """Graph callables by name, as a backend's `load` returns them."""
        return {name: XlaGraph(self, name) for name in self.signatures}

    def run(self, name: str, *inputs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        import torch_xla

        got = [(tuple(x.shape), x.dtype) for x in inputs]
        if got != self.signatures[name]:
            raise TypeError(f"graph {name} was traced with inputs {self.signatures[name]}, got {got}")
        before = fallback_counts() if name not in self.hlo else {}
        self.bundle.select(name)
        with torch.no_grad():
            outputs = self.bundle(*(x.to(self.device) for x in inputs))
        flat = list(outputs) if isinstance(outputs, tuple) else [outputs]
        first = name not in self.hlo
        if first:
            caches = list(self._caches().values())
            self.hlo[name] = HloReport.of(name, torch_xla._XLAC._get_xla_tensors_hlo(flat + caches))
        torch_xla.sync()
        if first:
            self.hlo[name].raise_if_unfit(fallback_counts(), before)
        host = [t.cpu() for t in flat]
        return tuple(host) if isinstance(outputs, tuple) else host[0]

    def write_slot(self, slot: int, rank_tensors) -> None:
        """base.SlotWriter on the device's parameters, then one execution: the slot rows become
        device data again, so no graph's HLO carries the write."""
        import torch_xla

        slots = self.bundle.model.lora_slots()
        with torch.no_grad():
            for name, tensor in rank_tensors(0).items():
                slots[name][slot].copy_(tensor.to(self.device))
        torch_xla.sync()

    def caches(self) -> dict[str, torch.Tensor]:
        """Host copies of every layer's K/V cache."""
        return {n: t.cpu() for n, t in self._caches().items()}

    def _caches(self) -> dict[str, torch.Tensor]:
        model = self.bundle.model
        return {n: getattr(model, n) for n in model.cache_names()}


class XlaGraph:
    """One graph of an `XlaRuntime`, called like the other backends' graphs."""

    def __init__(self, runtime: XlaRuntime, name: str):
        self.runtime, self.name = runtime, name

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        return self.runtime.run(self.name, *inputs)


ELEMENT_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "f32": 4, "s32": 4, "u32": 4,
                 "f64": 8, "s64": 8, "u64": 8}  # fmt: skip


def array_bytes(shape: str) -> int:
    """Bytes of an HLO array type (`f32[2,64]{1,0}`); 0 for a tuple or a token."""
    found = re.match(r"(\w+)\[([\d,]*)\]", shape)
    if found is None or found.group(1) not in ELEMENT_BYTES:
        return 0
    size = ELEMENT_BYTES[found.group(1)]
    for dim in filter(None, found.group(2).split(",")):
        size *= int(dim)
    return size


@dataclass
class HloReport:
    """What one graph lowered to: forbidden constructs, dynamic dims and an op census."""

    graph: str
    forbidden: list[str] = field(default_factory=list)
    dynamic_shapes: list[str] = field(default_factory=list)
    census: Counter = field(default_factory=Counter)
    widest_sort: int = 0  # length of the longest sorted dimension (top-k lowers to sort)
    largest_bytes: int = 0  # the largest array an instruction computes (parameters, tuples aside)

    @classmethod
    def of(cls, graph: str, hlo: str) -> HloReport:
        report = cls(graph)
        report.forbidden = sorted({word for word in FORBIDDEN_HLO if word in hlo})
        for shape, opcode in INSTRUCTION.findall(hlo):
            if "<=" in shape or "?" in shape:
                report.dynamic_shapes.append(f"{opcode} {shape}")
            if opcode in CENSUS_OPS:
                report.census[opcode] += 1
            if opcode == "sort":
                dims = re.search(r"\[([\d,]+)\]", shape).group(1).split(",")
                report.widest_sort = max(report.widest_sort, int(dims[-1]))
            if shape.startswith("s64["):
                report.census["s64 values"] += 1
            if opcode == "parameter" and shape.startswith(("s8[", "f8e4m3fn[")):
                report.census["8-bit params"] += 1  # quantized weights reach the device as stored
            if opcode != "parameter":
                report.largest_bytes = max(report.largest_bytes, array_bytes(shape))
            report.census["instructions"] += 1
        return report

    def raise_if_unfit(self, fallbacks: dict[str, int], before: dict[str, int]) -> None:
        """Refuse a graph neuronx-cc would not take as the static graph it is meant to be: HLO
        with forbidden constructs or dynamic shapes, or aten ops that ran on the host while it
        was traced (`fallbacks` vs `before`: counts of `fallback_counts`)."""
        host = sorted(op for op, n in fallbacks.items() if n > before.get(op, 0))
        problems = [
            f"{what}: {', '.join(found[:5])}"
            for what, found in (
                ("forbidden HLO", self.forbidden),
                ("dynamic shapes", self.dynamic_shapes),
                ("aten ops on the host", host),
            )
            if found
        ]
        if problems:
            raise XlaLoweringError(
                f"graph {self.graph} does not lower to static device HLO: {'; '.join(problems)}"
            )


class XlaLoweringError(RuntimeError):
    """A graph that would not reach neuronx-cc as one static, device-only HLO module."""


def fallback_counts() -> dict[str, int]:
    """aten op -> how often it ran on the host instead of lowering to XLA (process-wide)."""
    import torch_xla.debug.metrics as metrics

    return {n: metrics.counter_value(n) for n in metrics.counter_names() if n.startswith("aten::")}


def fallback_ops() -> list[str]:
    """aten ops that ran on the host instead of lowering to XLA since the last reset (process-wide)."""
    import torch_xla.debug.metrics as metrics

    return sorted(name for name in metrics.counter_names() if name.startswith("aten::"))


def reset_counters() -> None:
    import torch_xla.debug.metrics as metrics

    metrics.clear_counters()
