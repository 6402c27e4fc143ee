"""AWS's NKI attention kernel for prefill chunks (nkilib attention_cte) in the neuron backend:
which graphs run it (decided at export, refused by name under --attention-kernel nki), and
what NkiKernels computes with it, against the reference attention.

No nkilib runs here: testing/nki_stand_in.py puts a stand-in `nki` / attention_cte in
sys.modules, computing the kernel's documented semantics (written down independently of
nki_kernels.py). tests/nkilib_source_check.py runs AWS's own torch reference by hand instead.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import sys
import types
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from fixtures.export_models import cache_root, checkpoint_path
from transformers import AutoConfig, AutoModelForCausalLM

from optimum_neuron_chunked.backends.neuron.attention_choice import (
    KERNEL_MODULE,
    NEURONCORE_V2,
    STRICTEST,
    choose_nki_graphs,
)
from optimum_neuron_chunked.backends.neuron.kernel_probe import KernelProbe, kernel_specs
from optimum_neuron_chunked.backends.neuron.nki_kernels import NkiKernels
from optimum_neuron_chunked.config import NeuronConfig, NeuronConfigError
from optimum_neuron_chunked.graph_runner import GraphRunner
from optimum_neuron_chunked.graphs import GraphKind, graph_module, graph_specs
from optimum_neuron_chunked.modeling import build_model, family_spec
from optimum_neuron_chunked.modeling.eagle3 import Eagle3Spec
from optimum_neuron_chunked.modeling.kernels import Kernels
from optimum_neuron_chunked.testing.nki_stand_in import installed
from optimum_neuron_chunked.testing.random_heads import TINY_LLAMA_HEAD, cached_head

CHUNK, SEQ = 16, 64


@pytest.fixture
def nkilib():
    """The stand-in kernel (testing/nki_stand_in.py) in sys.modules; yields its jitted form."""
    with installed() as kernel:
        yield kernel


def neuron_config(**fields) -> NeuronConfig:
    shape = dict(batch_size=2, sequence_length=SEQ, prefill_chunk_size=CHUNK, context_buckets=(32, SEQ))
    return NeuronConfig(**(dict(backend="neuron", instance_type="trn2") | shape | fields))


def test_attention_kernel_choice_per_graph(nkilib, monkeypatch):
    """trn2 at any width, sinks too (NxD Inference's prefix prefill); the installed kernel's
    limits (its module constants, else 2.28's), refusals by graph."""
    spec = family_spec(AutoConfig.from_pretrained(checkpoint_path("llama")))
    config = neuron_config(dtype="bfloat16", mixed_step=True, prefill_widths=(8, CHUNK))
    chosen, reasons, limits = choose_nki_graphs(config, spec, graph_specs(config))
    kinds = {s.name: s.kind for s in graph_specs(config)}
    assert {kinds[n] for n in chosen} == {GraphKind.CP, GraphKind.MX} and len(chosen) == 6
    assert {r for n, r in reasons.items() if kinds[n] is GraphKind.TG} == {
        "decode rows keep the reference attention"
    }
    assert limits == STRICTEST  # the stand-in states no limits
    sinks = family_spec(AutoConfig.from_pretrained(checkpoint_path("gpt_oss")))
    assert choose_nki_graphs(config, sinks, graph_specs(config))[0] == chosen
    long = neuron_config(
        dtype="bfloat16", sequence_length=131072, prefill_chunk_size=512, context_buckets=(131072,)
    )
    assert "exceeds the kernel's 36864" in choose_nki_graphs(long, spec, graph_specs(long))[1]["cp_w131072"]
    nkilib.module._MAX_BS, nkilib.module._MAX_SEQLEN, nkilib.module._MAX_HEAD_DIM = 512, 131072, 128  # 2.29
    chosen, _, limits = choose_nki_graphs(long, spec, graph_specs(long))
    assert chosen == ("cp_w131072",) and (limits.max_batch, limits.max_positions) == (512, 131072)
    assert choose_nki_graphs(neuron_config(dtype="bfloat16", attention_kernel="reference"), spec, [])[0] == ()
    fp32 = neuron_config(attention_kernel="nki")
    with pytest.raises(NeuronConfigError, match=r"nki: cp_w32: the export is float32 .* --dtype bfloat16"):
        choose_nki_graphs(fp32, spec, graph_specs(fp32))
    assert choose_nki_graphs(neuron_config(), spec, graph_specs(neuron_config()))[0] == ()  # auto: fp32
    monkeypatch.setitem(sys.modules, KERNEL_MODULE, None)  # nkilib cannot import
    chosen, reasons, _ = choose_nki_graphs(config, spec, graph_specs(config))
    assert chosen == () and "does not import" in reasons["cp_w32"]
    with pytest.raises(NeuronConfigError, match="--attention-kernel nki calls AWS's NKI kernel"):
        NeuronConfig(batch_size=2, sequence_length=SEQ, backend="cpu", attention_kernel="nki")


def test_the_eagle3_heads_own_query_heads_are_checked_and_probed(nkilib):
    """The head attends with its own num_attention_heads (Eagle3Spec.family): one the kernel
    takes is probed with them; one with more query heads a core than the kernel takes keeps
    every chunk on the reference (its DC graphs share the chunks' shapes), refused by graph
    under --attention-kernel nki."""
    target = family_spec(AutoConfig.from_pretrained(checkpoint_path("llama")))
    config = neuron_config(dtype="bfloat16", speculation_length=2, speculation_head="head")

    def head(heads: int):
        fields = TINY_LLAMA_HEAD | {"num_attention_heads": heads, "head_dim": target.head_dim}
        return Eagle3Spec.of(fields, target).family()

    chosen, _, _ = choose_nki_graphs(config, target, graph_specs(config), head(8))
    assert chosen == ("cp_w32", "dc_w32", "cp_w64", "dc_w64")
    assert sorted(s.num_heads for s in kernel_specs(config, target, head(8))) == sorted({target.num_heads, 8})
    chosen, reasons, _ = choose_nki_graphs(config, target, graph_specs(config), head(64))
    misfit = f"the EAGLE3 head's attention: 64 query heads over {target.num_kv_heads} KV heads a core"
    assert chosen == () and misfit in reasons["cp_w32"] and misfit in reasons["dc_w64"]
    with pytest.raises(NeuronConfigError, match=f"nki: cp_w32: {misfit}.*; dc_w32: {misfit}"):
        choose_nki_graphs(replace(config, attention_kernel="nki"), target, graph_specs(config), head(64))


def test_a_ring_layers_window_is_not_checked_against_the_kernel(nkilib):
    """A sliding window past the kernel's positions (2.28's 36864) on layers whose cache is a
    ring (whole-sequence blocks): the full layers keep the kernel where the bucket fits, and
    the probe compiles their spec alone. Paged (no rings), the window is the kernel's."""
    hf_config = AutoConfig.from_pretrained(checkpoint_path("gemma3_text"))
    hf_config.sliding_window = 40000
    spec = family_spec(hf_config)
    config = neuron_config(dtype="bfloat16", sequence_length=65536, prefill_chunk_size=512,
                           context_buckets=(32768, 65536))  # fmt: skip
    chosen, reasons, _ = choose_nki_graphs(config, spec, graph_specs(config))
    assert chosen == ("cp_w32768",) and "a window of 65536" in reasons["cp_w65536"]
    assert {s.sliding_window for s in kernel_specs(config, spec)} == {None}
    paged = replace(config, kv_cache_blocks=64, kv_block_size=1024)
    assert "a sliding window of 40000" in choose_nki_graphs(paged, spec, graph_specs(paged))[1]["cp_w32768"]


@pytest.mark.parametrize(
    "family, paged",
    [("llama", False), ("llama", True), ("gemma3_text", False), ("gemma3_text", True), ("gpt_oss", True)],
)
def test_chunks_through_the_kernel_equal_the_reference(nkilib, family, paged):
    """Padded chunks at every offset of both buckets, whole-sequence (gemma3: rings keep the
    reference) and paged (sliding windows, gpt-oss's sinks), one starting past W - C (its
    queries laid out from W - C): the logits and every cache entry equal the reference's
    (padded copies write the last real token's K/V), and the kernel ran."""
    pages = dict(kv_cache_blocks=8, kv_block_size=16) if paged else {}
    config = NeuronConfig(batch_size=2, sequence_length=SEQ, prefill_chunk_size=CHUNK, context_buckets=(32, SEQ),
                          mixed_step=True, backend="eager", **pages)  # fmt: skip
    hf_config = AutoConfig.from_pretrained(checkpoint_path(family))
    hf = AutoModelForCausalLM.from_pretrained(checkpoint_path(family), dtype=torch.float32)
    specs = graph_specs(config)
    shapes = frozenset((CHUNK, s.window) for s in specs if s.kind in (GraphKind.CP, GraphKind.MX))
    models, runners = [], []
    for kernels in (Kernels(), NkiKernels(shapes, grid=2)):
        model = build_model(hf_config, config, kernels=kernels)
        model.load_weights(model.weights_from_hf(hf))
        models.append(model.eval())
        runners.append(GraphRunner(config, {s.name: graph_module(model, s, config) for s in specs}))
    ids = torch.randint(4, 300, (62,), generator=torch.Generator().manual_seed(3))
    blocks = [3, 5, 0, 7] if paged else [1]
    with torch.no_grad():
        for start, end in ((0, 16), (16, 32), (32, 45), (45, 50), (50, 62)):  # padded into bucket 64
            want, got = (r.prefill(ids[start:end], start, blocks) for r in runners)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        sampling = (torch.ones(1, 3), torch.zeros(1))
        args = (ids[-1:], torch.tensor([len(ids)]), [blocks], sampling, ids[:CHUNK], 0, [1] if paged else [0])
        (_, want_logits, want_chunk), (_, got_logits, got_chunk) = (
            r.decode_with_chunk(*args) for r in runners
        )
    torch.testing.assert_close(got_chunk, want_chunk, atol=1e-4, rtol=0)
    torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=0)
    for name in models[0].cache_names():
        torch.testing.assert_close(models[1].get_buffer(name), models[0].get_buffer(name), atol=1e-4, rtol=0)
    assert len(nkilib.calls) > 0 and {c["scale"] for c in nkilib.calls} == {1.0}
    assert {c["tp_q"] for c in nkilib.calls} == {True}


class StubNxd:
    """neuronx-distributed as NeuronBackend.compile drives it, with neither SDK nor compiler:
    plain torch layers at tp 1, a ModelBuilder whose trace runs the module eagerly (recording
    whether the kernel ran) and whose compile refuses the kernel probes of `refused` shapes."""

    def __init__(self, kernel, refused: set[tuple[int, int]], refuse_bundle: bool = False):
        self.kernel, self.refused, self.refuse_bundle = kernel, refused, refuse_bundle
        self.probes, self.bundles = [], []  # (tokens, window) probed; {tag: kernel ran} compiled

    def modules(self) -> dict[str, types.ModuleType]:
        def module(name: str, **attrs) -> types.ModuleType:
            m = types.ModuleType(name)
            m.__spec__ = importlib.machinery.ModuleSpec(name, None)
            m.__dict__.update(attrs)
            return m

        layers = module(
            "neuronx_distributed.parallel_layers.layers",
            ColumnParallelLinear=lambda i, o, bias, gather_output: torch.nn.Linear(i, o, bias=bias),
            RowParallelLinear=lambda i, o, bias, input_is_parallel: torch.nn.Linear(i, o, bias=bias),
            ParallelEmbedding=lambda v, h, shard_across_embedding: torch.nn.Embedding(v, h),
        )
        stub = self

        class ModelBuilder:
            def __init__(self, model):
                self.model, self.ran = model, {}

            def trace(self, args=(), kwargs=None, tag=None):
                before = len(stub.kernel.calls)
                with torch.no_grad():
                    self.model(*args, **(kwargs or {}))
                self.ran[tag] = len(stub.kernel.calls) > before

            def compile(self, priority_model_key, compiler_workdir, compiler_args):
                if isinstance(self.model, KernelProbe):
                    stub.probes.append((self.model.tokens, self.model.window))
                    if stub.probes[-1] in stub.refused:
                        raise RuntimeError("NCC_EXXX: the kernel's tiles do not fit")
                else:
                    stub.bundles.append(self.ran)
                    if stub.refuse_bundle and any(self.ran.values()):
                        raise RuntimeError("NCC_EYYY: the bundle does not fit")
                return types.SimpleNamespace(save=lambda path: Path(path).write_bytes(b"bundle"))

        return {
            "torch_neuronx": module("torch_neuronx"),
            "neuronx_distributed": module(
                "neuronx_distributed",
                ModelBuilder=ModelBuilder,
                NxDParallelState=lambda **_: contextlib.nullcontext(),
            ),
            "neuronx_distributed.parallel_layers": module(
                "neuronx_distributed.parallel_layers", layers=layers
            ),
            layers.__name__: layers,
        }


@pytest.mark.parametrize("refuse_bundle", [False, True], ids=["probe-refused", "bundle-refused"])
def test_a_shape_the_compiler_refuses_costs_only_its_graphs(nkilib, monkeypatch, tmp_path, refuse_bundle):
    """NeuronBackend.compile under --attention-kernel auto (NxD stubbed): the kernel compiled
    alone per shape first; a refused shape takes its graphs off the kernel and the bundle
    compiles once. A bundle refused after the probes passed compiles again with the reference."""
    from rich.console import Console

    from optimum_neuron_chunked.export import pipeline

    stub = StubNxd(nkilib, refused={(CHUNK, SEQ)}, refuse_bundle=refuse_bundle)
    for name, module in stub.modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    console = Console(record=True, width=300)
    out = pipeline.export(str(checkpoint_path("llama")), tmp_path / "out", batch_size=2, sequence_length=SEQ,
                          prefill_chunk_size=CHUNK, context_buckets=(32, SEQ), backend="neuron",
                          instance_type="trn2", dtype="bfloat16", console=console)  # fmt: skip
    said = console.export_text()
    assert "attention: nkilib attention_cte in cp_w32, cp_w64" in said
    assert sorted(stub.probes) == [(CHUNK, 32), (CHUNK, SEQ)]
    assert stub.bundles[0] == {
        "tg_w32": False,
        "cp_w32": True,
        "tg_w64": False,
        "cp_w64": False,
        "copy": False,
    }
    if refuse_bundle:  # the residual fallback: every graph again, none through the kernel
        assert len(stub.bundles) == 2 and not any(stub.bundles[1].values())
        assert "rejected the NKI attention kernel in cp_w32: RuntimeError: NCC_EYYY" in said
        assert NeuronConfig.load(out).nki_attention == ()
    else:
        assert "refused the NKI attention kernel alone in cp_w64" in said
        assert len(stub.bundles) == 1 and NeuronConfig.load(out).nki_attention == ("cp_w32",)
    assert NeuronConfig.load(out).nki_limits == STRICTEST.to_dict()


def test_the_graphs_that_run_the_kernel_are_recorded_and_logged_at_load(monkeypatch, tmp_path, caplog):
    from rich.console import Console

    from optimum_neuron_chunked.backends.eager import EagerBackend
    from optimum_neuron_chunked.export import pipeline

    class AcceptingCompiler(EagerBackend):
        def attention_kernels(self, config, spec, specs, head=None):
            return ("cp_w64",), {}, {}

    monkeypatch.setattr(pipeline, "get_backend", lambda name: AcceptingCompiler())
    out = pipeline.export(str(checkpoint_path("llama")), tmp_path / "out", batch_size=2, sequence_length=SEQ,
                          prefill_chunk_size=CHUNK, backend="eager", console=Console(quiet=True))  # fmt: skip
    assert NeuronConfig.load(out).nki_attention == ("cp_w64",)
    with caplog.at_level("WARNING"):
        GraphRunner.load(out)
    assert "prefill chunks attend through nkilib attention_cte in cp_w64" in caplog.text


def test_dc_graphs_that_run_the_kernel_are_recorded(nkilib, monkeypatch, tmp_path):
    """An EAGLE3 export (NxD stubbed): a DC graph's first pass runs the kernel where its CP twin
    (same width and bucket) does, so the record names it: the graphs that called the kernel
    while traced are exactly those the config records and the export says."""
    from rich.console import Console

    from optimum_neuron_chunked.export import pipeline

    stub = StubNxd(nkilib, refused=set())
    for name, module in stub.modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    console = Console(record=True, width=300)
    head = cached_head(cache_root(), TINY_LLAMA_HEAD, 1)
    out = pipeline.export(str(checkpoint_path("llama")), tmp_path / "out", batch_size=2, sequence_length=SEQ,
                          prefill_chunk_size=CHUNK, context_buckets=(32, SEQ), backend="neuron",
                          instance_type="trn2", dtype="bfloat16", speculation_length=2,
                          speculation_head=str(head), console=console)  # fmt: skip
    recorded = NeuronConfig.load(out).nki_attention
    assert recorded == ("cp_w32", "dc_w32", "cp_w64", "dc_w64")
    assert [name for name, ran in stub.bundles[0].items() if ran] == list(recorded)
    assert "attention: nkilib attention_cte in cp_w32, dc_w32, cp_w64, dc_w64;" in console.export_text()


@pytest.mark.parametrize("instance_type", ["trn1", "inf2"])
def test_neuroncore_v2_exports_keep_the_reference_attention(nkilib, monkeypatch, tmp_path, instance_type):
    """trn1 / inf2 (NxD stubbed): no kernel graph, no probe, and why in the export's first lines."""
    from rich.console import Console

    from optimum_neuron_chunked.export import pipeline

    stub = StubNxd(nkilib, refused=set())
    for name, module in stub.modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn1")
    console = Console(record=True, width=300)
    out = pipeline.export(str(checkpoint_path("llama")), tmp_path / "out", batch_size=2, sequence_length=SEQ,
                          prefill_chunk_size=CHUNK, backend="neuron", instance_type=instance_type,
                          dtype="bfloat16", console=console)  # fmt: skip
    assert (
        console.export_text().splitlines()[0]
        == f"attention: reference in cp_w64, tg_w64, copy ({NEURONCORE_V2})"
    )
    assert stub.probes == [] and not any(stub.bundles[0].values())
    assert NeuronConfig.load(out).nki_attention == () and NeuronConfig.load(out).nki_limits == {}


@pytest.mark.parametrize("nki_version", [None, "0.2.0"])
def test_the_kernel_asked_for_on_trn1_is_refused_before_any_work(
    nkilib, monkeypatch, tmp_path, capsys, nki_version
):
    """--attention-kernel nki --instance_type trn1: exit 2 naming the target and the SDKs, before
    any file, trace or compile; an nki older than 0.3.0 here (SDK 2.28) is named."""
    from optimum_neuron_chunked.export.cli import main

    stub = StubNxd(nkilib, refused=set())
    for name, module in stub.modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    if nki_version:
        monkeypatch.setattr(sys.modules["nki"], "__version__", nki_version, raising=False)
    args = ["--model", str(checkpoint_path("llama")), "--batch_size", "1", "--sequence_length", str(SEQ),
            "--backend", "neuron", "--instance_type", "trn1", "--dtype", "bfloat16", "--attention-kernel", "nki"]  # fmt: skip
    assert main([*args, str(tmp_path / "out")]) == 2
    said = " ".join(capsys.readouterr().err.split())
    assert "no NKI kernel runs on trn1 with the Neuron SDKs this package admits (2.29.0 to" in said
    assert ("nki 0.2.0 is installed here" in said) == bool(nki_version)
    assert ("SDK 2.28 is not admitted by the neuron extra" in said) == bool(nki_version)
    assert list(tmp_path.iterdir()) == [] and stub.probes == stub.bundles == []
