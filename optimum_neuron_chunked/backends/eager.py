"""No compilation: the graph modules run as plain torch, for fast tests and debugging."""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import NeuronConfig
from ..graphs import GraphSpec, graph_module
from .base import Backend, LoadedGraphs, OnGraph, parameter_slot_writer


class EagerBackend(Backend):
    name = "eager"
    runs_code_from_export = None  # safetensors weights: the graphs are this package's modules

    def compile(self, model, config, specs, out_dir: Path, on_graph: OnGraph) -> NeuronConfig:
        return config

    def load(self, hf_config, config: NeuronConfig, specs: list[GraphSpec], export_dir: Path) -> LoadedGraphs:
        model = self.torch_model(hf_config, config, export_dir)
        graphs = {spec.name: torch.inference_mode()(graph_module(model, spec, config)) for spec in specs}
        return LoadedGraphs(graphs, parameter_slot_writer(model, config))
