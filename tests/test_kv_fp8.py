"""--kv-cache-dtype fp8: the pool holds float8 e4m3, every write quantizes by the layer's scale
within +-240, every read dequantizes; checked exactly against the rule (KVStorage.store) on the
K/V the same graphs write into a pool of the model's dtype, for every graph kind; checkpoint K / V
scales; vLLM's flag."""

from __future__ import annotations

import pytest
import torch
from fixtures.export_models import checkpoint_path, export_with, fp8_checkpoint_path
from helpers import greedy_rows, prompt
from transformers import AutoConfig, AutoModelForCausalLM

from optimum_neuron_chunked.config import NeuronConfig
from optimum_neuron_chunked.graph_runner import GraphRunner
from optimum_neuron_chunked.graphs import graph_module, graph_specs
from optimum_neuron_chunked.modeling import build_model
from optimum_neuron_chunked.modeling.kv_layout import KVLayout

SHAPES = dict(batch_size=2, sequence_length=128, context_buckets=(64, 128))


def runner(config: NeuronConfig):
    path = checkpoint_path("llama")
    model = build_model(AutoConfig.from_pretrained(path), config)
    model.load_weights(model.weights_from_hf(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)))
    graphs = {s.name: graph_module(model.eval(), s, config) for s in graph_specs(config)}
    return GraphRunner(config, graphs), model


def assert_layer0_pools_follow_the_rule(fp8_model, auto_model) -> None:
    """Layer 0's K/V depend on the tokens alone: the fp8 pool holds the rule applied to the auto pool's."""
    storage = fp8_model.kv.storage(0)
    for which, name in enumerate(("k_cache_0", "v_cache_0")):
        got, want = getattr(fp8_model, name), storage.store(getattr(auto_model, name), which)
        assert got.dtype == torch.float8_e4m3fn
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name


@pytest.mark.parametrize("kind", ["chunked", "standard"])
def test_every_graph_kind_writes_the_rule_and_reads_it_back(kind):
    options = (
        dict(prefill_chunk_size=32, mixed_step=True) if kind == "chunked" else dict(speculation_length=2)
    )
    (auto, auto_model), (fp8, fp8_model) = (
        runner(NeuronConfig(**SHAPES, **options, kv_cache_dtype=kv)) for kv in ("auto", "fp8")
    )
    a, b = prompt(40, seed=1), prompt(90, seed=2)
    with torch.no_grad():
        for r in (auto, fp8):
            if kind == "chunked":  # CP, MX (a decode beside b's chunk), TG, then the copy graph
                r.prefill(a[:32], 0, (0,))
                r.prefill(a[32:], 32, (0,))
                r.decode_with_chunk(
                    torch.tensor([5]), torch.tensor([40]), [(0,)], greedy_rows(1), b[:32], 0, (1,)
                )
                r.decode(torch.tensor([6, 7]), torch.tensor([41, 32]), [(0,), (1,)], greedy_rows(2))
                r.copy_prefix(0, 1, 33)
            else:  # CE, VF
                r.prefill(a, 0, (0,))
                r.prefill(b, 0, (1,))
                r.verify([torch.tensor([5, 6, 7]), torch.tensor([8])], torch.tensor([40, 90]), [(0,), (1,)])
    assert_layer0_pools_follow_the_rule(fp8_model, auto_model)
    if kind == "chunked":  # copied as stored: block 1 holds block 0's first 33 positions
        for name in ("k_cache_0", "v_cache_1"):
            pool = getattr(fp8_model, name).view(torch.uint8)
            assert torch.equal(pool[1, :, :33], pool[0, :, :33])


def test_the_pool_is_float8_half_the_bytes_of_bf16():
    spec = build_model(AutoConfig.from_pretrained(checkpoint_path("llama")), NeuronConfig(**SHAPES)).spec
    sizes = {
        (dtype, kv): KVLayout.of(NeuronConfig(**SHAPES, dtype=dtype, kv_cache_dtype=kv), spec).bytes_per_block
        for dtype, kv in (("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "fp8"), ("float32", "fp8"))
    }
    assert sizes["bfloat16", "fp8"] * 2 == sizes["bfloat16", "auto"] == sizes["float32", "auto"] // 2
    assert sizes["float32", "fp8"] == sizes["bfloat16", "fp8"]


def test_checkpoint_kv_scales_are_fitted_into_neurons_range_and_used(tmp_path):
    """compressed-tensors' kv_cache_scheme (tensor strategy, k_scale / v_scale of 0.05, calibrated
    for +-448): the export records 0.1 a layer and its model card says so."""
    from optimum_neuron_chunked.export.pipeline import export

    source = fp8_checkpoint_path("llama", "FP8_STATIC_KV")
    out = export(str(source), tmp_path / "out", backend="eager", kv_cache_dtype="fp8", **SHAPES)
    config = NeuronConfig.load(out)
    assert [s for pair in config.kv_cache_scales for s in pair] == pytest.approx([0.1] * 4)
    assert "the checkpoint's K / V scales" in (out / "README.md").read_text()


def test_greedy_tokens_of_fp8_kv_mostly_agree_with_the_models_dtype():
    """Quality on the tiny model (random weights, direct cast): the first token of every prompt."""
    from optimum_neuron_chunked.generation import prefill_prompt

    runners = {kv: GraphRunner.load(export_with("llama", "eager", **SHAPES, prefill_chunk_size=32, kv_cache_dtype=kv))
               for kv in ("auto", "fp8")}  # fmt: skip
    first = {
        kv: [int(prefill_prompt(r, prompt(50, seed=s), (0,)).argmax()) for s in range(10)]
        for kv, r in runners.items()
    }
    assert sum(a == b for a, b in zip(first["auto"], first["fp8"], strict=True)) >= 9, first


@pytest.mark.parametrize(
    "flag, expected",
    [("auto", None), ("float32", None), ("fp8", "fp8"), ("fp8_e4m3", "fp8"), ("fp8_e5m2", "not supported")],
)
def test_vllm_kv_cache_dtype_maps_to_the_export_option(flag, expected):
    from optimum_neuron_chunked.vllm.export_options import kv_cache_dtype_option
    from optimum_neuron_chunked.vllm.limits import ServingConfigError

    if expected == "not supported":
        with pytest.raises(ServingConfigError, match="--kv-cache-dtype fp8_e5m2 is not supported"):
            kv_cache_dtype_option(flag, "float32")
    else:
        assert kv_cache_dtype_option(flag, "float32") == expected


@pytest.mark.xla
def test_fp8_kv_graphs_lower_to_static_hlo_on_xla_and_equal_eager():
    from helpers import HLO_CENSUS

    from optimum_neuron_chunked.backends.xla import XlaRuntime, fallback_ops, reset_counters

    config = NeuronConfig(**SHAPES, prefill_chunk_size=32, mixed_step=True, kv_cache_dtype="fp8",
                          backend="neuron", instance_type="trn1")  # fmt: skip
    eager, model = runner(config)
    xla_model = build_model(
        AutoConfig.from_pretrained(checkpoint_path("llama")), config, functional_cache=True
    )
    xla_model.load_weights({n: t for n, t in model.state_dict().items() if n in xla_model.weight_names()})
    runtime = XlaRuntime(xla_model, config, graph_specs(config))
    device = GraphRunner(config, runtime.graphs())
    reset_counters()
    a, b = prompt(40, seed=3), prompt(64, seed=4)
    calls = [("prefill", (a[:32], 0, (0,))), ("prefill", (a[32:], 32, (0,))),
             ("decode_with_chunk", (torch.tensor([5]), torch.tensor([40]), [(0,)], greedy_rows(1), b[:32], 0, (1,))),
             ("decode", (torch.tensor([6, 7]), torch.tensor([41, 32]), [(0,), (1,)], greedy_rows(2)))]  # fmt: skip
    for call, args in calls:
        with torch.no_grad():
            want = getattr(eager, call)(*args)
        got = getattr(device, call)(*args)
        for w, g in zip(*(x if isinstance(x, tuple) else (x,) for x in (want, got)), strict=True):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=0)
    assert fallback_ops() == []
    for name, report in runtime.hlo.items():
        assert report.forbidden == [] and report.dynamic_shapes == [], name
        HLO_CENSUS[f"llama fp8-kv {name}"] = report


def test_vllm_serves_a_checkpoint_with_fp8_kv_as_the_loader_does(tmp_path, monkeypatch):
    """`vllm serve CHECKPOINT --kv-cache-dtype fp8`: the export option (in the cache key), served
    tokens equal generate() on the same export."""
    import json

    from helpers import generate, greedy
    from vllm import LLM

    from optimum_neuron_chunked import NeuronModelForCausalLM
    from optimum_neuron_chunked.export_cache import entries

    monkeypatch.setenv("ONC_EXPORT_CACHE", str(tmp_path / "cache"))
    prompts = [prompt(n, seed=60 + n) for n in (5, 40)]
    llm = LLM(model=str(checkpoint_path("llama")), seed=0, max_model_len=64, max_num_seqs=2, kv_cache_dtype="fp8",
              additional_config={"prefill_chunk_size": 16, "backend": "eager"})  # fmt: skip
    try:
        served = [list(o.token_ids) for o in generate(llm, prompts, greedy(8))]
    finally:
        llm.llm_engine.engine_core.shutdown()
    ((entry, record),) = entries()
    assert json.loads((entry / "neuron_config.json").read_text())["kv_cache_dtype"] == "fp8"
    model = NeuronModelForCausalLM.from_pretrained(entry)
    loaded = [model.generate(p[None], max_new_tokens=8, do_sample=False, eos_token_id=-1)[0, len(p) :].tolist()
              for p in prompts]  # fmt: skip
    assert served == loaded


@pytest.mark.parametrize(
    "flag, message",
    [("fp8", "--kv-cache-dtype fp8 differs from the export's KV cache (auto)"),
     ("fp8_e5m2", "--kv-cache-dtype fp8_e5m2 is not supported")],
)  # fmt: skip
def test_a_kv_cache_dtype_the_export_does_not_hold_is_refused(flag, message):
    from vllm.engine.arg_utils import EngineArgs

    export = export_with("llama", "eager", **SHAPES, prefill_chunk_size=32)
    with pytest.raises(Exception, match="") as refused:
        EngineArgs(model=str(export), kv_cache_dtype=flag).create_engine_config()
    assert message in " ".join(str(refused.value).split())


@pytest.mark.slow
def test_the_cpu_backend_compiles_fp8_weight_and_kv_graphs_that_generate_as_eager():
    """AOTInductor packages hold no weights (fp8 weights and scales are bound at load) and read an
    fp8 KV pool: tokens equal eager's on the same export options (eager's fp8 weights equal
    transformers' on the same weights, tests/test_quantization.py)."""
    from optimum_neuron_chunked import NeuronModelForCausalLM

    options = dict(SHAPES, prefill_chunk_size=32, kv_cache_dtype="fp8", quantization="fp8")
    models = [
        NeuronModelForCausalLM.from_pretrained(export_with("llama", b, **options)) for b in ("cpu", "eager")
    ]
    ids = torch.stack([prompt(40, seed=7), prompt(40, seed=8)])
    cpu, eager = (m.generate(ids, max_new_tokens=6, do_sample=False) for m in models)
    assert torch.equal(cpu, eager)
