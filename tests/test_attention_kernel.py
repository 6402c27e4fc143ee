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
from fixtures.export_models import checkpoint_path
from transformers import AutoConfig, AutoModelForCausalLM

from optimum_neuron_chunked.backends.neuron.attention_choice import (
    KERNEL_MODULE,
    STRICTEST,
    choose_nki_graphs,
)
from optimum_neuron_chunked.backends.neuron.kernel_probe import KernelProbe
from optimum_neuron_chunked.backends.neuron.nki_kernels import NkiKernels
from optimum_neuron_chunked.config import NeuronConfig, NeuronConfigError
from optimum_neuron_chunked.graph_runner import GraphRunner
from optimum_neuron_chunked.graphs import GraphKind, graph_module, graph_specs
from optimum_neuron_chunked.modeling import build_model, family_spec
from optimum_neuron_chunked.modeling.kernels import Kernels
from optimum_neuron_chunked.testing.nki_stand_in import installed

CHUNK, SEQ = 16, 64


@pytest.fixture
def nkilib():
    """The stand-in kernel (testing/nki_stand_in.py) in sys.modules; yields its jitted form."""
    with installed() as kernel:
        yield kernel


def neuron_config(**fields) -> NeuronConfig:
    shape = dict(batch_size=2, sequence_length=SEQ, prefill_chunk_size=CHUNK, context_buckets=(32, SEQ))
    return NeuronConfig(**(dict(backend="neuron", instance_type="trn1") | shape | fields))


def test_attention_kernel_choice_per_graph(nkilib, monkeypatch):
    """NxD Inference's rules per target (trn1: chunks of 512+, no sinks; trn2: any width), the
    installed kernel's limits (its module constants, else 2.28's), refusals by graph."""
    spec = family_spec(AutoConfig.from_pretrained(checkpoint_path("llama")))
    config = neuron_config(dtype="bfloat16", mixed_step=True, prefill_widths=(8, CHUNK), instance_type="trn2")
    chosen, reasons, limits = choose_nki_graphs(config, spec, graph_specs(config))
    kinds = {s.name: s.kind for s in graph_specs(config)}
    assert {kinds[n] for n in chosen} == {GraphKind.CP, GraphKind.MX} and len(chosen) == 6
    assert {r for n, r in reasons.items() if kinds[n] is GraphKind.TG} == {
        "decode rows keep the reference attention"
    }
    assert limits == STRICTEST  # the stand-in states no limits
    trn1 = replace(config, instance_type="trn1")
    chosen, reasons, _ = choose_nki_graphs(trn1, spec, graph_specs(trn1))
    assert chosen == () and "on trn1 the kernel serves chunks of 512+ tokens" in reasons["cp_w64"]
    wide = neuron_config(
        dtype="bfloat16", sequence_length=1024, prefill_chunk_size=512, context_buckets=(1024,)
    )
    assert choose_nki_graphs(wide, spec, graph_specs(wide))[0] == ("cp_w1024",)
    sinks = family_spec(AutoConfig.from_pretrained(checkpoint_path("gpt_oss")))
    assert "sinks are not supported" in choose_nki_graphs(wide, sinks, graph_specs(wide))[1]["cp_w1024"]
    assert choose_nki_graphs(replace(wide, instance_type="trn2"), sinks, graph_specs(wide))[0] == (
        "cp_w1024",
    )
    long = neuron_config(dtype="bfloat16", sequence_length=131072, prefill_chunk_size=512, context_buckets=(131072,),
                         instance_type="trn2")  # fmt: skip
    assert "exceeds the kernel's 36864" in choose_nki_graphs(long, spec, graph_specs(long))[1]["cp_w131072"]
    nkilib.module._MAX_BS, nkilib.module._MAX_SEQLEN, nkilib.module._MAX_HEAD_DIM = 512, 131072, 128  # 2.29
    chosen, _, limits = choose_nki_graphs(long, spec, graph_specs(long))
    assert chosen == ("cp_w131072",) and (limits.max_batch, limits.max_positions) == (512, 131072)
    assert choose_nki_graphs(neuron_config(dtype="bfloat16", attention_kernel="reference"), spec, [])[0] == ()
    fp32 = neuron_config(attention_kernel="nki", instance_type="trn2")
    with pytest.raises(NeuronConfigError, match=r"nki: cp_w32: the export is float32 .* --dtype bfloat16"):
        choose_nki_graphs(fp32, spec, graph_specs(fp32))
    assert choose_nki_graphs(neuron_config(), spec, graph_specs(neuron_config()))[0] == ()  # auto: fp32
    monkeypatch.setitem(sys.modules, KERNEL_MODULE, None)  # nkilib cannot import
    chosen, reasons, _ = choose_nki_graphs(config, spec, graph_specs(config))
    assert chosen == () and "does not import" in reasons["cp_w32"]
    with pytest.raises(NeuronConfigError, match="--attention-kernel nki calls AWS's NKI kernel"):
        NeuronConfig(batch_size=2, sequence_length=SEQ, backend="cpu", attention_kernel="nki")


@pytest.mark.parametrize(
    "family, paged, native_gqa",
    [("llama", False, False), ("llama", True, True), ("gemma3_text", False, True),
     ("gemma3_text", True, False), ("gpt_oss", True, True)],
)  # fmt: skip
def test_chunks_through_the_kernel_equal_the_reference(nkilib, family, paged, native_gqa):
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
    for kernels in (Kernels(), NkiKernels(shapes, native_gqa=native_gqa, grid=2)):
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
    assert {c["tp_q"] for c in nkilib.calls} == {native_gqa}


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
        def attention_kernels(self, config, spec, specs):
            return ("cp_w64",), {}, {}

    monkeypatch.setattr(pipeline, "get_backend", lambda name: AcceptingCompiler())
    out = pipeline.export(str(checkpoint_path("llama")), tmp_path / "out", batch_size=2, sequence_length=SEQ,
                          prefill_chunk_size=CHUNK, backend="eager", console=Console(quiet=True))  # fmt: skip
    assert NeuronConfig.load(out).nki_attention == ("cp_w64",)
    with caplog.at_level("WARNING"):
        GraphRunner.load(out)
    assert "prefill chunks attend through nkilib attention_cte in cp_w64" in caplog.text
