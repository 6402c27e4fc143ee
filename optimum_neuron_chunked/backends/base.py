"""The backend interface: compile a graph set into an export folder, load it back."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

from ..config import NeuronConfig
from ..graphs import GraphSpec
from ..modeling.decoder import DecoderModel

GRAPHS_DIR = "graphs"

# Called around each graph's compilation (progress display); must return a context manager.
OnGraph = Callable[[GraphSpec], AbstractContextManager]


class BackendUnavailableError(RuntimeError):
    """The backend cannot run on this host; the message says what is missing."""


class Backend(ABC):
    name: str

    @abstractmethod
    def compile(
        self,
        model: DecoderModel,
        config: NeuronConfig,
        specs: list[GraphSpec],
        out_dir: Path,
        on_graph: OnGraph,
    ) -> None:
        """Compile every graph of `specs` into `out_dir` (weights are stored by the exporter)."""

    @abstractmethod
    def load(
        self, model: DecoderModel, config: NeuronConfig, specs: list[GraphSpec], export_dir: Path
    ) -> dict[str, Callable]:
        """Graph callables by name, all bound to `model`'s weights and KV cache."""

    def graph_files(self, specs: list[GraphSpec]) -> list[str]:
        """Files (relative to the export folder) that a complete export of `specs` holds."""
        return []
