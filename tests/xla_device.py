"""Run the graph set on torch-xla's CPU device exactly as the neuron backend traces it.

torch-neuronx is built on torch-xla: `ModelBuilder.trace` runs the neuron backend's
`GraphBundle` (a decoder built with `functional_cache=True`) on the XLA device with the
graphs' example input types and hands the resulting HLO to neuronx-cc. Here the same bundle
runs on `PJRT_DEVICE=CPU`, so a graph that lowers to clean, static HLO and matches eager here
is what the Neuron compiler receives. Only the parallel layers differ (plain torch layers at
tp 1; NxD's own layers are checked by tests/nxd_source_check.py against NxD's source).

Needs the `.venv-xla` environment (`make test-xla`): torch-xla 2.9 does not run beside the
torch of vLLM.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass, field

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.debug.metrics as metrics  # noqa: E402

from optimum_neuron_chunked.backends.neuron.backend import GraphBundle  # noqa: E402
from optimum_neuron_chunked.config import NeuronConfig  # noqa: E402
from optimum_neuron_chunked.graphs import graph_specs  # noqa: E402
from optimum_neuron_chunked.modeling.decoder import DecoderModel  # noqa: E402

# HLO that neuronx-cc cannot take as a static graph, or that would leave the device per call.
FORBIDDEN_HLO = ("custom-call", "while(", "infeed(", "outfeed(", "send(", "recv(", "host", "callback")
# An instruction: `%name = <type> opcode(`, the type an array `f32[2,64]{1,0}` or a tuple of them.
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%\S+\s+=\s+(.*?)\s+([\w-]+)\(", re.MULTILINE)
CENSUS_OPS = ("sort", "scatter", "gather", "dot", "reduce")


@dataclass
class HloReport:
    """What one graph lowered to: forbidden constructs, dynamic dims and an op census."""

    graph: str
    forbidden: list[str] = field(default_factory=list)
    dynamic_shapes: list[str] = field(default_factory=list)
    census: Counter = field(default_factory=Counter)
    widest_sort: int = 0  # length of the longest sorted dimension (top-k lowers to sort)

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
            report.census["instructions"] += 1
        return report


class XlaGraphs:
    """Graph callables (as a backend's `load` returns them) running the neuron backend's
    bundle on the XLA device. Every call is one XLA graph execution (`mark_step`); the KV
    cache stays on the device between calls, reassigned by the functional cache writes."""

    def __init__(self, model: DecoderModel, config: NeuronConfig):
        assert model.functional_cache, "the neuron backend traces the functional-cache decoder"
        self.device = torch_xla.device()
        self.bundle = GraphBundle(model.to(self.device).eval(), config, graph_specs(config))
        self.hlo: dict[str, HloReport] = {}

    def callables(self) -> dict[str, callable]:
        return {spec: self._caller(spec) for spec in self.bundle._graphs}

    def _caller(self, name: str):
        def call(*inputs: torch.Tensor):
            return self.run(name, *inputs)

        return call

    def run(self, name: str, *inputs: torch.Tensor):
        self.bundle.select(name)
        with torch.no_grad():
            outputs = self.bundle(*(x.to(self.device) for x in inputs))
        flat = list(outputs) if isinstance(outputs, tuple) else [outputs]
        if name not in self.hlo:
            caches = [getattr(self.bundle.model, n) for n in self.bundle.model.cache_names()]
            self.hlo[name] = HloReport.of(name, torch_xla._XLAC._get_xla_tensors_hlo(flat + caches))
        torch_xla.sync()
        host = [t.cpu() for t in flat]
        return tuple(host) if isinstance(outputs, tuple) else host[0]

    def caches(self) -> dict[str, torch.Tensor]:
        return {n: getattr(self.bundle.model, n).cpu() for n in self.bundle.model.cache_names()}


def fallback_ops() -> list[str]:
    """aten ops that ran on the host instead of lowering to XLA since the last reset."""
    return sorted(name for name in metrics.counter_names() if name.startswith("aten::"))


def reset_counters() -> None:
    metrics.clear_counters()
