"""LoRA graphs on torch-xla's device (the neuron backend's bundle) against the same graphs eager,
rows of two adapters and the base in every graph kind: static HLO, no host fallback, the slots
as device parameters written between calls (XlaRuntime.write_slot)."""

from __future__ import annotations

import pytest
import torch
from fixtures.export_models import cache_root, checkpoint_path
from helpers import HLO_CENSUS
from transformers import AutoConfig, AutoModelForCausalLM

from optimum_neuron_chunked.backends.base import parameter_slot_writer
from optimum_neuron_chunked.backends.xla import XlaRuntime, fallback_ops, reset_counters
from optimum_neuron_chunked.config import NeuronConfig
from optimum_neuron_chunked.graph_runner import GraphRunner
from optimum_neuron_chunked.graphs import graph_module, graph_specs
from optimum_neuron_chunked.lora_adapter import read_adapter
from optimum_neuron_chunked.modeling import build_model
from optimum_neuron_chunked.modeling.family import family_spec
from optimum_neuron_chunked.modeling.lora import NO_ADAPTER, LoraSpec
from optimum_neuron_chunked.modeling.sampler import sampling_params
from optimum_neuron_chunked.testing.lora_adapters import write_adapter

pytestmark = pytest.mark.xla

TOLERANCE = 1e-4
GREEDY = torch.tensor([sampling_params(temperature=0.0)] * 2)
RAND = torch.tensor([0.5, 0.3])


def config(**options) -> NeuronConfig:
    return NeuronConfig(batch_size=2, sequence_length=128, context_buckets=(64, 128), backend="neuron",
                        instance_type="trn1", max_loras=2, max_lora_rank=8, **options)  # fmt: skip


def runners(cfg: NeuronConfig) -> tuple[GraphRunner, GraphRunner, XlaRuntime]:
    """(eager, xla) runners over the same weights, two adapters written into both."""
    path = checkpoint_path("llama")
    hf_config = AutoConfig.from_pretrained(path)
    eager_model = build_model(hf_config, cfg)
    weights = eager_model.weights_from_hf(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    eager_model.load_weights(weights)
    xla_model = build_model(hf_config, cfg, functional_cache=True)
    xla_model.load_weights(weights)
    runtime = XlaRuntime(xla_model, cfg, graph_specs(cfg))
    eager_graphs = {s.name: graph_module(eager_model.eval(), s, cfg) for s in graph_specs(cfg)}
    eager = GraphRunner(cfg, eager_graphs, hf_config, parameter_slot_writer(eager_model, cfg))
    device = GraphRunner(cfg, runtime.graphs(), hf_config, runtime.write_slot)
    root, spec = cache_root() / "adapters", family_spec(hf_config)
    for slot, (seed, rank) in enumerate([(11, 8), (12, 4)]):
        folder = write_adapter(
            path, root / f"xla-{seed}", seed, rank, scale=1.0
        )  # fp32-conditioned: see test_lora
        adapter = read_adapter(folder, spec, LoraSpec.of(cfg), torch.float32)
        eager.write_adapter(slot, adapter)
        device.write_adapter(slot, adapter)
    return eager, device, runtime


def same(call, eager: GraphRunner, device: GraphRunner, *args, **kwargs) -> None:
    with torch.no_grad():
        want = getattr(eager, call)(*args, **kwargs)
    got = getattr(device, call)(*args, **kwargs)
    for w, g in zip(
        want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,), strict=True
    ):
        if w is not None:
            torch.testing.assert_close(g, w, atol=TOLERANCE, rtol=0)


def check_hlo(runtime: XlaRuntime, kind: str) -> None:
    assert fallback_ops() == []
    for name, report in runtime.hlo.items():
        assert report.forbidden == [] and report.dynamic_shapes == [], name
        HLO_CENSUS[f"llama lora {kind} {name}"] = report


def ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(4, 380, (n,), generator=torch.Generator().manual_seed(seed))


def test_chunked_and_mixed_lora_graphs_on_xla_equal_eager():
    eager, device, runtime = runners(config(prefill_chunk_size=32, mixed_step=True))
    reset_counters()
    a, b = ids(40, 1), ids(96, 2)
    same("prefill", eager, device, a[:32], 0, (0,), adapter=0)
    same("prefill", eager, device, a[32:], 32, (0,), adapter=0)
    row = (torch.tensor([7]), torch.tensor([40]), [(0,)], (GREEDY[:1], RAND[:1]))
    for start in (0, 32, 64):  # a decodes under adapter 0 beside b's chunks under adapter 1
        same(
            "decode_with_chunk",
            eager,
            device,
            *row,
            b[start : start + 32],
            start,
            (1,),
            adapters=[0],
            chunk_adapter=1,
        )
        row = (row[0], row[1] + 1, *row[2:])
    rows = (torch.tensor([7, 9]), torch.tensor([43, 96]), [(0,), (1,)], (GREEDY, RAND))
    same("decode", eager, device, *rows, adapters=[NO_ADAPTER, 1])
    check_hlo(runtime, "chunked")


def test_standard_and_verify_lora_graphs_on_xla_equal_eager():
    eager, device, runtime = runners(config(speculation_length=2))
    reset_counters()
    same("prefill", eager, device, ids(50, 3), 0, (0,), adapter=1)
    same("prefill", eager, device, ids(30, 4), 0, (1,), adapter=0)
    rows = [torch.tensor([5, 6, 7]), torch.tensor([8])]
    same("verify", eager, device, rows, torch.tensor([50, 30]), [(0,), (1,)], adapters=[1, NO_ADAPTER])
    check_hlo(runtime, "standard")
