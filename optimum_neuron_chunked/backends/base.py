"""The backend interface: compile a graph set into an export folder, load it back."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import load_file, save_file

from ..checkpoint_stream import WeightFile
from ..config import NeuronConfig
from ..graphs import GraphSpec
from ..head_checkpoint import export_head_spec
from ..modeling import build_model, family_spec
from ..modeling.decoder import DecoderModel
from ..modeling.family import FamilySpec
from ..modeling.kernels import Kernels

GRAPHS_DIR = "graphs"
# The chunk an export made for `vllm serve MODEL` gets by default (Sarathi-Serve's strict-latency
# budget); the neuron backend's per target (its attention kernel's rule).
DEFAULT_CHUNK_SIZE = 256
WEIGHTS_NAME = "model.safetensors"

# Called around each graph's compilation (progress display); must return a context manager.
OnGraph = Callable[[GraphSpec], AbstractContextManager]


# Writes one adapter slot: (slot, rank -> that rank's slot tensors by parameter name) -> None.
# Single-process backends ask for rank 0 (lora_adapter.slot_tensors shards by rank).
SlotWriter = Callable[[int, Callable[[int], dict[str, torch.Tensor]]], None]


class LoadedGraphs(NamedTuple):
    """What `Backend.load` returns: graph callables by name, all bound to the same weights and KV
    cache, and the writer of adapter slots (None for exports without --max-loras)."""

    graphs: dict[str, Callable]
    write_slot: SlotWriter | None = None


def parameter_slot_writer(model: DecoderModel, config: NeuronConfig) -> SlotWriter | None:
    """Slots that are the model's own parameters, bound by every graph (cpu, eager, xla): written
    in place, one slot's row of each, so every graph reads the new adapter at its next call."""
    if not config.has_lora_slots:
        return None
    slots = model.lora_slots()

    def write(slot: int, rank_tensors: Callable[[int], dict[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, tensor in rank_tensors(0).items():
                slots[name][slot].copy_(tensor)

    return write


class BackendUnavailableError(RuntimeError):
    """The backend cannot run on this host; the message says what is missing."""


class KernelCompileError(RuntimeError):
    """The compiler rejected graphs that call an NKI kernel (NeuronConfig.nki_attention): under
    --attention-kernel auto the export compiles them again with the reference attention."""


class Backend(ABC):
    name: str
    # What loading an export of this backend runs beyond this package's own code (compiled
    # programs, archives), or None when its files are data only (weights, configs). An export
    # from the Hub whose backend runs code needs the user's consent (hub.resolve_export).
    runs_code_from_export: str | None = None

    @abstractmethod
    def compile(
        self,
        model: DecoderModel,
        config: NeuronConfig,
        specs: list[GraphSpec],
        out_dir: Path,
        on_graph: OnGraph,
    ) -> NeuronConfig:
        """Compile every graph of `specs` into `out_dir` (weights are stored by the exporter);
        returns the config as compiled (the neuron backend may take graphs off the NKI kernel)."""

    @abstractmethod
    def load(self, hf_config, config: NeuronConfig, specs: list[GraphSpec], export_dir: Path) -> LoadedGraphs:
        """Graph callables by name, all bound to the same weights and KV cache, and the slot writer."""

    def kernels(self, config: NeuronConfig) -> Kernels:
        """How the model computes on this backend: the reference (what XLA lowers), unless the
        backend's compiler does better with its own strategy. The one per-backend choice."""
        return Kernels()

    def attention_kernels(
        self, config: NeuronConfig, family: FamilySpec, specs: list[GraphSpec], head: FamilySpec | None = None
    ) -> tuple[tuple[str, ...], dict[str, str], dict]:
        """(graphs whose prefill chunks run an NKI attention kernel, why the others do not, the
        kernel limits that decided), at export (NeuronConfig.nki_attention, nki_limits): none
        but on the neuron backend. `head`: the EAGLE3 head's layer as a family (Eagle3Spec.family),
        whose DC graphs attend as their CP twins."""
        return (), {}, {}

    def toolchain(self) -> dict[str, str]:
        """Versions of what shapes this backend's compiled graphs (the export cache's key)."""
        import torch

        return {"torch": torch.__version__}

    def default_chunk_size(self, instance_type: str) -> int:
        """--prefill-chunk-size when an export for `vllm serve MODEL` names none."""
        return DEFAULT_CHUNK_SIZE

    def check_available(self) -> None:
        """Raise BackendUnavailableError, saying what is missing, if this host cannot compile."""
        return None

    def check_config(self, config: NeuronConfig) -> None:
        """Raise BackendUnavailableError, saying what to use instead, if this host cannot compile
        an export of `config` (before any work)."""
        return None

    def check_serving_host(self, config: NeuronConfig, dp_size: int = 1) -> None:
        """Raise BackendUnavailableError, saying what is missing, if this host cannot serve
        `dp_size` data-parallel copies of the export side by side. Runs before any copy loads."""
        return None

    def device_env(self, config: NeuronConfig, dp_rank: int = 0, dp_size: int = 1) -> dict[str, str]:
        """Environment variables that give data-parallel rank `dp_rank` of `dp_size` (on this host)
        its own devices; set in the rank's process before the export loads."""
        return {}

    def save_weights(self, model: DecoderModel, config: NeuronConfig, out_dir: Path) -> None:
        """Store the weights of `model` (unsharded, loaded from the checkpoint) into the export."""
        save_file(model.stored_weights(), out_dir / WEIGHTS_NAME)

    def weight_files(self, config: NeuronConfig) -> list[str]:
        return [WEIGHTS_NAME]

    def host_fields(self, instance_type: str | None) -> dict[str, str]:
        """NeuronConfig fields the exporting host decides (the neuron target, the cpu's ISA). An
        instance type given for another backend goes to the config, which refuses it by name."""
        return {"instance_type": instance_type} if instance_type else {}

    def stream_targets(self, config: NeuronConfig) -> tuple[list[WeightFile], bool]:
        """The files a streamed export writes the weights into, and whether they hold a tied
        lm_head too (checkpoint_stream.stream_weights): one unsharded file by default."""
        return [WeightFile(WEIGHTS_NAME, 0)], False

    def streamed_model(self, decoder: DecoderModel, out_dir: Path) -> DecoderModel:
        """The decoder (on the meta device, its weights streamed into `out_dir`) as `compile`
        takes it: backends that compile no weights take it as it is."""
        return decoder

    def graph_files(self, specs: list[GraphSpec]) -> list[str]:
        """Files (relative to the export folder) that a complete export of `specs` holds."""
        return []

    def torch_model(
        self, hf_config, config: NeuronConfig, export_dir: Path, functional_cache: bool = False
    ) -> DecoderModel:
        """The decoder with the export's weights and a zero KV cache, in eval mode (cpu, eager, xla);
        an EAGLE3 head shaped by the export's eagle3_head/config.json."""
        eagle3 = export_head_spec(export_dir, config, family_spec(hf_config))
        model = build_model(
            hf_config, config, functional_cache=functional_cache, kernels=self.kernels(config), eagle3=eagle3
        )
        model.load_weights(load_file(export_dir / WEIGHTS_NAME))
        return model.eval()


def describe_attention(chosen: tuple[str, ...], reasons: dict[str, str], fp8_kv: bool = False) -> str:
    """One line for the export's first lines and the load log."""
    by_reason: dict[str, list[str]] = {}
    for name, reason in reasons.items():
        by_reason.setdefault(reason, []).append(name)
    # the kernel takes K/V in the compute dtype: an fp8 pool is dequantized as it is read (KVCache.read_tables)
    kernel = "nkilib attention_cte" + (" (fp8 KV dequantized before it)" if fp8_kv else "")
    parts = [f"{kernel} in {', '.join(chosen)}"] if chosen else []
    parts += [f"reference in {', '.join(names)} ({reason})" for reason, names in by_reason.items()]
    return "attention: " + "; ".join(parts)
