"""AWS's NKI attention kernel for prefill chunks (nkilib attention_cte) in the neuron backend:
which graphs run it (decided at export, refused by name under --attention-kernel nki), and
what NkiKernels computes with it, against the reference attention.

No nkilib runs here: testing/nki_stand_in.py puts a stand-in `nki` / attention_cte in
sys.modules, computing the kernel's documented semantics (written down independently of
nki_kernels.py). tests/nkilib_source_check.py runs AWS's own torch reference by hand instead.
"""

from __future__ import annotations

import sys

import pytest
import torch
from fixtures.export_models import checkpoint_path
from transformers import AutoConfig, AutoModelForCausalLM

from optimum_neuron_chunked.backends.neuron.attention_choice import KERNEL_MODULE, choose_nki_graphs
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
    return NeuronConfig(backend="neuron", instance_type="trn1", **(shape | fields))


def test_attention_kernel_choice_per_graph(nkilib, monkeypatch):
    spec = family_spec(AutoConfig.from_pretrained(checkpoint_path("llama")))
    config = neuron_config(dtype="bfloat16", mixed_step=True, prefill_widths=(8, CHUNK))
    chosen, reasons = choose_nki_graphs(config, spec, graph_specs(config))
    kinds = {s.name: s.kind for s in graph_specs(config)}
    assert {kinds[n] for n in chosen} == {GraphKind.CP, GraphKind.MX} and len(chosen) == 6
    assert {r for n, r in reasons.items() if kinds[n] is GraphKind.TG} == {
        "decode rows keep the reference attention"
    }
    assert choose_nki_graphs(neuron_config(dtype="bfloat16", attention_kernel="reference"), spec, [])[0] == ()
    fp32 = neuron_config(attention_kernel="nki")
    with pytest.raises(NeuronConfigError, match=r"nki: cp_w32: the export is float32 .* --dtype bfloat16"):
        choose_nki_graphs(fp32, spec, graph_specs(fp32))
    assert choose_nki_graphs(neuron_config(), spec, graph_specs(neuron_config()))[0] == ()  # auto: fp32
    monkeypatch.setitem(sys.modules, KERNEL_MODULE, None)  # nkilib cannot import
    chosen, reasons = choose_nki_graphs(config, spec, graph_specs(config))
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
    reference) and paged (sliding windows, gpt-oss's sinks): the logits and every cache entry
    equal the reference's (padded copies write the last real token's K/V), and the kernel ran."""
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
    ids = torch.randint(4, 300, (50,), generator=torch.Generator().manual_seed(3))
    blocks = [3, 5, 0, 7] if paged else [1]
    with torch.no_grad():
        for start in (0, 16, 32, 45):  # 45: a padded chunk (5 of 16) into bucket 64
            end = min(start + CHUNK, len(ids))
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


def test_a_kernel_the_compiler_rejects_is_compiled_again_with_the_reference(monkeypatch, tmp_path):
    """--attention-kernel auto: the first compile raises KernelCompileError for the chosen
    graphs; the export says so, compiles again with the reference and records none."""
    from rich.console import Console

    from optimum_neuron_chunked.backends import KernelCompileError
    from optimum_neuron_chunked.backends.eager import EagerBackend
    from optimum_neuron_chunked.export import pipeline

    compiled = []

    class RejectingCompiler(EagerBackend):
        def attention_kernels(self, config, spec, specs):
            return ("cp_w64",), {"tg_w64": "decode rows keep the reference attention"}

        def compile(self, model, config, specs, out_dir, on_graph):
            compiled.append(config.nki_attention)
            if config.nki_attention:
                raise KernelCompileError("NCC_EXXX: the kernel's tiles do not fit")

    monkeypatch.setattr(pipeline, "get_backend", lambda name: RejectingCompiler())
    console = Console(record=True, width=300)
    out = pipeline.export(str(checkpoint_path("llama")), tmp_path / "out", batch_size=2, sequence_length=SEQ,
                          prefill_chunk_size=CHUNK, backend="eager", console=console)  # fmt: skip
    said = console.export_text()
    assert "attention: nkilib attention_cte in cp_w64; reference in tg_w64 (decode rows" in said
    assert "rejected the NKI attention kernel in cp_w64" in said and "NCC_EXXX" in said
    assert compiled == [("cp_w64",), ()] and NeuronConfig.load(out).nki_attention == ()


def test_the_graphs_that_run_the_kernel_are_recorded_and_logged_at_load(monkeypatch, tmp_path, caplog):
    from rich.console import Console

    from optimum_neuron_chunked.backends.eager import EagerBackend
    from optimum_neuron_chunked.export import pipeline

    class AcceptingCompiler(EagerBackend):
        def attention_kernels(self, config, spec, specs):
            return ("cp_w64",), {}

    monkeypatch.setattr(pipeline, "get_backend", lambda name: AcceptingCompiler())
    out = pipeline.export(str(checkpoint_path("llama")), tmp_path / "out", batch_size=2, sequence_length=SEQ,
                          prefill_chunk_size=CHUNK, backend="eager", console=Console(quiet=True))  # fmt: skip
    assert NeuronConfig.load(out).nki_attention == ("cp_w64",)
    with caplog.at_level("WARNING"):
        GraphRunner.load(out)
    assert "prefill chunks attend through nkilib attention_cte in cp_w64" in caplog.text
