"""The neuron backend around the SDK: targets, cores, config rules, the traced bundle's
module and weight names, and clear refusals on a host without the SDK or a device."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json

import pytest
import torch
from fixtures.export_models import checkpoint_path
from helpers import every_graph_kind, small_neuron_config
from tp_gloo import DistLayers
from transformers import AutoConfig, AutoModelForCausalLM

from optimum_neuron_chunked.backends import BackendUnavailableError
from optimum_neuron_chunked.backends.neuron import NeuronBackend, has_neuron_device
from optimum_neuron_chunked.backends.neuron.backend import BUNDLE_INPUTS, GraphBundle, priority_graph
from optimum_neuron_chunked.backends.neuron.target import (
    TARGETS,
    compiler_args,
    instance_type_of,
    parse_visible_cores,
    require_neuron_device,
    resolve_instance_type,
    visible_cores_env,
)
from optimum_neuron_chunked.config import NeuronConfig, NeuronConfigError
from optimum_neuron_chunked.graphs import example_inputs, graph_module, graph_specs
from optimum_neuron_chunked.modeling import build_model
from optimum_neuron_chunked.modeling.parallel import TorchLayers

needs_no_sdk = pytest.mark.skipif(has_neuron_device(), reason="checks the refusal on a host without Neuron")
# The SDK-mirror environment (make test-sdk) runs this file too, under transformers 4.57.
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (main suite)")


def test_compiler_targets():
    assert "--target=trn1" in compiler_args(TARGETS["inf2"]) and "--lnc=1" in compiler_args(TARGETS["inf2"])
    assert "--target=trn2" in compiler_args(TARGETS["trn2"]) and "--lnc=2" in compiler_args(TARGETS["trn2"])
    assert instance_type_of("trn1.32xlarge\n") == "trn1"
    assert instance_type_of("trn1n.32xlarge") == "trn1"
    assert instance_type_of("inf2.48xlarge") == "inf2"
    assert instance_type_of("m7i.large") is None
    assert resolve_instance_type("trn2") == "trn2"


@needs_no_sdk
def test_instance_type_is_required_off_neuron_hosts():
    with pytest.raises(BackendUnavailableError, match=r"pass --instance_type trn1\|inf2\|trn2"):
        resolve_instance_type(None)


def test_visible_cores():
    assert parse_visible_cores("0,2,5-6") == [0, 2, 5, 6]
    assert visible_cores_env(2, None, available=8) == "0-1"
    assert visible_cores_env(2, "4-7", available=8) == "4-7"
    # data-parallel ranks on one host: rank r takes cores [r*tp, (r+1)*tp)
    assert [visible_cores_env(2, None, 8, rank, 3) for rank in range(3)] == ["0-1", "2-3", "4-5"]
    assert [visible_cores_env(2, "8-11", 16, rank, 2) for rank in range(2)] == ["8,9", "10,11"]
    with pytest.raises(BackendUnavailableError, match=r"tp_degree=4 x 3 data-parallel ranks"):
        visible_cores_env(4, None, 8, 2, 3)
    with pytest.raises(BackendUnavailableError, match=r"gives 4 NeuronCores.*x 2 data-parallel ranks"):
        visible_cores_env(4, "0-3", 8, 1, 2)
    with pytest.raises(BackendUnavailableError, match="gives 1 NeuronCores, the export needs tp_degree=2"):
        visible_cores_env(2, "3", available=8)
    with pytest.raises(BackendUnavailableError, match="has 2 NeuronCores, the export needs tp_degree=8"):
        visible_cores_env(8, None, available=2)


def test_each_data_parallel_rank_gets_its_own_neuron_cores(monkeypatch):
    """The backend hooks the vLLM layer calls: the platform's host check, the worker's device env."""
    from optimum_neuron_chunked.backends import get_backend
    from optimum_neuron_chunked.backends.neuron import backend

    eager = NeuronConfig(batch_size=2, sequence_length=64, backend="eager")
    assert get_backend("eager").device_env(eager, 1, 2) == {}
    get_backend("eager").check_serving_host(eager, 2)  # no devices to check
    monkeypatch.setattr(backend, "require_neuron_sdk", lambda: None)
    monkeypatch.setattr(backend, "require_neuron_device", lambda: None)
    monkeypatch.setattr(backend, "host_core_count", lambda target: 8)
    monkeypatch.delenv("NEURON_RT_VISIBLE_CORES", raising=False)
    neuron = NeuronBackend()
    config = neuron_config(tp=2)
    cores = [neuron.device_env(config, rank, 4)["NEURON_RT_VISIBLE_CORES"] for rank in range(4)]
    assert cores == ["0-1", "2-3", "4-5", "6-7"]
    neuron.check_serving_host(config, 4)
    with pytest.raises(BackendUnavailableError, match=r"has 8 NeuronCores.*tp_degree=2 x 5 data-parallel"):
        neuron.check_serving_host(config, 5)
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "4-7")
    assert neuron.device_env(config, 1, 2) == {"NEURON_RT_VISIBLE_CORES": "6,7"}


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(backend="cpu", instance_type="trn1"), "instance_type goes with the neuron backend"),
        (dict(backend="neuron"), "pass --instance_type trn1|inf2|trn2"),
        (dict(backend="eager", tp_degree=2), "--tensor_parallel_size 2 needs --backend neuron"),
    ],
)
def test_config_rules(fields, message):
    with pytest.raises(NeuronConfigError, match=message.replace("|", r"\|")):
        NeuronConfig(batch_size=2, sequence_length=64, **fields)


def neuron_config(tp: int = 2) -> NeuronConfig:
    return small_neuron_config(tp)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe", "gpt_oss"])
def test_weight_shards_match_the_bundle_names(tmp_path, family, tp):
    """The shards set_weights receives carry exactly the parameter names of the traced bundle
    (at tp 1 too, where a tied lm_head's shard would share the embedding's storage)."""
    from safetensors.torch import load_file

    config = neuron_config(tp)
    path = checkpoint_path(family)
    full = build_model(AutoConfig.from_pretrained(path), NeuronConfig(batch_size=2, sequence_length=64))
    full.load_weights(full.weights_from_hf(AutoModelForCausalLM.from_pretrained(path)))
    NeuronBackend().save_weights(full, config, tmp_path)
    sharded = build_model(AutoConfig.from_pretrained(path), config, DistLayers(tp), functional_cache=True)
    bundle = GraphBundle(sharded, config, graph_specs(config))
    expected = {name: t.shape for name, t in bundle.state_dict().items() if "_cache_" not in name}
    for rank, file in enumerate(NeuronBackend().weight_files(config)):
        shard = load_file(tmp_path / file)
        assert {name: t.shape for name, t in shard.items()} == expected, f"rank {rank}"


def test_priority_graph_is_the_widest_tg_in_rows_and_bucket():
    """NxD lays weights out for the priority graph: the full-batch TG at the largest bucket,
    not a narrow decode width listed after it."""
    config = dataclasses.replace(neuron_config(tp=1), decode_widths=(1, 2))
    names = [s.name for s in graph_specs(config)]
    assert {"tg_w32_r1", "tg_w64_r1", "tg_w64"} <= set(names)
    assert priority_graph(graph_specs(config)) == "tg_w64"


def nxd_trace_kwargs(module: torch.nn.Module, args: tuple) -> dict[str, torch.Tensor]:
    """What ModelBuilder.trace checks of a module and its example inputs before the closed
    HLO generation, and the keywords it then calls the module with (NxD 0.18,
    trace/functions.py `_validate_model`, `_validate_model_params`, `_validate_args`,
    `_process_example_inputs`; tests/nxd_source_check.py runs NxD's own code)."""
    params = inspect.signature(module.forward).parameters
    assert params, "Model must have at least one parameter"
    kinds = {p.kind for p in params.values()}
    assert not kinds & {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}, kinds
    assert all(p.default in (inspect.Parameter.empty, None) for p in params.values())
    assert all(isinstance(t, torch.Tensor) for t in args) and 0 < len(args) <= len(params)
    named = dict(zip(list(params)[: len(args)], args, strict=True))
    missing = [n for n, p in params.items() if p.default is inspect.Parameter.empty and n not in named]
    assert not missing, f"Missing required parameters: {missing}"
    return named


def test_every_config_covers_every_graph_kind():
    specs = [s for config in every_graph_kind().values() for s in graph_specs(config)]
    kinds = {s.kind + "-narrow" * s.narrow for s in specs}
    assert kinds == {"ce", "cp", "cp-narrow", "tg", "tg-narrow", "mx", "vf", "vf-narrow", "copy"}
    counts = {len(example_inputs(s, c)) for c in every_graph_kind().values() for s in graph_specs(c)}
    assert counts == {2, 3, 5, 6, 8}


@pytest.mark.parametrize("name", ["chunked", "chunked-host-sampling", "standard", "lora", "fp8-kv"])
def test_bundle_runs_the_selected_graph(name):
    """Each graph through the bundle, as ModelBuilder.trace calls it (keywords named after
    forward's parameters) and as the xla backend calls it (positional), equals the graph
    module alone."""
    config = every_graph_kind()[name]
    path = checkpoint_path("llama")
    hf = AutoModelForCausalLM.from_pretrained(path)
    specs = graph_specs(config)

    def fresh():
        model = build_model(AutoConfig.from_pretrained(path), config, functional_cache=True)
        model.load_weights(model.weights_from_hf(hf))
        return model.eval()

    bundle = GraphBundle(fresh(), config, specs)
    assert all(not name.startswith("_graphs") for name in bundle.state_dict())
    for spec in specs:
        inputs = example_inputs(spec, config)
        bundle.select(spec.name)
        with torch.no_grad():
            by_keyword = bundle(**nxd_trace_kwargs(bundle, inputs))
            by_position = bundle(*inputs)
            want = graph_module(fresh(), spec, config)(*inputs)
        for got in (by_keyword, by_position):
            for a, b in zip(
                got if isinstance(got, tuple) else [got],
                want if isinstance(want, tuple) else [want],
                strict=True,
            ):
                torch.testing.assert_close(a, b)
        if len(inputs) < BUNDLE_INPUTS:
            with pytest.raises(TypeError, match=f"graph {spec.name} takes inputs 0..{len(inputs) - 1}"):
                bundle(*inputs, inputs[-1])
        with pytest.raises(TypeError):
            bundle(*inputs[:-1])


@needs_no_sdk
def test_loading_a_neuron_export_without_the_sdk_says_so(tmp_path):
    from optimum_neuron_chunked import NeuronModelForCausalLM

    out = tmp_path / "export"
    out.mkdir()
    config = neuron_config()
    config.save(out)
    AutoConfig.from_pretrained(checkpoint_path("llama")).save_pretrained(out)
    for file in NeuronBackend().weight_files(config) + ["graphs/nxd_model.pt"]:
        (out / file).parent.mkdir(exist_ok=True)
        (out / file).write_bytes(b"")
    assert json.loads((out / "neuron_config.json").read_text())["instance_type"] == "trn1"
    with pytest.raises(BackendUnavailableError, match="Neuron SDK"):
        NeuronModelForCausalLM.from_pretrained(out)


@needs_vllm
def test_sdk_imports_stay_lazy():
    code = (
        "import sys, optimum_neuron_chunked.backends.neuron, optimum_neuron_chunked.export.pipeline, optimum_neuron_chunked.vllm.platform; "
        "print(sorted(m for m in sys.modules if m.startswith(('neuronx_distributed', 'torch_neuronx'))))"
    )
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


@needs_vllm
@needs_no_sdk
def test_platform_refuses_a_neuron_export_off_neuron_hosts():
    from vllm.config import ParallelConfig

    from optimum_neuron_chunked.vllm.platform import check_serving_host

    with pytest.raises(BackendUnavailableError, match="Neuron SDK"):
        check_serving_host(neuron_config(), ParallelConfig())
    with pytest.raises(
        BackendUnavailableError, match=r"no Neuron device \(/dev/neuron\*\): run it on a trn1"
    ):
        require_neuron_device()


class AliasingLayers:
    """Layers that also register their weight as `master_weight` (the same Parameter), as
    neuronx-distributed's parallel layers do when built inside NxDParallelState. Like NxD's
    layers, they are not plain torch layers, so lm_head is not tied to the embedding."""

    tp_degree = 1

    def column(self, in_features, out_features, bias, gather_output=False):
        return _with_master_weight(TorchLayers().column(in_features, out_features, bias))

    def row(self, in_features, out_features, bias):
        return _with_master_weight(TorchLayers().row(in_features, out_features, bias))

    def embedding(self, vocab_size, hidden_size):
        return _with_master_weight(TorchLayers().embedding(vocab_size, hidden_size))


def _with_master_weight(layer):
    layer.register_parameter("master_weight", layer.weight)
    return layer


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_weights_are_named_once_when_layers_alias_them(family):
    path = checkpoint_path(family)
    config = NeuronConfig(batch_size=2, sequence_length=64)
    hf_config = AutoConfig.from_pretrained(path)
    plain = build_model(hf_config, config)
    plain.load_weights(plain.weights_from_hf(AutoModelForCausalLM.from_pretrained(path)))
    aliased = build_model(hf_config, config, AliasingLayers(), functional_cache=True)
    assert any(name.endswith("master_weight") for name in aliased.state_dict())
    full = plain.unsharded_weights()  # lm_head included even when tied
    assert sorted(aliased.weight_names()) == sorted(full)
    aliased.load_weights(aliased.rank_weights(full, 0))
    assert sorted(aliased.stored_weights()) == sorted(full)
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        torch.testing.assert_close(
            aliased.hidden_states(ids, torch.arange(3)[None], torch.tensor([[0]]), 64),
            plain.hidden_states(ids, torch.arange(3)[None], torch.tensor([[0]]), 64),
        )


class RankedNxDModel:
    """NxDModel.forward's calling convention (NxD 0.18): default mode takes tensors; the other
    modes take each input as one tensor per rank and return each output per rank."""

    local_ranks_size = 2

    def __init__(self):
        self.calls = []

    def forward(self, *args, model_name, forward_mode="default"):
        self.calls.append((model_name, forward_mode))
        if forward_mode == "default":
            return args[0] + 1
        assert all(len(per_rank) == self.local_ranks_size for per_rank in args)
        return [[x + rank for rank in range(self.local_ranks_size)] for x in (args[0][0], args[1][0])]


def test_tg_outputs_stay_on_the_device_until_fetched():
    from optimum_neuron_chunked.backends.neuron.backend import NeuronGraph

    nxd = RankedNxDModel()
    tokens, logits = NeuronGraph(nxd, "tg_w64", lazy_outputs=True)(torch.tensor([1]), torch.tensor([2]))
    assert (tokens.item(), logits.item()) == (1, 2)  # rank 0's outputs
    assert NeuronGraph(nxd, "cp_w64")(torch.tensor([1])).item() == 2
    assert nxd.calls == [("tg_w64", "async"), ("cp_w64", "default")]


class SlotNxDModel:
    """What write_device_slot touches of a loaded NxDModel (NxD 0.18, trace/nxd_model/nxd_model.py):
    `weights`, one dict per local rank of the tensors set_weights loaded, and local_ranks_size."""

    def __init__(self, weights: list[dict[str, torch.Tensor]]):
        self.weights, self.local_ranks_size = weights, len(weights)


def test_an_adapter_slot_is_written_into_each_ranks_device_weights():
    """NeuronBackend.load's slot writer: rank r's row of the written slot holds rank r's share of
    the adapter (column-parallel b and row-parallel a split by rank, the other halves whole; targets
    the adapter lacks zero) in the export's dtype, written into the tensors set_weights loaded; the
    other slots and the base weights keep what they held."""
    from optimum_neuron_chunked.backends.neuron.backend import PREFIX, write_device_slot
    from optimum_neuron_chunked.lora_adapter import LoraAdapter, empty_slots, full_shapes, slot_tensors
    from optimum_neuron_chunked.modeling.family import family_spec
    from optimum_neuron_chunked.modeling.lora import LoraSpec

    tp, slot, dtype = 2, 1, torch.bfloat16
    config = every_graph_kind(tp)["lora"]
    spec, lora = family_spec(AutoConfig.from_pretrained(checkpoint_path("llama"))), LoraSpec.of(config)
    gen = torch.Generator().manual_seed(0)
    shapes = full_shapes(spec)
    q_a, q_b = (torch.randn(lora.rank, n, generator=gen) for n in shapes["q_proj"])
    o_a, o_b = (torch.randn(lora.rank, n, generator=gen) for n in shapes["o_proj"])
    q, o = "model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.o_proj"
    adapter = LoraAdapter("stand-in", lora.rank, {q: (q_a, q_b), o: (o_a, o_b)})
    # every value marks its rank, so a row not written, or written from another rank, shows
    weights = [
        {PREFIX + name: t + 100 + rank for name, t in empty_slots(spec, lora, dtype, tp, rank).items()}
        | {PREFIX + "model.embed_tokens.weight": torch.full((4, 8), 100.0 + rank, dtype=dtype)}
        for rank in range(tp)
    ]
    loaded = [dict(rank_weights) for rank_weights in weights]
    before = [{name: t.clone() for name, t in rank_weights.items()} for rank_weights in weights]
    nxd = SlotNxDModel(weights)
    asked = []

    def rank_tensors(rank):
        asked.append(rank)
        return slot_tensors(adapter, spec, lora, tp, rank)

    write_device_slot(nxd, dtype, slot, rank_tensors)
    assert asked == list(range(tp))
    lora_q, lora_o = (
        PREFIX + "model.layers.0.self_attn.lora.q_proj",
        PREFIX + "model.layers.1.self_attn.lora.o_proj",
    )
    for rank in range(tp):
        got = nxd.weights[rank]
        assert all(got[name] is loaded[rank][name] for name in got), "written in place, never rebound"
        want = {
            f"{lora_q}.a": q_a,
            f"{lora_q}.b": q_b.chunk(tp, dim=1)[rank],
            f"{lora_o}.a": o_a.chunk(tp, dim=1)[rank],
            f"{lora_o}.b": o_b,
        }
        assert set(want) <= set(got)
        for name, tensor in got.items():
            written = ".lora." in name
            kept = [row for row in range(len(tensor)) if not (written and row == slot)]
            torch.testing.assert_close(tensor[kept], before[rank][name][kept], rtol=0, atol=0)
            if written:
                expected = want.get(name, torch.zeros(tensor.shape[1:])).to(dtype)
                torch.testing.assert_close(tensor[slot], expected, rtol=0, atol=0, msg=f"rank {rank} {name}")


def test_the_cli_offers_every_compile_target():
    from optimum_neuron_chunked.export.cli import INSTANCE_TYPES

    assert INSTANCE_TYPES == tuple(TARGETS)
