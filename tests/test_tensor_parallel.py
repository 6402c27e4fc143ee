"""Tensor parallelism on CPU: the sharding arithmetic of the neuron backend, checked with
torch.distributed (gloo, 2 processes). Every graph kind (CE, CP, TG) of every family at
tp 2 must give the tp 1 logits, and the same on-device sampled tokens. The tp 2 ranks also
write their KV cache functionally, as the neuron backend traces it; tp 1 writes in place."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
import torch.multiprocessing as mp
from fixtures.export_models import cache_root, checkpoint_path
from tp_gloo import FP8_BLOCK, adapter_folders, configs, graph_outputs, rank_main

from optimum_neuron_chunked.config import NeuronConfigError
from optimum_neuron_chunked.modeling import family_spec
from optimum_neuron_chunked.modeling.parallel import ShardLayout, rank_shard, tp_checkpoint
from optimum_neuron_chunked.testing.checkpoints import FAMILIES, build_checkpoint, family_config

TP = 2
# Layouts the family checkpoints do not cover: KV heads neither divisible by nor dividing
# tp (converted to MHA), and a vocabulary that tp does not divide (padded).
EXTRA_LAYOUTS = {
    "llama-mha": dict(family_config("llama"), num_attention_heads=6, num_key_value_heads=3, hidden_size=96),
    "qwen2-odd-vocab": dict(family_config("qwen2"), vocab_size=641),
}


def extra_checkpoint(name: str) -> str:
    cfg = EXTRA_LAYOUTS[name]
    key = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:12]
    return str(build_checkpoint(name, cache_root() / "checkpoints" / f"{name}-{key}", config=cfg))


def fp8_export(family: str) -> str:
    """The eager export of a block-wise FP8 checkpoint of `family`: its stored weights, sharded
    by rank_weights as the neuron backend shards them."""
    from fixtures.export_models import fp8_checkpoint_path

    from optimum_neuron_chunked.export.pipeline import export
    from optimum_neuron_chunked.testing.checkpoints import checkpoint_key

    key = checkpoint_key(family)
    source = fp8_checkpoint_path(family, "block", FP8_BLOCK)
    out = cache_root() / "exports" / f"{family}-fp8-block8-eager-{key}"
    if not (out / "neuron_config.json").is_file():
        export(str(source), out, backend="eager", batch_size=2, sequence_length=64, overwrite=True)
    return str(out)


def checkpoints() -> dict[str, str]:
    paths = {f: str(checkpoint_path(f)) for f in FAMILIES} | {"qwen3_moe-fp8": fp8_export("qwen3_moe")}
    return paths | {name: extra_checkpoint(name) for name in EXTRA_LAYOUTS}


CASES = [(model, kind) for model in [*FAMILIES, *EXTRA_LAYOUTS] for kind in ("std", "chunked")]
# Quantized weights and their scales shard with the same rule: per-channel scales of column
# layers split, of row layers replicated; KV heads copied to every rank (qwen3: 1 KV head),
# split (llama), converted to MHA (llama-mha); experts' scales split by intermediate (mixtral).
CASES += [(m, "chunked-int8") for m in ("llama", "qwen3", "llama-mha", "mixtral")] + [
    ("qwen3_moe", "chunked-fp8")
]
# an FP8 checkpoint's block-wise scales (8x8: whole blocks per rank), experts' too
CASES += [("qwen3_moe-fp8", "chunked-fp8-blocks")]
# LoRA slots shard with their projections: KV heads split (llama), copied (qwen3), MHA (llama-mha)
CASES += [(m, "chunked-lora") for m in ("llama", "qwen3", "llama-mha")]


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    """(model, config kind) -> (tp 1 outputs, tp 2 outputs)."""
    paths, cfgs = checkpoints(), configs()
    cases = {(m, k): (paths[m], cfgs[k]) for m, k in CASES}
    for m, k in CASES:  # written once, before the ranks read them
        if k == "chunked-lora":
            adapter_folders(paths[m])
    tmp = tmp_path_factory.mktemp("gloo")
    out_file = str(tmp / "tp2.pt")
    mp.start_processes(
        rank_main, args=(TP, str(tmp / "init"), cases, out_file), nprocs=TP, start_method="spawn"
    )
    sharded = torch.load(out_file)
    return {key: (graph_outputs(path, cfg), sharded[key]) for key, (path, cfg) in cases.items()}


@pytest.mark.parametrize("model,kind", CASES, ids=[f"{m}-{k}" for m, k in CASES])
def test_tp2_graphs_equal_tp1(tp_results, model, kind):
    single, sharded = tp_results[(model, kind)]
    expected_graphs = {"ce" if kind == "std" else "cp", "tg"}
    assert {name.split("_")[0] for name in single} == expected_graphs
    assert single.keys() == sharded.keys()
    for name, calls in single.items():
        assert len(calls) == len(sharded[name])
        for i, (a, b) in enumerate(zip(calls, sharded[name], strict=True)):
            if name.startswith("tg"):
                assert torch.equal(a[0], b[0]), f"{name} call {i}: sampled tokens differ"
                a, b = a[1], b[1]
            assert a.shape[-1] == family_spec_vocab(model)
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4, msg=f"{name} call {i}")


def family_spec_vocab(model: str) -> int:
    cfg = EXTRA_LAYOUTS.get(model) or family_config(model.removesuffix("-fp8"))
    return cfg["vocab_size"]


def spec_of(**overrides):
    from transformers import AutoConfig

    cfg = dict(family_config("llama"), **overrides)
    return family_spec(AutoConfig.for_model(cfg.pop("model_type"), **cfg))


@pytest.mark.parametrize(
    "heads,kv,tp,held,source",
    [
        (4, 2, 2, 2, [0, 1]),  # split
        (4, 1, 2, 2, [0, 0]),  # replicated to the tp degree
        (8, 2, 4, 4, [0, 0, 1, 1]),
        (6, 3, 2, 6, [0, 0, 1, 1, 2, 2]),  # converted to MHA
        (4, 4, 1, 4, [0, 1, 2, 3]),
    ],
)
def test_kv_head_layout(heads, kv, tp, held, source):
    layout = ShardLayout.of(spec_of(num_attention_heads=heads, num_key_value_heads=kv, hidden_size=96), tp)
    assert layout.kv_heads == held
    assert layout.kv_source().tolist() == source
    # every query head uses a KV head its rank holds, copied from its own checkpoint KV head
    for h in range(heads):
        held_head = h // (heads // held)
        assert held_head // layout.kv_heads_per_rank == h // layout.heads_per_rank
        assert source[held_head] == h // (heads // kv)


def test_shards_concatenate_to_the_tp_checkpoint():
    layout = ShardLayout.of(spec_of(vocab_size=511), 2)
    full = {
        "model.layers.0.self_attn.k_proj.weight": torch.randn(2 * 16, 64),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(64, 64),
        "model.norm.weight": torch.randn(64),
        "lm_head.weight": torch.randn(511, 64),
    }
    tp_state = tp_checkpoint(full, layout)
    shards = [rank_shard(tp_state, 2, r) for r in range(2)]
    assert tp_state["lm_head.weight"].shape == (512, 64) and tp_state["lm_head.weight"][511].eq(0).all()
    assert torch.equal(torch.cat([s["lm_head.weight"] for s in shards]), tp_state["lm_head.weight"])
    assert torch.equal(
        torch.cat([s["model.layers.0.self_attn.o_proj.weight"] for s in shards], 1),
        full["model.layers.0.self_attn.o_proj.weight"],
    )
    assert all(s["model.norm.weight"] is full["model.norm.weight"] for s in shards)


def test_indivisible_heads_name_the_fix():
    with pytest.raises(
        NeuronConfigError,
        match=r"num_attention_heads \(6\) is not divisible by --tensor_parallel_size 4: .*\[1, 2, 3, 6\]",
    ):
        ShardLayout.of(spec_of(num_attention_heads=6, num_key_value_heads=3, hidden_size=96), 4)
