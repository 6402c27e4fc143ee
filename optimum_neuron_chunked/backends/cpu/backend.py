"""Ahead-of-time compilation on CPU: torch.export + AOTInductor, one package per graph.

Graphs are compiled without their constants. At load time every graph binds the same
tensors - the weights read once from safetensors and the KV cache - as user-managed
constants (no copy), so the graphs share one cache exactly as they do on Neuron.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import warnings
from pathlib import Path

import torch

from ...checkpoint_stream import empty_but_inlined
from ...config import NeuronConfig
from ...graphs import GraphSpec, example_inputs, graph_module
from ...modeling.decoder import DecoderModel
from ...modeling.kv_layout import KVPool
from ..base import (
    GRAPHS_DIR,
    WEIGHTS_NAME,
    Backend,
    BackendUnavailableError,
    LoadedGraphs,
    OnGraph,
    parameter_slot_writer,
)
from .decode_attention import load_op
from .denormals import flushing
from .host import host_cpu_capability
from .kernels import CpuKernels, kernel_choices

INDUCTOR_CONFIGS = {"aot_inductor.package_constants_in_so": False}


def inductor_configs(config: NeuronConfig) -> dict:
    """AOTInductor's options for this export's graphs (kernels.realize_reused_values)."""
    choices = kernel_choices(config.cpu_isa or None)
    return {**INDUCTOR_CONFIGS, **({"realize_reads_threshold": 0} if choices.realize_reused_values else {})}


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
# glibc's upper bound for the mmap threshold on 64-bit hosts (DEFAULT_MMAP_THRESHOLD_MAX)
_HEAP_UP_TO = 32 * 2**20


def keep_freed_heap() -> bool:
    """Keep the buffers a graph call frees in this process's heap, for the next call.

    By default glibc serves large buffers with fresh mmaps, or trims the heap once its free top
    passes twice the (moving) mmap threshold: every graph call then page-faults its
    multi-megabyte buffers back in. With the thresholds fixed, buffers up to 32 MiB come from
    the heap and freed memory stays there (resident: the largest call's buffers); see
    docs/performance.md. Process-wide; False where libc is not glibc.
    """
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, _HEAP_UP_TO)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
    )


# x86 vector ISAs as torch names them, each a superset of the ones before it
_ISA_RANK = {"NO AVX": 0, "DEFAULT": 0, "AVX2": 1, "AVX512": 2}


def check_runs_here(config: NeuronConfig, host_isa: str | None = None) -> None:
    """Refuse graphs compiled for a wider vector ISA than this host's: AOTInductor builds its
    kernels with the compiling host's ISA flags (torch/_inductor/cpu_vec_isa.py, torch 2.13),
    so they would die on an illegal instruction here. Exports without the field pass."""
    host = host_isa or host_cpu_capability()
    built = config.cpu_isa
    if not built or built == host or _ISA_RANK.get(built, 9) <= _ISA_RANK.get(host, -1):
        return
    raise BackendUnavailableError(
        f"this export's graphs were compiled on a host with {built} (neuron_config.json: cpu_isa) "
        f"and this host has {host}: export the model again here (optimum-cli export neuron "
        "--backend cpu ...)"
    )


# AOTInductor in torch 2.9 declares kernels taking float8 tensors (fp8 weights, an fp8 KV pool) with
# at::Float8_e4m3fn in a wrapper that does not include it: a C++ compile error. torch 2.13, the
# version the cpu backend is tested on, compiles them.
FLOAT8_TORCH = (2, 13)


class CpuBackend(Backend):
    name = "cpu"
    runs_code_from_export = (
        "AOTInductor packages (graphs/*.pt2: compiled shared libraries loaded into this process)"
    )

    def check_config(self, config: NeuronConfig) -> None:
        float8 = [
            what
            for what, held in (
                ("fp8 weights (--quantization fp8, or an FP8 checkpoint)", config.quantization == "fp8"),
                ("an fp8 KV pool (--kv-cache-dtype fp8)", config.kv_cache_dtype == "fp8"),
            )
            if held
        ]
        if float8 and torch.__version__ < FLOAT8_TORCH:
            raise BackendUnavailableError(
                f"{' and '.join(float8)} on --backend cpu needs torch >= {'.'.join(map(str, FLOAT8_TORCH))}: "
                f"torch {torch.__version__}'s AOTInductor does not compile graphs holding float8 tensors. "
                "Export with --backend eager (or xla, with torch-xla)."
            )

    def host_fields(self, instance_type: str | None) -> dict[str, str]:
        return {**super().host_fields(instance_type), "cpu_isa": host_cpu_capability()}

    def streamed_model(self, decoder: DecoderModel, out_dir: Path) -> DecoderModel:
        return empty_but_inlined(decoder, out_dir / WEIGHTS_NAME)

    def kernels(self, config: NeuronConfig) -> CpuKernels:
        return CpuKernels(kernel_choices(config.cpu_isa or None), KVPool.of(config))

    def graph_files(self, specs: list[GraphSpec]) -> list[str]:
        return [f"{GRAPHS_DIR}/{spec.name}.pt2" for spec in specs]

    def compile(
        self,
        model: DecoderModel,
        config: NeuronConfig,
        specs: list[GraphSpec],
        out_dir: Path,
        on_graph: OnGraph,
    ) -> NeuronConfig:
        (out_dir / GRAPHS_DIR).mkdir(parents=True, exist_ok=True)
        options = inductor_configs(config)
        for spec, path in zip(specs, self.graph_files(specs), strict=True):
            with on_graph(spec), torch.no_grad(), warnings.catch_warnings():
                # torch's own export / packaging builds the LeafSpec it deprecates (torch 2.13
                # utils/_pytree.py): a FutureWarning per graph that users read as our error.
                warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
                program = torch.export.export(graph_module(model, spec, config), example_inputs(spec, config))
                torch._inductor.aoti_compile_and_package(
                    program, package_path=str(out_dir / path), inductor_configs=options
                )
        return config

    def load(self, hf_config, config: NeuronConfig, specs: list[GraphSpec], export_dir: Path) -> LoadedGraphs:
        check_runs_here(config)
        keep_freed_heap()
        kernels = self.kernels(config)
        if kernels.calls_decode_op:
            load_op()  # its graphs call the op through AOTInductor's proxy executor
        model = self.torch_model(hf_config, config, export_dir)
        constants = model.constants()  # bound without a copy: slot writes reach every graph
        graphs = {}
        for spec, path in zip(specs, self.graph_files(specs), strict=True):
            compiled = torch._inductor.aoti_load_package(str(export_dir / path))
            # Traced through a wrapper module, so constant names carry its "model." prefix.
            names = compiled.get_constant_fqns()
            bound = {name: constants[name.removeprefix("model.")] for name in names}
            compiled.load_constants(bound, check_full_update=True, user_managed=True)
            graphs[spec.name] = flushing(compiled)
        return LoadedGraphs(graphs, parameter_slot_writer(model, config))
