"""Export pipeline: HF causal LM -> weights + compiled graph set in one folder.

The export is built in a hidden staging folder beside OUT and moved into place only when
complete, so a failed export never leaves a folder that looks like one.
"""

from __future__ import annotations

import copy
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import MISSING, replace
from difflib import get_close_matches
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from optimum_neuron_chunked.backends import (
    Backend,
    KernelCompileError,
    default_backend,
    describe_attention,
    export_files,
    get_backend,
)
from optimum_neuron_chunked.checkpoint_stream import (
    StreamUnsupportedError,
    checkpoint_folder,
    stream_weights,
)
from optimum_neuron_chunked.config import BACKENDS, EXPORT_OPTIONS, NeuronConfig
from optimum_neuron_chunked.graphs import graph_specs
from optimum_neuron_chunked.head_checkpoint import (
    fitting_spec,
    head_fields,
    head_weights,
    load_head,
    save_head,
)
from optimum_neuron_chunked.integrity import record_files
from optimum_neuron_chunked.modeling import (
    DecoderModel,
    build_model,
    family_spec,
    model_from_spec,
    torch_dtype,
)
from optimum_neuron_chunked.modeling.kv_layout import KVLayout
from optimum_neuron_chunked.modeling.lora import LoraSpec
from optimum_neuron_chunked.modeling.parallel import ShardLayout, check_block_shards
from optimum_neuron_chunked.quantized_checkpoint import (
    checkpoint_kv_scales,
    dropped_notes,
    export_quantization,
    kept_modules,
    source_quantization,
)
from optimum_neuron_chunked.safetensors_io import CheckpointFiles

from .errors import ExportError
from .model_card import write_model_card
from .tokenizer import check_loads, copy_tokenizer

if TYPE_CHECKING:
    from transformers import PretrainedConfig

WEIGHT_PATHS = ("stream", "transformers")
GIB = 2**30


def export(
    model: str,
    output: str | Path,
    *,
    overwrite: bool = False,
    console: Console | None = None,
    weights: str = "stream",
    **options,
) -> Path:
    """Export `model` (local folder or hub id) into `output`; returns the output path.

    `options`: NeuronConfig's export options (config.EXPORT_OPTIONS, the flags of `optimum-cli
    export neuron`), batch_size and sequence_length required. `backend` None (the default):
    neuron where the Neuron SDK is importable, cpu elsewhere (said on the console);
    `instance_type` None: this host's.
    `weights` "stream": tensor by tensor from the checkpoint's safetensors (checkpoint_stream);
    "transformers": through the whole transformers model (the reference the streamed exports are
    tested against, and the path for checkpoints without safetensors)."""
    check_options(options)
    if weights not in WEIGHT_PATHS:
        raise ExportError(f"weights={weights!r}: choose one of {', '.join(WEIGHT_PATHS)}.")
    console = console or Console(stderr=True)
    backend, instance_type = options.pop("backend", None), options.pop("instance_type", None)
    if backend is None:
        backend, why = default_backend()
        console.print(f"backend: {backend} ({why}); choose with --backend {'|'.join(BACKENDS)}")
    output = Path(output).resolve()
    _check_output(output, overwrite)
    impl = get_backend(backend)
    impl.check_available()
    hf_config = load_hf_config(model)
    head = load_head(options["speculation_head"]) if options.get("speculation_head") else None
    config = _checked_config(model, hf_config, impl, options, backend, instance_type, weights, console, head)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.partial-", dir=output.parent))
    try:
        started = time.perf_counter()
        config, specs = _build(model, hf_config, config, impl, staging, weights, console, head)
        if output.exists():
            shutil.rmtree(output)
        staging.rename(output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    console.print(
        f"[green]exported[/] {len(specs)} graphs ({', '.join(s.name for s in specs)}) to {output} "
        f"in {time.perf_counter() - started:.1f}s"
    )
    return output


def _checked_config(
    model, hf_config, impl, options: dict, backend: str, instance_type, weights: str, console, head=None
) -> NeuronConfig:
    """The export's NeuronConfig: the checkpoint's quantization, KV scales
    and shapes checked against the options before any work, with what the export drops and
    its KV pool said."""
    family = family_spec(hf_config)
    source = source_quantization(hf_config)  # refuses a checkpoint it cannot serve, before any work
    config = NeuronConfig(
        **options
        | _quantization_fields(model, source, family, options, weights)
        | _kv_scales(model, hf_config, options)
        | (head_fields(head, checkpoint_folder(model) if weights == "stream" else None) if head else {}),
        backend=backend,
        **impl.host_fields(instance_type),
        model_type=family.model_type,
    )
    _check_shapes(hf_config, config)
    impl.check_config(config)
    # refuses a head that does not fit, before any work: its config, then its tensors (fc, d2t)
    eagle3 = fitting_spec(head.config, config, family) if head is not None else None
    if head is not None:
        head_weights(head, eagle3)
    for note in dropped_notes(source, config.dtype, config.kv_cache_dtype):
        console.print(f"[yellow]warning[/]: {note}")
    ShardLayout.of(family, config.tp_degree)  # refuses a tp degree the heads cannot split by
    if config.quantization_block:
        check_block_shards(family, config.quantization_block, config.tp_degree)
    config = _choose_attention(impl, config, family, console, eagle3)
    console.print(KVLayout.of(config, family).summary(config.tp_degree))
    if config.has_lora_slots:
        console.print(LoraSpec.of(config).summary(family))  # refuses targets no layer has
    return config


def _build(model, hf_config, config: NeuronConfig, impl, staging: Path, weights: str, console, head=None):
    """Every export file into `staging`: tokenizer and HF files, weights, graphs, the config
    with the files' digests, the model card -> (the config as compiled, the graph specs)."""
    _save_hf_files(model, hf_config, staging)  # a source without a usable tokenizer stops here
    if head is not None:
        save_head(head, staging)
    with console.status(f"loading weights of {model}"):
        decoder = _export_weights(model, hf_config, config, impl, staging, weights, console, head)
    specs = graph_specs(config)
    if config.quantization:
        console.print(quantization_summary(decoder, config))
    config = _compile(impl, decoder, config, specs, staging, console)
    config.save(staging, files=record_files(staging, export_files(config)))
    write_model_card(staging, model, config)
    return config, specs


def _kv_scales(model: str, hf_config, options: dict) -> dict:
    """--kv-cache-dtype fp8: the checkpoint's K / V scales where it has them (else 1.0)."""
    folder = checkpoint_folder(model) if options.get("kv_cache_dtype") == "fp8" else None
    if folder is None:
        return {}
    layers = family_spec(hf_config).num_layers
    return {"kv_cache_scales": checkpoint_kv_scales(hf_config, CheckpointFiles(folder), layers)}


def _quantization_fields(model: str, source, family, options: dict, weights: str) -> dict:
    """--quantization as exported (quantized_checkpoint.export_quantization) and, for an FP8
    checkpoint, its block-wise scales and the projections it keeps unquantized."""
    fields = {"quantization": export_quantization(options.get("quantization"), source)}
    if source is None or not source.fp8:
        return fields
    if family.fused_projections or (family.moe is not None and family.moe.expert_bias):
        raise ExportError(
            f"FP8 checkpoints of {family.model_type} (fused projections, or experts in gpt-oss's layout) are "
            "not exported as FP8 yet: export the unquantized original with --quantization fp8."
        )
    folder = checkpoint_folder(model) if weights == "stream" else None
    if folder is None:
        raise ExportError(
            f"an FP8 checkpoint exports from its safetensors, streamed: {model} (weights={weights})."
        )
    tensors = {name: info for name, (_, info) in CheckpointFiles(folder).tensors.items()}
    kept = kept_modules(tensors, source)
    return fields | {
        "quantization_block": source.block or (),
        "quantization_skip": tuple(options.get("quantization_skip") or ()) + kept,
    }


def quantization_summary(decoder: DecoderModel, config: NeuronConfig) -> str:
    """The weight bytes quantization saves per rank and, for a paged export, the KV blocks of
    --kv-block-size positions that the same HBM holds."""
    state, quantized = decoder.state_dict(), decoder.quantized_weights()
    weights = set(quantized.values())
    full = sum(state[n].numel() * torch_dtype(config).itemsize for n in weights)
    stored = sum(state[n].numel() * state[n].element_size() for n in quantized)
    saved, tp = (full - stored) / config.tp_degree, config.tp_degree
    more_blocks = ""
    if not decoder.kv.whole_sequence_blocks:
        block_bytes = decoder.kv.block_bytes(ShardLayout.of(decoder.spec, tp).kv_heads_per_rank)
        more_blocks = (
            f", the HBM of {int(saved // block_bytes)} more KV blocks of {decoder.kv.block_size} positions"
        )
    where = "" if tp == 1 else " per rank"
    return (
        f"quantization {config.quantization}: {len(weights)} weights {_size(full / tp)} -> {_size(stored / tp)}"
        f"{where} (scales included), {_size(saved)} saved{more_blocks}"
    )


def _size(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / 2**20:.2f} MiB"


def _choose_attention(impl, config: NeuronConfig, family, console: Console, eagle3=None) -> NeuronConfig:
    """The graphs whose prefill chunks run an NKI attention kernel (`eagle3`'s DC graphs too),
    recorded in the config and said in the export's first lines (Backend.attention_kernels)."""
    head = eagle3.family() if eagle3 is not None else None
    chosen, reasons, limits = impl.attention_kernels(config, family, graph_specs(config), head)
    if chosen or config.attention_kernel != "auto" or config.backend == "neuron":
        console.print(describe_attention(chosen, reasons, config.kv_cache_dtype == "fp8"))
    if limits:
        console.print(f"kernel limits: {limits}")
    return replace(config, nki_attention=chosen, nki_limits=limits)


def _compile(impl, decoder, config: NeuronConfig, specs, staging: Path, console: Console) -> NeuronConfig:
    """Compile every graph -> the config as compiled. The neuron backend probes the NKI kernel
    alone first and takes refused shapes off it (said here); should the whole bundle still be
    refused under --attention-kernel auto, every graph compiles again with the reference."""
    try:
        with _progress(console, len(specs)) as on_graph:
            compiled = impl.compile(decoder, config, specs, staging, on_graph)
        dropped = [name for name in config.nki_attention if name not in compiled.nki_attention]
        if dropped:
            console.print(
                f"[yellow]the compiler refused the NKI attention kernel alone in {', '.join(dropped)}[/]: "
                "they attend through the reference"
            )
        return compiled
    except KernelCompileError as e:
        if config.attention_kernel != "auto":
            raise
        console.print(
            f"[yellow]the compiler rejected the NKI attention kernel[/] {e}: compiling every graph again "
            "with the reference attention (--attention-kernel reference)"
        )
    config = replace(config, nki_attention=())
    with _progress(console, len(specs)) as on_graph:
        return impl.compile(decoder, config, specs, staging, on_graph)


def check_options(options: dict) -> None:
    """export()'s keywords beyond its own are the declared options, the required ones given."""
    names = [option.name for option in EXPORT_OPTIONS]
    unknown = sorted(set(options) - set(names))
    if unknown:
        said = ", ".join(f"{name!r}{_guess(name, names)}" for name in unknown)
        raise TypeError(f"export() got unknown options {said}; its options: {', '.join(names)}.")
    missing = [o.name for o in EXPORT_OPTIONS if o.default is MISSING and o.name not in options]
    if missing:
        raise TypeError(f"export() is missing the required options {', '.join(missing)}.")


def _guess(name: str, names: list[str]) -> str:
    close = get_close_matches(name, names, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _check_output(output: Path, overwrite: bool) -> None:
    if output.exists() and not output.is_dir():
        raise ExportError(f"output {output} exists and is not a folder: choose another OUT.")
    if output.is_dir() and any(output.iterdir()) and not overwrite:
        raise ExportError(
            f"output folder {output} is not empty: pass --overwrite to replace it, or choose another OUT."
        )
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=output.parent, prefix=".write-probe-")
        probe.close()
    except OSError as e:
        raise ExportError(f"cannot write beside {output}: {e.strerror}. Choose a writable OUT.") from e


def load_hf_config(model: str) -> PretrainedConfig:
    """The transformers config of `model` (a folder or a hub id), or ExportError saying what to pass."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as e:
        hint = (
            "a local folder with config.json" if Path(model).exists() else "a local folder or a hub model id"
        )
        raise ExportError(f"cannot load a model config from {model!r}: pass {hint}. ({e})") from e


def _check_shapes(hf_config, config: NeuronConfig) -> None:
    max_positions = getattr(hf_config, "max_position_embeddings", None)
    if max_positions is not None and config.sequence_length > max_positions:
        raise ExportError(
            f"--sequence_length {config.sequence_length} exceeds the model's max_position_embeddings "
            f"({max_positions}): pass --sequence_length <= {max_positions}."
        )


def _export_weights(
    model: str,
    hf_config,
    config: NeuronConfig,
    impl: Backend,
    out: Path,
    weights: str,
    console: Console,
    head=None,
) -> DecoderModel:
    """Write the export's weight files; returns the decoder the backend compiles from. Streamed,
    it holds real weights only where compiling needs them: eager and xla compile nothing; the
    cpu backend's AOTInductor packages hold no constants (it binds them at load), except the
    0-d/1-d tensors AOTInductor inlines, so its decoder holds those and uninitialised memory,
    never written (not resident), for the rest; the neuron backend loads rank 0's shard from
    the file written here before NxD traces."""
    folder = checkpoint_folder(model) if weights == "stream" else None
    source = source_quantization(hf_config)
    family, kernels = family_spec(hf_config), impl.kernels(config)
    eagle3 = fitting_spec(head.config, config, family) if head is not None else None
    head_state = head_weights(head, eagle3) if head is not None else None
    if folder is not None:
        decoder = model_from_spec(family, config, kernels=kernels, device="meta", eagle3=eagle3)
        try:
            stream_weights(
                folder, hf_config, config, decoder, *impl.stream_targets(config), out, source, head_state
            )
        except StreamUnsupportedError as e:
            if source is not None and source.fp8:
                raise ExportError(f"an FP8 checkpoint exports streamed only: {e}") from e
            console.print(f"[yellow]warning[/]: {e}; loading the whole model with transformers instead.")
        else:
            return impl.streamed_model(decoder, out)
    elif weights == "stream":
        console.print(
            "[yellow]warning[/]: no safetensors checkpoint: loading the whole model with transformers."
        )
    decoder = build_model(hf_config, config, kernels=kernels, eagle3=eagle3)
    decoder.load_weights(decoder.weights_from_hf(_load_hf_model(model, hf_config, config), head=head_state))
    impl.save_weights(decoder, config, out)
    return decoder


def _load_hf_model(model: str, hf_config, config: NeuronConfig):
    from transformers import AutoModelForCausalLM

    kwargs = quantization_kwargs(hf_config)
    return AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype(config), **kwargs)


def quantization_kwargs(hf_config) -> dict:
    """gpt-oss's MXFP4 experts are dequantised to the export dtype by transformers' own
    Mxfp4 quantizer (Mxfp4Config(dequantize=True), quantizers/quantizer_mxfp4.py, 4.57 and
    5.x), whatever kernels the build host has; FP8 checkpoints only stream (_quantization_fields)."""
    source = source_quantization(hf_config)
    if source is None or source.method != "mxfp4":
        return {}
    from transformers import Mxfp4Config

    return {"quantization_config": Mxfp4Config(dequantize=True)}


def _save_hf_files(model: str, hf_config, out: Path) -> None:
    """config.json without the source's quantization_config: the export's weights are laid
    out as neuron_config.json records them (vLLM would otherwise pick its own quantization
    method for them)."""
    from transformers import GenerationConfig

    exported = copy.deepcopy(hf_config)
    exported.__dict__.pop("quantization_config", None)
    exported.save_pretrained(out)
    try:
        GenerationConfig.from_pretrained(model).save_pretrained(out)
    except OSError:
        GenerationConfig.from_model_config(hf_config).save_pretrained(out)
    copy_tokenizer(model, out)
    check_loads(out)


@contextmanager
def _progress(console: Console, total: int):
    """Graphs compiled / total with elapsed and remaining time: a live display on a terminal,
    one line per graph elsewhere (logs of `vllm serve`, CI)."""
    if not console.is_terminal:
        started, done = time.perf_counter(), 0

        @contextmanager
        def on_graph_line(graph):
            nonlocal done
            yield
            done += 1
            elapsed = time.perf_counter() - started
            console.print(
                f"compiled {graph.name} [{graph.batch}x{graph.width}, window {graph.window}]: {done}/{total} "
                f"graphs, {elapsed:.0f}s elapsed, about {elapsed / done * (total - done):.0f}s left"
            )

        yield on_graph_line
        return
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        overall = progress.add_task("compiling graphs", total=total)

        @contextmanager
        def on_graph(graph):
            progress.update(
                overall,
                description=f"compiling {graph.name} [{graph.batch}x{graph.width}, window {graph.window}]",
            )
            yield
            progress.advance(overall)

        yield on_graph


__all__ = ["ExportError", "export"]
