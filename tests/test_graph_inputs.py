"""Graph inputs as every backend feeds them: integers as graphs.INDEX_DTYPE (int32, what the
Neuron runtime takes), for every graph kind and both cache-write paths (in place for cpu and
eager, functional as the neuron backend traces it)."""

from __future__ import annotations

import pytest
import torch
from fixtures.export_models import checkpoint_path
from transformers import AutoConfig, AutoModelForCausalLM

from optimum_neuron_chunked.config import NeuronConfig
from optimum_neuron_chunked.graph_runner import GraphRunner
from optimum_neuron_chunked.graphs import INDEX_DTYPE, example_inputs, graph_module, graph_specs
from optimum_neuron_chunked.modeling import build_model
from optimum_neuron_chunked.modeling.sampler import sampling_params


def as_tuple(outputs) -> tuple:
    return outputs if isinstance(outputs, tuple) else (outputs,)


def configs() -> list[NeuronConfig]:
    return [
        NeuronConfig(batch_size=2, sequence_length=64, prefill_chunk_size=16, context_buckets=(32, 64)),
        NeuronConfig(batch_size=2, sequence_length=64, context_buckets=(32, 64)),
        NeuronConfig(
            batch_size=2, sequence_length=64, prefill_chunk_size=16, context_buckets=(32, 64), mixed_step=True
        ),
        NeuronConfig(
            batch_size=2,
            sequence_length=64,
            prefill_chunk_size=16,
            context_buckets=(32, 64),
            mixed_step=True,
            kv_cache_blocks=12,
            kv_block_size=8,
        ),
    ]


def model(config: NeuronConfig, functional_cache: bool):
    path = checkpoint_path("llama")
    m = build_model(AutoConfig.from_pretrained(path), config, functional_cache=functional_cache)
    m.load_weights(m.weights_from_hf(AutoModelForCausalLM.from_pretrained(path)))
    return m.eval()


@pytest.mark.parametrize("config", configs(), ids=["chunked", "standard", "mixed", "paged"])
@pytest.mark.parametrize("functional_cache", [False, True], ids=["in-place", "functional"])
def test_every_graph_takes_int32_inputs(config, functional_cache):
    int32_model, int64_model = model(config, functional_cache), model(config, functional_cache)
    for spec in graph_specs(config):
        inputs = example_inputs(spec, config)
        integers = [x.dtype for x in inputs if not x.is_floating_point()]
        assert integers == [INDEX_DTYPE] * (6 if spec.kind == "mx" else min(3, len(inputs)))
        widened = [x.long() if x.dtype == INDEX_DTYPE else x for x in inputs]
        with torch.no_grad():
            got = graph_module(int32_model, spec, config)(*inputs)
            want = graph_module(int64_model, spec, config)(*widened)
        for a, b in zip(as_tuple(got), as_tuple(want), strict=True):
            torch.testing.assert_close(a, b)


def test_the_runner_feeds_int32():
    config = configs()[2]
    seen = []

    def record(kind):
        def graph(*inputs):
            seen.append((kind, [x.dtype for x in inputs if not x.is_floating_point()]))
            v = 8
            if kind == "cp":
                return torch.zeros(1, v)
            return (
                torch.zeros(2, dtype=torch.long),
                torch.zeros(2, v),
                *([torch.zeros(1, v)] * (kind == "mx")),
            )

        return graph

    runner = GraphRunner(config, {s.name: record(s.kind) for s in graph_specs(config)})
    runner.prefill(torch.tensor([3, 4, 5]), 0, (1,))
    params = torch.tensor([sampling_params(temperature=0.0)])
    runner.decode(torch.tensor([3]), torch.tensor([3]), [[1]], (params, torch.zeros(1)))
    runner.decode_with_chunk(
        torch.tensor([3]),
        torch.tensor([3]),
        [[1]],
        (params, torch.zeros(1)),
        torch.arange(16),
        0,
        (0,),
    )
    assert seen == [("cp", [INDEX_DTYPE] * 3), ("tg", [INDEX_DTYPE] * 3), ("mx", [INDEX_DTYPE] * 6)]


def test_a_decode_step_refuses_two_rows_writing_one_block():
    config = configs()[0]
    runner = GraphRunner(config, {})
    params = torch.tensor([sampling_params(temperature=0.0)] * 2)
    with pytest.raises(ValueError, match="distinct blocks"):
        runner.decode(torch.tensor([3, 4]), torch.tensor([3, 5]), [[1], [1]], (params, torch.zeros(2)))


class DeviceBuffer:
    """A graph output left on the device until `.cpu()` (the neuron backend's TG outputs)."""

    def __init__(self, value: torch.Tensor, fetched: list[str], name: str):
        self.value, self.fetched, self.name = value, fetched, name

    def cpu(self) -> torch.Tensor:
        self.fetched.append(self.name)
        return self.value


@pytest.mark.parametrize("need_logits", [False, True])
def test_a_step_sampled_on_device_fetches_tokens_not_logits(need_logits):
    config = configs()[0]
    assert config.on_device_sampling
    fetched: list[str] = []

    def tg(*inputs):
        tokens, logits = torch.tensor([7, 7]), torch.arange(16.0).reshape(2, 8)
        return DeviceBuffer(tokens, fetched, "tokens"), DeviceBuffer(logits, fetched, "logits")

    runner = GraphRunner(config, {s.name: tg for s in graph_specs(config) if s.kind == "tg"})
    params = torch.tensor([sampling_params(temperature=0.0)])
    tokens, logits = runner.decode(
        torch.tensor([3]), torch.tensor([3]), [[1]], (params, torch.zeros(1)), need_logits
    )
    assert tokens.tolist() == [7]
    if need_logits:
        assert fetched == ["tokens", "logits"] and logits.tolist() == [list(range(8))]
    else:
        assert fetched == ["tokens"] and logits is None
