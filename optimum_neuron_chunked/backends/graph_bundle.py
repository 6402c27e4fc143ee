"""One module for a whole graph set, as NxD's ModelBuilder traces it: the neuron backend
compiles it, the xla backend runs it on torch-xla's device."""

from __future__ import annotations

import torch
from torch import nn

from ..config import NeuronConfig
from ..graphs import GraphSpec, example_inputs, graph_module
from ..modeling.decoder import DecoderModel

# The most inputs a graph takes: MX with on-device sampling (graphs.example_inputs).
BUNDLE_INPUTS = 8


class GraphBundle(nn.Module):
    """One module for the whole graph set: ModelBuilder traces a module's forward once per
    tag, so the graph to trace is selected before each trace. The graph modules are kept
    out of the module tree: weights are registered once, under `model.`.

    Called with the selected graph's inputs in its own order (graphs.example_inputs), by
    position or as `input0=..., input1=...`. ModelBuilder.trace (NxD 0.18,
    trace/functions.py `_process_example_inputs`) reads forward's signature: no *args or
    **kwargs, defaults only None, every parameter without a default given at each trace. It
    names each example input after the parameter at its position and generate_hlo calls the
    module with them as keywords (`treat_inputs_as_kwargs=True`); NxDModel requires every
    tag to share one signature (trace/nxd_model/nxd_model.py `add`). The graphs' inputs
    differ in number and meaning (copy: positions and blocks first; TG: sampling inputs in
    MX's chunk places), so the parameters are named by position: any other name would be
    wrong for some graph. Positional calls to the loaded NxDModel route by these names too
    (`convert_dict_to_ordered_list`: parameters in order, as traced)."""

    def __init__(self, model: DecoderModel, config: NeuronConfig, specs: list[GraphSpec]):
        super().__init__()
        self.model = model
        self._graphs = {spec.name: graph_module(model, spec, config) for spec in specs}
        self._arity = {spec.name: len(example_inputs(spec, config)) for spec in specs}
        too_many = {name: n for name, n in self._arity.items() if n > BUNDLE_INPUTS}
        if too_many:
            raise ValueError(f"graphs {too_many} take more than the bundle's {BUNDLE_INPUTS} inputs")
        self._selected = specs[0].name

    def select(self, name: str) -> None:
        self._selected = name

    def forward(
        self,
        # without a default: the fewest inputs a graph takes (copy), NxD requires them at every trace
        input0: torch.Tensor,
        input1: torch.Tensor,
        input2: torch.Tensor | None = None,
        input3: torch.Tensor | None = None,
        input4: torch.Tensor | None = None,
        input5: torch.Tensor | None = None,
        input6: torch.Tensor | None = None,
        input7: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        inputs = (input0, input1, input2, input3, input4, input5, input6, input7)
        arity = self._arity[self._selected]
        if any(x is None for x in inputs[:arity]) or any(x is not None for x in inputs[arity:]):
            given = [i for i, x in enumerate(inputs) if x is not None]
            raise TypeError(f"graph {self._selected} takes inputs 0..{arity - 1}, got {given}")
        return self._graphs[self._selected](*inputs[:arity])
