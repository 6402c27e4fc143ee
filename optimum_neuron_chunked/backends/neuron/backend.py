"""Compile the graph set into one NxD bundle; load it onto NeuronCores.

Export folder:
  graphs/nxd_model.pt                          every graph (one tag each), shared weights, the
                                               KV cache as aliased device state
  weights/tp{r}_sharded_checkpoint.safetensors rank r's weights (modeling/parallel.py sharding)
"""

from __future__ import annotations

import functools
import logging
import os
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ...checkpoint_stream import WeightFile
from ...config import NeuronConfig
from ...graphs import GraphKind, GraphSpec, example_inputs, graph_specs, samples_on_device
from ...lora_adapter import empty_slots
from ...modeling import model_from_spec
from ...modeling.decoder import DecoderModel
from ...modeling.family import FamilySpec, family_spec
from ...modeling.kernels import Kernels
from ...modeling.lora import LoraSpec
from ...modeling.parallel import ShardLayout, rank_shard, tp_checkpoint
from ..base import GRAPHS_DIR, Backend, KernelCompileError, LoadedGraphs, OnGraph
from ..graph_bundle import BUNDLE_INPUTS as BUNDLE_INPUTS  # tests import it from here
from ..graph_bundle import GraphBundle
from .attention_choice import choose_nki_graphs, installed_limits
from .kernel_probe import KernelProbe, kernel_specs
from .nki_kernels import NkiKernels
from .sdk import installed_compiler_version
from .target import (
    TARGETS,
    VISIBLE_CORES,
    compiler_args,
    host_core_count,
    require_neuron_device,
    require_neuron_sdk,
    resolve_instance_type,
    visible_cores_env,
)

logger = logging.getLogger(__name__)

BUNDLE = f"{GRAPHS_DIR}/nxd_model.pt"
PREFIX = "model."  # the bundle holds the decoder as its `model` submodule


class NeuronBackend(Backend):
    name = "neuron"
    # torch.jit.load of a TorchScript archive is trusted input (PyTorch's own security note).
    runs_code_from_export = f"an NxD bundle ({BUNDLE}: a TorchScript archive and compiled Neuron programs)"

    def check_available(self) -> None:
        require_neuron_sdk()

    def toolchain(self) -> dict[str, str]:
        """The SDK packages that compile the bundle and the attention kernel's file."""
        import importlib.metadata

        versions = super().toolchain()
        for name in ("torch-neuronx", "neuronx-cc", "neuronx-distributed"):
            try:
                versions[name] = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                versions[name] = "absent"
        return versions | {"nkilib": installed_limits().source}

    def kernels(self, config: NeuronConfig) -> Kernels:
        """nkilib's attention_cte for the prefill chunks of the graphs the export chose."""
        if not config.nki_attention:
            return Kernels()
        shapes = frozenset(kernel_shapes(config).values())
        return NkiKernels(shapes, grid=TARGETS[config.instance_type].logical_nc_config)

    def attention_kernels(
        self, config: NeuronConfig, family: FamilySpec, specs: list[GraphSpec], head: FamilySpec | None = None
    ):
        chosen, reasons, limits = choose_nki_graphs(config, family, specs, head)
        return chosen, reasons, limits.to_dict() if limits else {}

    def check_serving_host(self, config: NeuronConfig, dp_size: int = 1) -> None:
        self.device_env(config, dp_size - 1, dp_size)  # the last rank's cores fit: every rank's do

    def device_env(self, config: NeuronConfig, dp_rank: int = 0, dp_size: int = 1) -> dict[str, str]:
        """NEURON_RT_VISIBLE_CORES of the rank: tp_degree cores of its own, taken from the user's
        NEURON_RT_VISIBLE_CORES if set, else from the host's. The Neuron runtime reads it when it
        starts (at load), so each rank's process sets it before loading."""
        require_neuron_sdk()
        require_neuron_device()
        available = host_core_count(TARGETS[config.instance_type])
        current = os.environ.get(VISIBLE_CORES)
        return {VISIBLE_CORES: visible_cores_env(config.tp_degree, current, available, dp_rank, dp_size)}

    def graph_files(self, specs: list[GraphSpec]) -> list[str]:
        return [BUNDLE]

    def weight_files(self, config: NeuronConfig) -> list[str]:
        return [f"weights/tp{rank}_sharded_checkpoint.safetensors" for rank in range(config.tp_degree)]

    def host_fields(self, instance_type: str | None) -> dict[str, str]:
        return {"instance_type": resolve_instance_type(instance_type)}

    def stream_targets(self, config: NeuronConfig) -> tuple[list[WeightFile], bool]:
        """Rank r's shard in its own file, with NxD's "model." prefix and an untied lm_head (as
        save_weights writes them)."""
        return [WeightFile(path, rank, PREFIX) for rank, path in enumerate(self.weight_files(config))], True

    def save_weights(self, model: DecoderModel, config: NeuronConfig, out_dir: Path) -> None:
        layout = ShardLayout.of(model.spec, config.tp_degree)
        tp_state = tp_checkpoint(model.unsharded_weights(), layout)
        (out_dir / "weights").mkdir(exist_ok=True)
        for rank, path in enumerate(self.weight_files(config)):
            shard = rank_shard(tp_state, config.tp_degree, rank)
            save_file({PREFIX + k: v for k, v in unshared(shard).items()}, out_dir / path)

    def compile(
        self,
        model: DecoderModel,
        config: NeuronConfig,
        specs: list[GraphSpec],
        out_dir: Path,
        on_graph: OnGraph,
    ) -> NeuronConfig:
        """Under --attention-kernel auto, the kernel is first compiled alone at each chosen shape
        (kernel_probe.py): a shape the compiler refuses costs its graphs the kernel, not the
        export a second compile. Returns the config as compiled."""
        require_neuron_sdk()
        from neuronx_distributed import NxDParallelState

        from .layers import NxdLayers

        target = TARGETS[config.instance_type]
        # Lets parallel_state pick the hardware of the target on a host without a device.
        os.environ.setdefault("NEURON_PLATFORM_TARGET_OVERRIDE", target.compiler_target)
        tp = config.tp_degree
        with NxDParallelState(
            world_size=tp, tensor_model_parallel_size=tp, lnc_size=target.logical_nc_config
        ):
            if config.attention_kernel == "auto" and config.nki_attention:
                head = model.eagle3.family() if model.eagle3 is not None else None
                config = self._without_refused_shapes(model.spec, config, target, head)
            sharded = model_from_spec(
                model.spec,
                config,
                NxdLayers(tp),
                functional_cache=True,
                kernels=self.kernels(config),
                eagle3=model.eagle3,
            )
            # rank 0's shard as save_weights wrote it: `model` may hold no weights (a streamed
            # export builds it on the meta device), and the shard is 1/tp of the model
            sharded.load_weights(
                written_shard(out_dir / self.weight_files(config)[0], sharded.weight_names())
            )
            bundle = GraphBundle(sharded.eval(), config, specs)
            try:
                nxd_model = _trace_and_compile(bundle, config, specs, target, on_graph)
            except Exception as e:  # tracing the kernel or neuronx-cc: failures of many types
                if not config.nki_attention:
                    raise
                said = f"in {', '.join(config.nki_attention)}: {type(e).__name__}: {str(e)[:500]}"
                raise KernelCompileError(said) from e
        (out_dir / GRAPHS_DIR).mkdir(parents=True, exist_ok=True)
        nxd_model.save(str(out_dir / BUNDLE))
        return config

    def _without_refused_shapes(
        self, family: FamilySpec, config: NeuronConfig, target, head: FamilySpec | None = None
    ) -> NeuronConfig:
        """`config` less the kernel graphs whose (chunk, window) shape the compiler refuses, for
        the target's attention or the EAGLE3 head's (`head`: DC graphs share the chunks' shapes)."""
        shapes = kernel_shapes(config)
        kernels = self.kernels(config)
        refused = {}
        for shape in sorted(set(shapes.values())):
            for attention in kernel_specs(config, family, head):
                probe = KernelProbe(kernels, attention, *shape, dtype=getattr(torch, config.dtype))
                try:
                    _compile_probe(probe, target)
                except Exception as e:  # tracing the kernel or neuronx-cc: failures of many types
                    refused[shape] = f"{type(e).__name__}: {str(e)[:300]}"
                    break
        dropped = [name for name, shape in shapes.items() if shape in refused]
        for shape, reason in refused.items():
            names = ", ".join(n for n in dropped if shapes[n] == shape)
            logger.warning(
                "the compiler refused the NKI attention kernel for %d-token chunks over %d positions "
                "(%s): %s attend through the reference",
                *shape,
                reason,
                names,
            )
        return replace(config, nki_attention=tuple(n for n in config.nki_attention if n not in dropped))

    def load(self, hf_config, config: NeuronConfig, specs: list[GraphSpec], export_dir: Path) -> LoadedGraphs:
        require_neuron_sdk()
        require_neuron_device()
        from neuronx_distributed.trace.nxd_model.nxd_model import NxDModel

        nxd_model = NxDModel.load(str(export_dir / BUNDLE))
        # set_weights applies the priority graph's weight layout itself; the KV cache is
        # zero-initialised device state shared by every graph. Adapter slots are weights the
        # export does not store: zero until an adapter is written (modeling/lora.py).
        shards = [load_file(export_dir / path) for path in self.weight_files(config)]
        lora_spec, family, dtype = LoraSpec.of(config), family_spec(hf_config), getattr(torch, config.dtype)
        for tp_rank, shard in enumerate(shards if lora_spec else []):
            shard |= {
                PREFIX + k: v
                for k, v in empty_slots(family, lora_spec, dtype, config.tp_degree, tp_rank).items()
            }
        nxd_model.set_weights(shards)
        nxd_model.to_neuron()
        # decode graphs sampling on device and verify graphs: fetch the tokens, leave the
        # logits on the device unless wanted
        lazy = {s.name for s in specs if samples_on_device(s, config) or s.kind is GraphKind.VF}
        graphs = {spec.name: NeuronGraph(nxd_model, spec.name, spec.name in lazy) for spec in specs}
        return LoadedGraphs(
            graphs, functools.partial(write_device_slot, nxd_model, dtype) if lora_spec else None
        )


def write_device_slot(nxd_model, dtype, slot: int, rank_tensors) -> None:
    """base.SlotWriter on the device: each local rank's slot row of each adapter weight, assigned
    in place into NxDModel.weights[rank][name] - the device tensors set_weights loaded - as NxD
    Inference swaps its adapters (modules/lora_serving/lora_model.py `rank_swap`, NxDI 2.29)."""
    for rank in range(nxd_model.local_ranks_size):
        for name, tensor in rank_tensors(rank).items():
            nxd_model.weights[rank][PREFIX + name][slot] = tensor.to(dtype)


def kernel_shapes(config: NeuronConfig) -> dict[str, tuple[int, int]]:
    """(chunk tokens, context bucket) of each graph that runs the kernel: an MX graph's width
    is its chunk's."""
    return {s.name: (s.width, s.window) for s in graph_specs(config) if s.name in config.nki_attention}


def _compile_probe(probe: KernelProbe, target) -> None:
    from neuronx_distributed import ModelBuilder

    builder = ModelBuilder(probe)
    builder.trace(kwargs=probe.example_inputs(), tag="kernel_probe")
    with tempfile.TemporaryDirectory(prefix="nxd-probe-") as workdir:
        builder.compile(
            priority_model_key="kernel_probe",
            compiler_workdir=workdir,
            compiler_args=compiler_args(target, installed_compiler_version()),
        )


def written_shard(path: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """A rank's weights from its file in the export, without NxD's prefix, as `names` lists them."""
    state = load_file(path)
    return {name: state[PREFIX + name] for name in names}


def unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors, each with its own storage: safetensors refuses shared ones, and at
    tp 1 a tied lm_head's shard is the embedding's (NxD's layers are untied: each is stored)."""
    seen, out = set(), {}
    for name, tensor in state.items():
        tensor = tensor.contiguous()
        out[name] = tensor.clone() if tensor.untyped_storage().data_ptr() in seen else tensor
        seen.add(tensor.untyped_storage().data_ptr())
    return out


def priority_graph(specs: list[GraphSpec]) -> str:
    """The widest TG graph (bucket, then rows): decode is the hot path, its weight layout is
    imposed on the rest."""
    return max((s for s in specs if s.kind is GraphKind.TG), key=lambda s: (s.window, s.batch)).name


def _trace_and_compile(bundle, config: NeuronConfig, specs: list[GraphSpec], target, on_graph: OnGraph):
    """Every graph traced by NxD's ModelBuilder (one tag each), then compiled into one bundle."""
    from neuronx_distributed import ModelBuilder

    builder = ModelBuilder(bundle)
    for spec in specs:
        with on_graph(spec):
            bundle.select(spec.name)
            builder.trace(args=example_inputs(spec, config), tag=spec.name)
    with tempfile.TemporaryDirectory(prefix="nxd-compile-") as workdir:
        return builder.compile(
            priority_model_key=priority_graph(specs),
            compiler_workdir=workdir,
            compiler_args=compiler_args(target, installed_compiler_version()),
        )


class NeuronGraph:
    """One graph of a loaded bundle, called like the cpu and eager graphs.

    `lazy_outputs`: run in NxD's "async" forward mode, whose outputs are references to
    device buffers that `.cpu()` copies to the host (NxDModel.forward, neuronx_distributed/
    trace/nxd_model/nxd_model.py, NxD 0.18): a TG step sampled on device fetches its tokens
    and leaves the [B, V] logits on the device. That mode takes and returns inputs and outputs
    per rank; every rank gets the same inputs and rank 0's outputs are returned."""

    def __init__(self, nxd_model, name: str, lazy_outputs: bool = False):
        self.nxd_model, self.name, self.lazy_outputs = nxd_model, name, lazy_outputs

    def __call__(self, *inputs: torch.Tensor):
        # GraphRunner already types inputs as traced (graphs.INDEX_DTYPE for integers).
        if not self.lazy_outputs:
            return self.nxd_model.forward(*inputs, model_name=self.name)
        ranks = self.nxd_model.local_ranks_size
        outputs = self.nxd_model.forward(
            *[[x] * ranks for x in inputs], model_name=self.name, forward_mode="async"
        )
        return tuple(per_rank[0] for per_rank in outputs)
