"""Manual check for a Neuron developer: our decoder built with neuronx-distributed's own
parallel layers, from NxD's public source, without the closed SDK.

    PJRT_DEVICE=CPU .venv-sdk/bin/python tests/nxd_source_check.py PATH_TO_NXD_SOURCE [--eagle3]

PATH_TO_NXD_SOURCE is a checkout of aws-neuron/neuronx-distributed (its `src/` folder holds
the package; checked with Release 2.29 = 0.18.0, commit fbac349b61a3). The closed SDK
modules NxD imports (torch_neuronx, neuronxcc, libneuronxla, nki, nkilib) are stubbed: nothing here
compiles or runs on Neuron. For llama and qwen3 at tp 1 and 2, inside `NxDParallelState` as
the neuron backend builds it, the script checks that
  - the bundle's parameter names and shapes (as NxD's checkpoint loader walks them: every
    tensor once) equal those of every per-rank shard file `NeuronBackend.save_weights` writes;
  - at tp 1, every graph of the bundle, run on torch-xla's CPU device with its int32 example
    inputs, equals the eager graph on the unsharded model.
Then it runs the real `NeuronBackend.compile` on llama exports holding every graph kind
(helpers.every_graph_kind: CP narrow and full, TG narrow and full, MX, copy,
prompt logits; CE; with and without on-device sampling; an EAGLE3 head's DC and DV) at tp 1
and 2, up to the first closed call of each trace: the stub of `torch_neuronx.xla_impl.trace.generate_hlo` records
what NxD's `ModelBuilder.trace` hands it and stops that graph's trace. Per graph it prints
which of NxD's input checks ran before generate_hlo was reached, whether NxDModel's router
sends a positional call with the graph's inputs to its tag, and at tp 1 whether the bundle
called by keyword, as generate_hlo is asked to (`treat_inputs_as_kwargs=True`), equals the
eager graph. The compile then reaches `ModelBuilder.compile`, which finds no trace (every
one stopped at the stub) and refuses: the expected end.
EAGLE3 (--speculation-head): a random head for the tiny llama (testing/random_heads.py, a draft
vocabulary of 127 that tp 2 does not divide) gets the same checks at tp 1 and 2: its `draft.*`
parameters and buffers against the shard files, every graph of the export on XLA at tp 1 (DC /
DV drafts exactly, and after each graph the head's K/V and aux states) and a drafting run
through GraphRunner (chunks, drafts after each, a verify step, drafts after it); its DC / DV
graphs traced through `NeuronBackend.compile` to generate_hlo from a streamed export (tp 1: the
keyword call's drafts and head caches == eager), and again with the NKI attention stand-in in
the CP graphs (tp 1: which graphs call the kernel; a DC graph runs its first pass through it
where the CP graph of its (width, bucket) does: backends/neuron/nki_kernels.py dispatches by
shape). `--eagle3`: these checks alone.
Not in CI: NxD's source is not on the package registry.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import logging
import os
import sys
import tempfile
import traceback
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
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
# ModelBuilder.__init__ requires torch-neuronx 2.x (NxD 0.18, trace/model_builder_v2.py).
TORCH_NEURONX_VERSION = "2.9.0+stub"
# EAGLE3: drafts a step, the random head's draft vocabulary (tp 2 pads its lm_head) and seed
K, HEAD_VOCAB, HEAD_SEED = 3, 127, 21
HEAD_NAME = "random-head"  # --speculation-head as the config records it (nothing reads the folder)
EAGLE3 = "eagle3"  # check_compile's name of the head export (eagle3_config)


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
    importlib.import_module("torch_neuronx").__version__ = TORCH_NEURONX_VERSION
    importlib.import_module("torch_neuronx.xla_impl.trace").generate_hlo = _generate_hlo


class ClosedCallReached(Exception):
    """Raised by the stub of the first closed call of a trace, with what the call received."""

    def __init__(
        self, model, inputs: dict[str, torch.Tensor], flags: dict, chain: list[str], outputs, caches
    ):
        super().__init__(f"generate_hlo reached for graph {model._selected}")
        self.graph, self.signature = model._selected, inspect.signature(model.forward)
        self.inputs, self.flags, self.chain, self.outputs = inputs, flags, chain, outputs
        self.caches = caches  # an EAGLE3 head's K/V and aux states after the call (RUN_TRACED_MODULE)


# Whether the stub also calls the module as generate_hlo is asked to: NxD layers run eagerly
# only at tp 1 (at tp 2 the mock process group has no collectives).
RUN_TRACED_MODULE = False


def _generate_hlo(model, example_inputs, **flags):
    """torch_neuronx.xla_impl.trace.generate_hlo (closed): records the graph it was asked to
    trace and stops there. The closed function traces `model` with `example_inputs` as
    keywords (NxD passes treat_inputs_as_kwargs=True)."""
    chain = [
        f"{Path(frame.f_code.co_filename).stem}.{frame.f_code.co_qualname}"
        for frame, _ in traceback.walk_stack(sys._getframe().f_back)
        if "neuronx_distributed" in frame.f_code.co_filename
        or "optimum_neuron_chunked" in frame.f_code.co_filename
    ][::-1]
    outputs = caches = None
    if RUN_TRACED_MODULE:
        with torch.no_grad():
            outputs = model(**example_inputs)
        decoder = getattr(model, "model", None)  # GraphBundle's decoder
        caches = head_caches(decoder) if getattr(decoder, "eagle3", None) is not None else {}
    raise ClosedCallReached(model, dict(example_inputs), flags, chain, outputs, caches)


def head_caches(decoder) -> dict[str, torch.Tensor]:
    """An EAGLE3 decoder's head K/V and aux states (host copies); {} without a head."""
    from optimum_neuron_chunked.modeling.eagle3 import draft_cache_names

    return {n: getattr(decoder, n).detach().cpu().clone() for n in draft_cache_names(decoder)}


def head_tensors() -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, tensors) of the random head, as yuhuili ships one (no embed_tokens)."""
    from optimum_neuron_chunked.testing.random_heads import TINY_LLAMA_HEAD, random_head

    config = TINY_LLAMA_HEAD | {"draft_vocab_size": HEAD_VOCAB}
    return config, random_head(config, HEAD_SEED)


def head_fields() -> dict:
    """The NeuronConfig fields of an export with the random head (export/pipeline.py's)."""
    from optimum_neuron_chunked.modeling.eagle3 import shared_weights

    return dict(
        speculation_length=K,
        speculation_head=HEAD_NAME,
        speculation_head_shares=shared_weights(head_tensors()[1]),
    )


def head_of(hf_config, config):
    """(Eagle3Spec, `draft.*` weights) of the random head in export `config`, as export/pipeline.py
    gets them (head_checkpoint.fitting_spec, head_weights)."""
    from optimum_neuron_chunked.head_checkpoint import HeadCheckpoint, fitting_spec, head_weights
    from optimum_neuron_chunked.modeling.family import family_spec

    head_config, tensors = head_tensors()
    spec = fitting_spec(head_config, config, family_spec(hf_config))
    return spec, head_weights(HeadCheckpoint(Path(HEAD_NAME), head_config, tensors), spec)


def eagle3_config(tp: int):
    """A llama export with the head: CP and DC narrow and full, TG, VF and DV narrow and full."""
    from helpers import small_neuron_config

    return small_neuron_config(tp, prefill_widths=(4, 16), decode_widths=(1, 2), **head_fields())


def check_family(
    family: str, tp: int, quantization: str = "", lora: bool = False, head: bool = False
) -> list[str]:
    from fixtures.export_models import checkpoint_path
    from helpers import small_neuron_config
    from neuronx_distributed import NxDParallelState
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from optimum_neuron_chunked.backends.graph_bundle import GraphBundle
    from optimum_neuron_chunked.backends.neuron.backend import NeuronBackend
    from optimum_neuron_chunked.backends.neuron.layers import NxdLayers
    from optimum_neuron_chunked.config import NeuronConfig
    from optimum_neuron_chunked.graphs import graph_specs
    from optimum_neuron_chunked.lora_adapter import empty_slots
    from optimum_neuron_chunked.modeling import build_model
    from optimum_neuron_chunked.modeling.family import family_spec
    from optimum_neuron_chunked.modeling.lora import LoraSpec

    path = checkpoint_path(family)
    hf_config = AutoConfig.from_pretrained(path)
    slots = dict(max_loras=2, max_lora_rank=8) if lora else {}
    config = small_neuron_config(tp, quantization=quantization, **slots, **(head_fields() if head else {}))
    # an EAGLE3 head: its spec and `draft.*` weights; the unsharded model of its export's shapes
    eagle3, head_state = head_of(hf_config, config) if head else (None, None)
    if head:
        shapes = small_neuron_config(1, **head_fields())
    else:
        shapes = NeuronConfig(batch_size=2, sequence_length=64, quantization=quantization, **slots)
    full = build_model(hf_config, shapes, eagle3=eagle3)
    full.load_weights(full.weights_from_hf(AutoModelForCausalLM.from_pretrained(path), head=head_state))
    problems = []
    with tempfile.TemporaryDirectory() as out, NxDParallelState(world_size=tp, tensor_model_parallel_size=tp):
        NeuronBackend().save_weights(full, config, Path(out))
        sharded = build_model(hf_config, config, NxdLayers(tp), functional_cache=True, eagle3=eagle3)
        bundle = GraphBundle(sharded, config, graph_specs(config))
        aliases = [n for n in bundle.state_dict() if n.endswith("master_weight")]
        # NxD's view: shard_children walks named_parameters() (each Parameter once), and
        # preprocess_checkpoint keeps state_dict() keys, persistent buffers included.
        state = bundle.state_dict(keep_vars=True)
        expected = {n: tuple(t.shape) for n, t in bundle.named_parameters()}
        expected |= {n: tuple(t.shape) for n, t in state.items() if not isinstance(t, torch.nn.Parameter)}
        for rank, file in enumerate(NeuronBackend().weight_files(config)):
            shard = {n: tuple(t.shape) for n, t in load_file(Path(out) / file).items()}
            if lora:  # NeuronBackend.load adds the adapter slots, zero, to what set_weights takes
                empty = empty_slots(family_spec(hf_config), LoraSpec.of(config), torch.float32, tp, rank)
                shard |= {"model." + n: tuple(t.shape) for n, t in empty.items()}
            if shard != expected:
                problems.append(
                    f"{family} tp{tp} rank {rank}: shard {sorted(shard.items() ^ expected.items())}"
                )
        family = " ".join(
            x for x in (family, quantization, "lora" if lora else "", EAGLE3 if head else "") if x
        )
        drafts = {n: s for n, s in expected.items() if n.startswith("model.draft.")}
        said = ""
        if head:  # the head's share of them, and what tp does to it
            shown = (
                "model.draft.lm_head.weight",
                "model.draft.layers.0.self_attn.q_proj.weight",
                "model.draft.fc.weight",
            )
            said = (
                f" ({len(drafts)} of the head: "
                + ", ".join(f"{n[12:]} {list(drafts.get(n, ()))}" for n in shown)
                + ")"
            )
        print(
            f"{family} tp{tp}: {len(expected)} weights per rank{said}, {len(aliases)} master_weight aliases skipped"
        )
        if tp == 1 and not problems:
            problems += check_forward(family, full, sharded, config)
    return problems


def check_forward(family, full, sharded, config) -> list[str]:
    """tp 1: the NxD-layer bundle on the XLA device equals the eager graphs, graph by graph."""
    from optimum_neuron_chunked.backends.xla import XlaRuntime
    from optimum_neuron_chunked.graphs import example_inputs, graph_module, graph_specs

    sharded.load_weights(sharded.rank_weights(full.unsharded_weights(), 0))
    xla = XlaRuntime(sharded.eval(), config, graph_specs(config))
    problems = []
    for spec in graph_specs(config):
        inputs = example_inputs(spec, config)
        got = xla.run(spec.name, *inputs)
        with torch.no_grad():
            want = graph_module(full, spec, config)(*inputs)
        for a, b in zip(_tuple(got), _tuple(want), strict=True):
            if not _same(a, b):
                problems.append(f"{family} {spec.name}: {_diff(a, b)}")
        # an EAGLE3 head: what DC / DV leave on the device (its K/V) and CP / VF (aux states)
        caches = xla.caches() if full.eagle3 is not None else {}
        for name, want_cache in head_caches(full).items():
            if not _same(caches[name], want_cache):
                problems.append(f"{family} {spec.name}: {name} {_diff(caches[name], want_cache)}")
    said = f"{len(graph_specs(config))} graphs on XLA == eager"
    if full.eagle3 is not None:
        kinds = ("dc", "dv")
        said += f" (DC / DV: {sum(s.kind in kinds for s in graph_specs(config))} graphs, drafts exact; head K/V and aux states after each graph)"
        problems += check_drafting(family, xla, full, config)
    print(f"{family} tp1: {said}" if not problems else problems)
    return problems


def check_drafting(family, xla, full, config) -> list[str]:
    """tp 1, an EAGLE3 export: a fixed run through GraphRunner (two prompts in chunks, drafts after
    each chunk, one verify step, drafts after it) on the bundle's graphs on XLA and on the eager
    graphs: the same drafts."""
    from optimum_neuron_chunked.graph_runner import GraphRunner
    from optimum_neuron_chunked.graphs import graph_module, graph_specs

    eager = {s.name: graph_module(full, s, config) for s in graph_specs(config)}
    runs = []
    for graphs in (xla.graphs(), eager):
        runner, g, drafts, rows = GraphRunner(config, graphs), torch.Generator().manual_seed(16), [], []
        with torch.no_grad():
            for block, n in enumerate((21, 9)):
                prompt = torch.randint(4, 380, (n + 1,), generator=g)
                for start in range(0, n, config.prefill_chunk_size):
                    stop = min(start + config.prefill_chunk_size, n)
                    runner.prefill(prompt[start:stop], start, (block,))
                    drafts.append(runner.draft_after_chunk(prompt[start:stop], int(prompt[stop]), start))
                rows.append(torch.cat([prompt[n:], drafts[-1]]))
            runner.verify(rows, torch.tensor([21, 9]), [(0,), (1,)], False)
            drafts.append(runner.draft_after_verify(runner.last_verify, [5, 6], [1, K]))
        runs.append([d.tolist() for d in drafts])
    if runs[0] != runs[1]:
        return [f"{family} drafting run: XLA drafts {runs[0]}, eager {runs[1]}"]
    print(
        f"{family} tp1: a drafting run through GraphRunner on XLA drafts as eager ({len(runs[0])} draft calls)"
    )
    return []


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Floats within 1e-4; integers (tokens, drafts) exactly."""
    if not b.is_floating_point():
        return torch.equal(a.to(b.dtype), b)
    return torch.allclose(a.to(b.dtype), b, atol=1e-4, rtol=0)


def _diff(a: torch.Tensor, b: torch.Tensor) -> str:
    if not b.is_floating_point():
        return f"{int((a.to(b.dtype) != b).sum())} of {b.numel()} integers differ"
    return f"max diff {(a.to(b.dtype) - b).abs().max()}"


@dataclass
class Reached:
    """How far one graph's trace got."""

    graph: str
    stop: ClosedCallReached | None = None
    refusal: str = ""
    checks: list[str] = field(default_factory=list)  # NxD's input checks that ran (trace/functions.py)
    kernel_calls: int = 0  # calls of the NKI attention stand-in while tracing it (tp 1: it runs)


def _watch_checks(checks: list[str]):
    """A profile hook listing the calls of NxD's trace checks (`_validate_*`,
    `_process_example_inputs` in trace/functions.py) as they return."""

    def hook(frame, event, arg):
        code = frame.f_code
        if event == "return" and code.co_filename.endswith(os.path.join("trace", "functions.py")):
            if code.co_name.startswith(("_validate", "_process")) and code.co_name not in checks:
                checks.append(code.co_name)

    return hook


class _QuietStops(logging.Filter):
    """NxD logs every generate_hlo failure at error level, the stub's stops included."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "generate_hlo reached for graph" not in record.getMessage()


def check_compile(name: str, tp: int, nki: bool = False, quantization: str = "", kernel=None) -> list[str]:
    """The real NeuronBackend.compile on a llama export, each trace up to generate_hlo; `name`:
    one of helpers.every_graph_kind, or EAGLE3 (eagle3_config: the random head's DC / DV graphs);
    `nki`: with nkilib's attention_cte (testing/nki_stand_in.py) in every CP and MX graph,
    `kernel`: the stand-in, whose calls are counted per graph; `quantization`: int8 / fp8 per
    channel, or "fp8-blocks" (a block-wise FP8 checkpoint)."""
    global RUN_TRACED_MODULE
    from fixtures.export_models import checkpoint_path
    from helpers import every_graph_kind
    from transformers import AutoConfig, AutoModelForCausalLM

    from optimum_neuron_chunked.backends import KernelCompileError
    from optimum_neuron_chunked.backends.neuron.backend import NeuronBackend
    from optimum_neuron_chunked.checkpoint_stream import stream_weights
    from optimum_neuron_chunked.graphs import GraphKind, example_inputs, graph_module, graph_specs
    from optimum_neuron_chunked.modeling import build_model, model_from_spec
    from optimum_neuron_chunked.quantized_checkpoint import source_quantization

    config = eagle3_config(tp) if name == EAGLE3 else every_graph_kind(tp)[name]
    path = checkpoint_path("llama")
    if quantization == "fp8-blocks":
        path = fp8_blocks_checkpoint()
        fields = dict(quantization="fp8", quantization_block=FP8_BLOCK, quantization_skip=(FP8_KEPT,))
        config = replace(config, **fields)
    elif quantization:
        config = replace(config, quantization=quantization)
    name += f"-{quantization}" if quantization else ""
    if nki:
        kinds = (GraphKind.CP, GraphKind.MX)
        # "nki": the kernel in these graphs as chosen (under "auto" the compile would first probe
        # it alone, which the stubbed closed calls cannot compile)
        chosen = tuple(s.name for s in graph_specs(config) if s.kind in kinds)
        config = replace(config, attention_kernel="nki", nki_attention=chosen)
        name += "-nki"
    hf_config = AutoConfig.from_pretrained(path)
    eagle3, head_state = head_of(hf_config, config) if config.speculation_head else (None, None)
    # the eager reference graphs below: unsharded, plain layers, HF weights (an FP8
    # checkpoint's: rank 0's streamed file at tp 1)
    decoder = build_model(hf_config, config, eagle3=eagle3)
    if not quantization.endswith("blocks"):
        hf = AutoModelForCausalLM.from_pretrained(path)
        decoder.load_weights(decoder.weights_from_hf(hf, head=head_state))
    # as export/pipeline.py hands it to the backend: the shard files streamed from the
    # checkpoint (the head's too), a decoder on the meta device (compile loads rank 0's shard
    # from its file)
    meta = model_from_spec(decoder.spec, config, device="meta", eagle3=eagle3)
    specs = graph_specs(config)
    reached: dict[str, Reached] = {}

    @contextmanager
    def on_graph(spec) -> Iterator[None]:
        # a graph's trace ends in an exception here; suppressing it lets compile trace the next
        reached[spec.name] = Reached(spec.name)
        calls = len(kernel.calls) if kernel is not None else 0
        sys.setprofile(_watch_checks(reached[spec.name].checks))
        try:
            yield
        except RuntimeError as e:  # NxD's trace() wraps generate_hlo's failures
            if not isinstance(e.__cause__, ClosedCallReached):
                reached[spec.name].refusal = _refusal(e)
            else:
                reached[spec.name].stop = e.__cause__
        except Exception as e:  # noqa: BLE001  (a refusal by NxD's checks, reported per graph)
            reached[spec.name].refusal = _refusal(e)
        else:
            reached[spec.name].refusal = "trace returned without reaching the stubbed generate_hlo"
        finally:
            sys.setprofile(None)
            reached[spec.name].kernel_calls = len(kernel.calls) - calls if kernel is not None else 0

    RUN_TRACED_MODULE = tp == 1
    source = source_quantization(hf_config)
    end = "compile returned"
    quiet = _QuietStops()
    logging.getLogger("Neuron").addFilter(quiet)
    with tempfile.TemporaryDirectory() as out:
        stream_weights(
            path,
            hf_config,
            config,
            meta,
            *NeuronBackend().stream_targets(config),
            Path(out),
            source,
            head_state,
        )
        if quantization.endswith("blocks") and tp == 1:
            from optimum_neuron_chunked.backends.neuron.backend import written_shard

            files = NeuronBackend().weight_files(config)
            decoder.load_weights(written_shard(Path(out) / files[0], decoder.weight_names()))
        try:
            NeuronBackend().compile(meta, config, specs, Path(out), on_graph)
        except KernelCompileError as e:  # with the kernel in the graphs: its cause is the end
            end = f"{_refusal(e.__cause__)}"
        except ValueError as e:
            end = f"{_refusal(e)}"
        finally:
            logging.getLogger("Neuron").removeFilter(quiet)
    problems = []
    if "No traces available for compilation" not in end:
        problems.append(
            f"{name} tp{tp}: compile ended with {end!r}, not at ModelBuilder.compile without traces"
        )
    router = _router(specs, reached)
    for spec in specs:
        r = reached.get(spec.name) or Reached(spec.name, refusal="never traced")
        if r.refusal or r.stop.graph != spec.name:
            problem = r.refusal or f"generate_hlo traced graph {r.stop.graph}"
            problems.append(f"{name} tp{tp} {spec.name}: {problem}")
            print(f"{name} tp{tp} {spec.name:12} REFUSED {problem}")
            continue
        inputs = ", ".join(f"{k} {str(v.dtype)[6:]}{list(v.shape)}" for k, v in r.stop.inputs.items())
        keywords = r.stop.flags.get("treat_inputs_as_kwargs")
        line = (
            f"{name} tp{tp} {spec.name:12} [{inputs}] passed {', '.join(r.checks)}; "
            f"reached generate_hlo(treat_inputs_as_kwargs={keywords})"
        )
        routed = router(spec.name, example_inputs(spec, config))
        if routed != spec.name:
            problems.append(f"{name} tp{tp} {spec.name}: a positional call routes to {routed}")
        line += f"; positional NxDModel call routes here: {routed == spec.name}"
        if r.stop.outputs is not None:
            with torch.no_grad():
                want = graph_module(decoder, spec, config)(*example_inputs(spec, config))
            same = all(
                torch.allclose(a.to(b.dtype), b, atol=1e-4, rtol=0)
                for a, b in zip(_tuple(r.stop.outputs), _tuple(want), strict=True)
            )
            if not same:
                problems.append(f"{name} tp{tp} {spec.name}: keyword call differs from the eager graph")
            line += f"; keyword call == eager: {same}"
            if spec.kind in (GraphKind.DC, GraphKind.DV):  # drafts are integers: exact
                exact = all(_same(a, b) for a, b in zip(_tuple(r.stop.outputs), _tuple(want), strict=True))
                caches = all(_same(r.stop.caches[n], c) for n, c in head_caches(decoder).items())
                if not (exact and caches):
                    problems.append(f"{name} tp{tp} {spec.name}: drafts exact {exact}, head caches {caches}")
                line += f" (drafts exactly: {exact}; head K/V and aux states: {caches})"
        if kernel is not None and tp == 1:
            line += f"; NKI kernel calls: {r.kernel_calls}"
        print(line)
    chains = {" > ".join(r.stop.chain) for r in reached.values() if r.stop is not None}
    print(f"{name} tp{tp}: generate_hlo reached from {' | '.join(sorted(chains))}; then {end}")
    if kernel is not None and tp == 1:  # the module runs at tp 1 only: the kernel is called there
        ran = sorted(n for n, r in reached.items() if r.kernel_calls)
        print(
            f"{name} tp{tp}: the NKI kernel ran in {', '.join(ran) or 'no graph'} (chosen: {', '.join(config.nki_attention)})"
        )
        missing = set(config.nki_attention) - set(ran)
        if missing:
            problems.append(f"{name} tp{tp}: chosen graphs {sorted(missing)} never called the NKI kernel")
    return problems


FP8_BLOCK = (16, 16)  # whole blocks per rank at tp 2 for llama's 16-row KV heads
FP8_KEPT = "model.layers.0.mlp.down_proj"


def fp8_blocks_checkpoint() -> Path:
    from fixtures.export_models import fp8_checkpoint_path

    from optimum_neuron_chunked.testing.fp8_checkpoints import KEPT

    assert KEPT == FP8_KEPT
    return fp8_checkpoint_path("llama", "block", FP8_BLOCK)


def _refusal(e: BaseException) -> str:
    """The exception and the function that raised it (NxD's check, when it is one)."""
    where = traceback.extract_tb(e.__traceback__)[-1]
    return f"{type(e).__name__} in {Path(where.filename).name} {where.name}: {e}"


def _router(specs, reached: dict[str, Reached]):
    """NxDModel's own routing (NxD 0.18 trace/nxd_model/nxd_model.py: `add` keys each tag by
    its traced inputs' names and shapes, `forward` names a call's inputs after the signature
    with `convert_dict_to_ordered_list` and looks the key up with `router`), fed with what
    generate_hlo received: which tags a positional call with a graph's inputs reaches. Our
    graphs share shapes across buckets, so NeuronGraph passes model_name= to pick one."""
    from neuronx_distributed.trace.functions import _validate_model_params
    from neuronx_distributed.trace.model_builder_utils import ProvidedArgInfo
    from neuronx_distributed.trace.nxd_model.nxd_model import NxDModel
    from neuronx_distributed.trace.nxd_model.utils import generate_route_key_from_provided_args

    stops = [r.stop for r in reached.values() if r.stop is not None]
    shape_map: dict[str, list[str]] = {}
    for stop in stops:
        args = [ProvidedArgInfo(param_name=k, is_positional=True, tensor=v) for k, v in stop.inputs.items()]
        shape_map.setdefault(generate_route_key_from_provided_args(args), []).append(stop.graph)
    params = _validate_model_params(stops[0].signature.parameters) if stops else []
    state = types.SimpleNamespace(model_params=params, input_shape_map=shape_map)

    def route(graph: str, inputs: tuple[torch.Tensor, ...]) -> str:
        _, names = NxDModel.convert_dict_to_ordered_list(state, {}, len(inputs))
        try:
            tags = NxDModel.router(state, list(inputs), names)
        except KeyError:
            return "no tag"
        return graph if graph in tags else f"{tags} only"

    return route


def _tuple(x):
    return x if isinstance(x, tuple) else (x,)


def main() -> int:
    args = sys.argv[1:]
    only_head = args[1:] == ["--eagle3"]  # the EAGLE3 head's checks alone
    if not (len(args) == 1 or only_head) or not (Path(args[0]) / "src" / "neuronx_distributed").is_dir():
        print(__doc__)
        return 2
    install_stubs(Path(args[0]))
    if only_head:
        return eagle3_main()
    quantized = ("", "int8", "fp8")
    problems = [
        p
        for family in ("llama", "qwen3")
        for tp in (1, 2)
        for q in quantized
        for p in check_family(family, tp, q)
    ]
    problems += [p for tp in (1, 2) for p in check_family("llama", tp, lora=True)]
    problems += [p for tp in (1, 2) for p in check_family("llama", tp, head=True)]
    print(
        "\n".join(problems)
        if problems
        else "OK: bundle names == shard files (an EAGLE3 head's too); tp 1 forward == eager (DC / DV drafts exactly)"
    )
    from helpers import every_graph_kind

    traced = [p for tp in (1, 2) for name in every_graph_kind(tp) for p in check_compile(name, tp)]
    traced += [
        p
        for tp in (1, 2)
        for q in ("int8", "fp8", "fp8-blocks")
        for p in check_compile("chunked", tp, quantization=q)
    ]
    traced += [p for tp in (1, 2) for p in check_compile(EAGLE3, tp)]
    from optimum_neuron_chunked.testing.nki_stand_in import installed

    with installed() as kernel:
        traced += [
            p for tp in (1, 2) for name in ("chunked", "paged") for p in check_compile(name, tp, nki=True)
        ]
        traced += [p for tp in (1, 2) for p in check_compile(EAGLE3, tp, nki=True, kernel=kernel)]
    if not kernel.calls:
        traced.append("the NKI attention kernel was never called")
    print(
        "\n".join(traced)
        if traced
        else "OK: NeuronBackend.compile traced every graph (CP and MX with the NKI attention kernel too; "
        "int8, fp8 and block-wise fp8 weights through NxD's quantized layers; an EAGLE3 head's DC and DV, "
        "with the kernel too) to generate_hlo; positional calls route to its tag"
    )
    return 1 if problems or traced else 0


def eagle3_main() -> int:
    """`PATH_TO_NXD_SOURCE --eagle3`: the EAGLE3 head's checks alone."""
    from optimum_neuron_chunked.testing.nki_stand_in import installed

    problems = [p for tp in (1, 2) for p in check_family("llama", tp, head=True)]
    problems += [p for tp in (1, 2) for p in check_compile(EAGLE3, tp)]
    with installed() as kernel:
        problems += [p for tp in (1, 2) for p in check_compile(EAGLE3, tp, nki=True, kernel=kernel)]
    print("\n".join(problems) if problems else "OK: the EAGLE3 head's shards, graphs on XLA and traces")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
