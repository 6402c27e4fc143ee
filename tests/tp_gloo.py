"""Run every graph of a config through a model built with a layer factory: once at tp 1 in
the test process, once sharded across gloo ranks (torch.distributed on CPU)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from optimum_neuron_chunked.config import NeuronConfig
from optimum_neuron_chunked.graph_runner import GraphRunner
from optimum_neuron_chunked.graphs import graph_module, graph_specs
from optimum_neuron_chunked.modeling import build_model
from optimum_neuron_chunked.modeling.quantization import QuantizedLinear
from optimum_neuron_chunked.modeling.sampler import sampling_params


class DistLayers:
    """Sharded layers over torch.distributed (e.g. gloo on CPU): the sharding arithmetic of
    the neuron backend, runnable without a device. Sizes given are global, as in NxD."""

    def __init__(self, tp_degree: int):
        self.tp_degree = tp_degree

    def column(self, in_features: int, out_features: int, bias: bool, gather_output: bool = False):
        return _ColumnParallel(in_features, out_features // self.tp_degree, bias, gather_output)

    def row(self, in_features: int, out_features: int, bias: bool):
        return _RowParallel(in_features // self.tp_degree, out_features, bias)

    def embedding(self, vocab_size: int, hidden_size: int):
        return _EmbeddingParallel(vocab_size, hidden_size // self.tp_degree)

    @staticmethod
    def quantized(linear: nn.Module, spec) -> nn.Module:
        if isinstance(linear, _ColumnParallel):
            return _QuantizedColumn(linear, spec)
        return _QuantizedRow(linear, spec)

    @staticmethod
    def reduce(x: torch.Tensor) -> torch.Tensor:

        dist.all_reduce(x)
        return x


def _all_gather_last(x: torch.Tensor) -> torch.Tensor:

    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


class _ColumnParallel(nn.Linear):
    def __init__(self, in_features: int, local_out: int, bias: bool, gather_output: bool):
        super().__init__(in_features, local_out, bias=bias)
        self.gather_output = gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return _all_gather_last(y) if self.gather_output else y


class _RowParallel(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:

        y = nn.functional.linear(x, self.weight)
        dist.all_reduce(y)
        return y if self.bias is None else y + self.bias


class _QuantizedColumn(QuantizedLinear):
    def __init__(self, linear: _ColumnParallel, spec):
        super().__init__(linear, spec)
        self.gather_output = linear.gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return _all_gather_last(y) if self.gather_output else y


class _QuantizedRow(QuantizedLinear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.project(x)
        dist.all_reduce(y)
        return y if self.bias is None else y + self.bias


class _EmbeddingParallel(nn.Embedding):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return _all_gather_last(super().forward(ids))


SEQ, CHUNK, BUCKETS = 64, 16, (32, 64)
FP8_BLOCK = (8, 8)  # whole blocks per rank at tp 2 for every projection and expert of the tiny families
PROMPTS = {0: 40, 1: 13}  # slot -> prompt length: spans both buckets and a partial chunk


def configs() -> dict[str, NeuronConfig]:
    common = dict(batch_size=2, sequence_length=SEQ, context_buckets=BUCKETS, backend="eager")
    chunked = dict(common, prefill_chunk_size=CHUNK)
    return {
        "std": NeuronConfig(**common),
        "chunked": NeuronConfig(**chunked),
        **{f"chunked-{q}": NeuronConfig(**chunked, quantization=q) for q in ("int8", "fp8")},
        "chunked-fp8-blocks": NeuronConfig(**chunked, quantization="fp8", quantization_block=FP8_BLOCK),
        "chunked-lora": NeuronConfig(**chunked, max_loras=2, max_lora_rank=8),
    }


def write_adapters(model, config, rank: int, tp_degree: int, checkpoint: str) -> None:
    """Slot s of a LoRA config holds the peft adapter adapter_folders(checkpoint)[s], this rank's
    share (lora_adapter.slot_tensors: the sharding rule of the neuron backend)."""
    from optimum_neuron_chunked.backends.base import parameter_slot_writer
    from optimum_neuron_chunked.lora_adapter import read_adapter, slot_tensors

    write, lora = parameter_slot_writer(model, config), model.lora_spec
    for slot, folder in enumerate(adapter_folders(checkpoint)):
        adapter = read_adapter(folder, model.spec, lora, torch.float32)
        write(slot, lambda _, a=adapter: slot_tensors(a, model.spec, lora, tp_degree, rank))


def adapter_folders(checkpoint: str) -> list[Path]:
    from fixtures.export_models import cache_root

    from optimum_neuron_chunked.testing.lora_adapters import write_adapter

    root = cache_root() / "adapters" / f"tp-{Path(checkpoint).name}"
    return [
        write_adapter(Path(checkpoint), root / str(seed), seed, rank=8 - 4 * seed, scale=1.0)
        for seed in (0, 1)
    ]


def graph_outputs(
    checkpoint: str, config: NeuronConfig, layers=None, rank: int = 0, functional_cache: bool = False
) -> dict:
    """Graph name -> logits of each call, plus the on-device sampled tokens of TG calls.
    `checkpoint`: a transformers checkpoint, or an eager export (its stored weights sharded:
    an FP8 checkpoint's block-wise scales)."""
    model = build_model(AutoConfig.from_pretrained(checkpoint), config, layers, functional_cache)
    if (Path(checkpoint) / "neuron_config.json").is_file():
        model.load_weights(model.rank_weights(load_file(Path(checkpoint) / "model.safetensors"), rank))
    else:
        model.load_weights(model.weights_from_hf(AutoModelForCausalLM.from_pretrained(checkpoint), rank))
    if config.max_loras:  # slot s serves the rows of KV block s
        write_adapters(model, config, rank, layers.tp_degree if layers is not None else 1, checkpoint)
    calls: dict[str, list] = {}

    def recorded(name, graph):
        def call(*inputs):
            out = graph(*inputs)
            calls.setdefault(name, []).append(
                tuple(o.clone() for o in out) if isinstance(out, tuple) else out.clone()
            )
            return out

        return call

    graphs = {s.name: recorded(s.name, graph_module(model.eval(), s, config)) for s in graph_specs(config)}
    runner = GraphRunner(config, graphs)
    lora = config.max_loras > 0
    generator = torch.Generator().manual_seed(0)
    tokens = {}
    with torch.no_grad():
        for slot, n in PROMPTS.items():
            prompt = torch.randint(4, 300, (n,), generator=generator)
            if config.chunked:
                for start in range(0, n, CHUNK):
                    logits = runner.prefill(
                        prompt[start : start + CHUNK], start, (slot,), adapter=slot if lora else -1
                    )
            else:
                logits = runner.prefill(prompt, 0, (slot,))
            tokens[slot] = int(logits.argmax())
        lengths = dict(PROMPTS)
        params = torch.tensor([sampling_params(top_k=8, temperature=0.8)] * 2)
        for step in range(4):  # both slots, then slot 1 alone (a padded row)
            slots = [0, 1] if step < 3 else [1]
            ids = torch.tensor([tokens[s] for s in slots])
            pos = torch.tensor([lengths[s] for s in slots])
            rand = torch.rand(len(slots), generator=generator)
            tables = torch.tensor([[s] for s in slots])  # one whole-sequence block a slot
            out, _ = runner.decode(
                ids, pos, tables, (params[: len(slots)], rand), adapters=slots if lora else None
            )
            for s, t in zip(slots, out.tolist(), strict=True):
                tokens[s], lengths[s] = t, lengths[s] + 1
    return calls


def rank_main(rank: int, world: int, init_file: str, cases: dict, out_file: str) -> None:
    """One gloo rank: every case (checkpoint, config) through the sharded model, writing its
    KV cache as the neuron backend traces it (functional updates)."""

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results = {
            key: graph_outputs(checkpoint, config, DistLayers(world), rank, functional_cache=True)
            for key, (checkpoint, config) in cases.items()
        }
        if rank == 0:
            torch.save(results, out_file + ".partial")
            os.replace(out_file + ".partial", out_file)
    finally:
        dist.destroy_process_group()
