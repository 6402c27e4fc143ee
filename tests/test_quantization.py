"""Quantized exports (--quantization int8|fp8, FP8 checkpoints), checked against the rule as
helpers.quantization_rule writes it down, independently of the export's code. Tokens are
compared with transformers running the same weights."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from fixtures.export_models import checkpoint_path, export_with, fp8_checkpoint_path
from helpers import fake_quantize, prompt, quantization_rule
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from optimum_neuron_chunked import NeuronModelForCausalLM
from optimum_neuron_chunked.config import NeuronConfig, NeuronConfigError
from optimum_neuron_chunked.export.pipeline import export
from optimum_neuron_chunked.testing.fp8_checkpoints import KEPT, load_dequantized
from optimum_neuron_chunked.testing.reference import hf_greedy

SHAPE = dict(batch_size=2, sequence_length=128, prefill_chunk_size=32, context_buckets=(64, 128))
NEW_TOKENS = 10


def expected_tensors(hf, quantization: str, keep=lambda module: False) -> dict[str, torch.Tensor]:
    """The export's quantized tensors, by the rule, from transformers' parameters (5.x stacks
    experts: gate_up_proj [E, 2I, H] gate rows first, down_proj [E, H, I])."""
    out = {}
    for name, param in hf.named_parameters():
        if name.endswith("experts.gate_up_proj"):
            stored, scale = quantization_rule(param.data, quantization)
            half = param.shape[1] // 2
            prefix = name.removesuffix("gate_up_proj")
            for which, rows in (("gate_proj", slice(0, half)), ("up_proj", slice(half, None))):
                out[prefix + which], out[f"{prefix}{which}_scale"] = stored[:, rows], scale[:, rows]
        elif name.endswith("experts.down_proj"):
            out[name], out[name + "_scale"] = quantization_rule(param.data, quantization)
        elif name.endswith("_proj.weight") and ".layers." in name and not keep(name.removesuffix(".weight")):
            module = name.removesuffix(".weight")
            out[name], out[module + ".scale"] = quantization_rule(param.data, quantization)
    return out


def assert_bitwise_equal(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    assert (got.dtype, got.shape) == (want.dtype, want.shape), name
    assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), name


def assert_generates_as(model: NeuronModelForCausalLM, hf) -> None:
    for length in (7, 3 * SHAPE["prefill_chunk_size"] + 5):  # one chunk; several, the last partial
        ids = prompt(length)
        output = model.generate(ids[None], max_new_tokens=NEW_TOKENS, do_sample=False)
        assert output[0, length:].tolist() == hf_greedy(hf, ids, NEW_TOKENS)


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "mixtral"])
def test_quantized_export_stores_the_rule_and_generates_as_transformers_on_its_weights(family, quantization):
    out = export_with(family, "eager", quantization=quantization, **SHAPE)
    stored = load_file(out / "model.safetensors")
    hf = AutoModelForCausalLM.from_pretrained(checkpoint_path(family), dtype=torch.float32).eval()
    expected = expected_tensors(hf, quantization)
    assert len(expected) > 0
    for name, tensor in expected.items():
        assert_bitwise_equal(stored[name], tensor, name)
    weights = [n for n in expected if not n.endswith("scale")]
    quantized_bytes = sum(stored[n].nbytes for n in weights)
    bf16_bytes = sum(stored[n].numel() * 2 for n in weights)
    scale_bytes = sum(stored[n].nbytes for n in expected if n.endswith("scale"))
    assert quantized_bytes + scale_bytes <= 0.5 * bf16_bytes + scale_bytes
    kept = [n for n in stored if n not in expected]
    assert all(stored[n].dtype == torch.float32 for n in kept)  # embeddings, lm_head, norms, routers
    assert NeuronConfig.load(out).quantization == quantization

    fake_quantize(hf, quantization)
    assert_generates_as(NeuronModelForCausalLM.from_pretrained(out), hf)


def test_skip_patterns_match_a_module_or_its_holders_by_suffix_or_whole_name_glob():
    from optimum_neuron_chunked.modeling.quantization import module_matches

    q, down = "model.layers.1.self_attn.q_proj", "model.layers.10.mlp.down_proj"
    assert module_matches(down, "down_proj") and module_matches(down, "mlp.down_proj")
    assert module_matches(down, "layers.10.mlp") and module_matches(down, "layers.10")
    assert not module_matches(down, "layers.1") and not module_matches(down, "proj")
    assert module_matches(q, "model.layers.1?.*") is False and module_matches(down, "model.layers.1?.*")
    assert module_matches(q, "*.self_attn.*") and not module_matches(q, "self_attn.q")


def test_skipped_modules_keep_the_export_dtype():
    """--quantization-skip: a suffix at a dot and a glob over the whole name."""
    skip = ("down_proj", "model.layers.1.*")
    out = export_with("llama", "eager", quantization="int8", quantization_skip=skip, **SHAPE)
    stored = load_file(out / "model.safetensors")

    def keep(module: str) -> bool:
        return module.endswith(".down_proj") or module.startswith("model.layers.1.")

    assert stored["model.layers.0.mlp.down_proj.weight"].dtype == torch.float32
    assert stored["model.layers.1.self_attn.q_proj.weight"].dtype == torch.float32
    assert "model.layers.1.self_attn.q_proj.scale" not in stored
    hf = AutoModelForCausalLM.from_pretrained(checkpoint_path("llama"), dtype=torch.float32).eval()
    expected = expected_tensors(hf, "int8", keep)
    for name, tensor in expected.items():
        assert_bitwise_equal(stored[name], tensor, name)
    fake_quantize(hf, "int8", keep)
    assert_generates_as(NeuronModelForCausalLM.from_pretrained(out), hf)


@pytest.fixture(scope="module", params=["block", "channel"])
def fp8_source(request):
    return fp8_checkpoint_path("llama", request.param)


def test_fp8_checkpoint_exports_its_own_weights_in_neurons_range(fp8_source, tmp_path, caplog):
    """Block-wise (transformers' fine-grained FP8) and per-channel (compressed-tensors) FP8
    checkpoints: exported as FP8 without --quantization, values past +-240 halved with their
    scale doubled, the ignored projection kept; tokens equal transformers 5 running its own
    dequantization of the checkpoint."""
    with caplog.at_level(logging.WARNING):
        out = export(str(fp8_source), tmp_path / "out", backend="eager", **SHAPE)
    config = NeuronConfig.load(out)
    block = json.loads((fp8_source / "config.json").read_text())["quantization_config"].get(
        "weight_block_size"
    )
    assert (config.quantization, config.quantization_block) == ("fp8", tuple(block or ()))
    assert KEPT in config.quantization_skip
    assert ("activation scales are ignored" in caplog.text) == (block is None)  # W8A8 FP8_DYNAMIC

    source, stored = load_file(fp8_source / "model.safetensors"), load_file(out / "model.safetensors")
    assert stored[f"{KEPT}.weight"].dtype == torch.float32
    halved = 0
    for name in [n for n in stored if n.endswith(".scale")]:
        module = name.removesuffix(".scale")
        weight, scale = stored[f"{module}.weight"], stored[name]
        src_weight = source[f"{module}.weight"]
        src_scale = source.get(f"{module}.weight_scale_inv", source.get(f"{module}.weight_scale"))
        assert weight.dtype == torch.float8_e4m3fn and weight.float().abs().max() <= 240
        ratio = (scale / src_scale).unique().tolist()
        assert set(ratio) <= {1.0, 2.0}
        halved += 2.0 in ratio
        expand = [weight.shape[0] // scale.shape[0], weight.shape[1] // scale.shape[1]]
        factor = (scale / src_scale).repeat_interleave(expand[0], 0).repeat_interleave(expand[1], 1)
        normal = src_weight.float().abs() >= 2**-5  # halving is exact but for e4m3's subnormals
        assert torch.equal(weight.float()[normal] * factor[normal], src_weight.float()[normal]), name
    assert halved > 0  # amax / 448 scales: some groups reach past 240

    reference = load_dequantized(fp8_source)
    assert_generates_as(NeuronModelForCausalLM.from_pretrained(out), reference)
    # --quantization fp8 keeps the same weights; a skipped projection is dequantized by its scale
    skipped = export(str(fp8_source), tmp_path / "skip", backend="eager", quantization="fp8",
                     quantization_skip=("o_proj",), **SHAPE)  # fmt: skip
    kept = load_file(skipped / "model.safetensors")
    for name in [n for n in stored if "o_proj" not in n]:
        assert_bitwise_equal(kept[name], stored[name], name)
    o_proj = "model.layers.1.self_attn.o_proj"
    assert kept[f"{o_proj}.weight"].dtype == torch.float32 and f"{o_proj}.scale" not in kept
    assert torch.equal(kept[f"{o_proj}.weight"], reference.state_dict()[f"{o_proj}.weight"])
    assert_generates_as(NeuronModelForCausalLM.from_pretrained(skipped), reference)


@pytest.mark.parametrize("layout", ["block", "channel"])
def test_fp8_moe_checkpoint_stacks_its_experts_scales(layout, tmp_path):
    """qwen3_moe's per-expert FP8 weights and scales (16x16 blocks, or per channel) stacked as
    the experts are: tokens equal transformers 5 dequantizing the checkpoint itself."""
    source = fp8_checkpoint_path("qwen3_moe", layout, (16, 16))
    out = export(str(source), tmp_path / "out", backend="eager", **SHAPE)
    stored = load_file(out / "model.safetensors")
    experts = "model.layers.0.mlp.experts"
    assert stored[f"{experts}.gate_proj"].dtype == torch.float8_e4m3fn
    assert stored[f"{experts}.gate_proj_scale"].shape == ((8, 3, 4) if layout == "block" else (8, 48, 1))
    assert_generates_as(NeuronModelForCausalLM.from_pretrained(out), load_dequantized(source))


def test_what_cannot_be_exported_as_asked_is_refused_by_name(tmp_path):
    from optimum_neuron_chunked.export.errors import ExportError

    with pytest.raises(NeuronConfigError, match="round its FP8 weights again"):
        export(
            str(fp8_checkpoint_path("llama", "block")),
            tmp_path / "a",
            backend="eager",
            quantization="int8",
            **SHAPE,
        )
    fused = tmp_path / "phi3-fp8"
    fused.mkdir()
    config = json.loads((checkpoint_path("phi3") / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [16, 16]}
    (fused / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ExportError, match="FP8 checkpoints of phi3 .* dequantized copy with --quantization fp8"
    ):
        export(str(fused), tmp_path / "b", backend="eager", **SHAPE)
    with pytest.raises(NeuronConfigError, match="--quantization-skip .* with --quantization"):
        NeuronConfig(backend="eager", quantization_skip=("down_proj",), **SHAPE)


def test_blockwise_scales_shard_in_whole_blocks_only():
    from optimum_neuron_chunked.export.pipeline import _load_hf_config
    from optimum_neuron_chunked.modeling import family_spec
    from optimum_neuron_chunked.modeling.parallel import check_block_shards

    spec = family_spec(_load_hf_config(str(checkpoint_path("llama"))))  # 4 heads of 16, 2 KV heads
    check_block_shards(spec, (32, 32), 1)
    with pytest.raises(NeuronConfigError, match="not a whole number of the checkpoint's 32x32 scale blocks"):
        check_block_shards(spec, (32, 32), 4)


def test_export_summary_prints_the_bytes_saved_and_the_kv_blocks_they_hold(tmp_path):
    import io

    from rich.console import Console

    paged = dict(SHAPE, kv_cache_blocks=16, kv_block_size=16)
    text = io.StringIO()
    export(str(checkpoint_path("llama")), tmp_path / "out", backend="eager", quantization="int8",
           console=Console(file=text, width=300), **paged)  # fmt: skip
    hf = AutoModelForCausalLM.from_pretrained(checkpoint_path("llama"), dtype=torch.float32)
    weights = [p for n, p in hf.named_parameters() if n.endswith("_proj.weight") and ".layers." in n]
    saved = sum(w.numel() * 3 - w.shape[0] * 4 for w in weights)  # fp32 -> int8 + a float32 scale a row
    c = hf.config
    block = (
        2 * c.num_hidden_layers * c.num_key_value_heads * 16 * (c.hidden_size // c.num_attention_heads) * 4
    )
    assert (
        f"{saved / 2**20:.2f} MiB saved, the HBM of {saved // block} more KV blocks of 16 positions"
        in text.getvalue()
    )


@pytest.mark.parametrize(
    "source,backend",
    [
        ("int8", "eager"),
        ("fp8-block-checkpoint", "eager"),
        pytest.param("int8", "xla", marks=pytest.mark.xla),
    ],
)
def test_vllm_serve_of_quantized_exports_answers_with_transformers_on_their_weights(
    source, backend, tmp_path
):
    """`vllm serve` of an int8 export and of an exported FP8 checkpoint (no flag: the export
    records its quantization): concurrent requests, chunks mixed with decodes; xla: vLLM 0.16.0
    in the SDK-mirror environment, every graph on torch-xla's device."""
    from optimum_neuron_chunked.testing.server import served_greedy_tokens

    if source == "int8":
        export_dir = export_with("llama", backend, quantization="int8", **SHAPE)
        hf = AutoModelForCausalLM.from_pretrained(checkpoint_path("llama"), dtype=torch.float32).eval()
        fake_quantize(hf, "int8")
    else:
        export_dir = export(
            str(fp8_checkpoint_path("llama", "block")), tmp_path / "fp8", backend=backend, **SHAPE
        )
        hf = load_dequantized(fp8_checkpoint_path("llama", "block"))
    prompts = [prompt(n, seed=50 + i) for i, n in enumerate((1, 33, 3 * 32 + 5, 70))]
    expected = [hf_greedy(hf, p, 8) for p in prompts]
    assert (
        served_greedy_tokens(export_dir, tmp_path / "serve.log", [p.tolist() for p in prompts], 8) == expected
    )


@pytest.mark.slow
def test_cpu_backend_compiles_fp8_graphs_bound_to_the_weights_at_load():
    """AOTInductor packages hold no weights: the fp8 weights and scales are bound at load."""
    out = export_with("qwen3", "cpu", quantization="fp8", **(SHAPE | {"context_buckets": (128,)}))
    hf = AutoModelForCausalLM.from_pretrained(checkpoint_path("qwen3"), dtype=torch.float32).eval()
    fake_quantize(hf, "fp8")
    assert_generates_as(NeuronModelForCausalLM.from_pretrained(out), hf)
