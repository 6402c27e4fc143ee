"""Quantized exports (--quantization int8|fp8, FP8 checkpoints), checked against the rule as
helpers.quantization_rule writes it down, independently of the export's code. Tokens are
compared with transformers running the same weights."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from fixtures.export_models import checkpoint_path, export_with, fp8_checkpoint_path
from helpers import engine_greedy_tokens, fake_quantize, prompt, quantization_rule
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from optimum_neuron_chunked import NeuronModelForCausalLM
from optimum_neuron_chunked.config import NeuronConfig, NeuronConfigError
from optimum_neuron_chunked.export.pipeline import export
from optimum_neuron_chunked.modeling.quantization import block_expand
from optimum_neuron_chunked.quantized_checkpoint import dropped_notes, source_quantization
from optimum_neuron_chunked.testing.fp8_checkpoints import KEPT
from optimum_neuron_chunked.testing.reference import hf_greedy, transformers_weight_only

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
        got = model.generate(ids[None], max_new_tokens=NEW_TOKENS, do_sample=False)[0, length:].tolist()
        want = hf_greedy(hf, ids, NEW_TOKENS)  # generate stops at eos: compared up to it
        assert got == want[: len(got)] and (len(got) == NEW_TOKENS or got[-1] == hf.config.eos_token_id)


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


@pytest.fixture(scope="module", params=["block", "FP8_DYNAMIC", "FP8_BLOCK", "W8_CHANNEL", "W8_TENSOR"])
def fp8_source(request):
    return fp8_checkpoint_path("llama", request.param)


def test_fp8_checkpoint_exports_its_own_weights_in_neurons_range(fp8_source, tmp_path, caplog):
    """transformers' fine-grained FP8, and compressed-tensors' FP8_DYNAMIC, FP8_BLOCK and
    weight-only FP8 per channel and per tensor (written by compressed-tensors' own API):
    exported as FP8 without --quantization, values past +-240 halved with their scale doubled,
    the ignored projection and FP8_BLOCK's partial-block ones kept in --dtype; tokens equal
    transformers 5 running its own weight-only dequantization of the checkpoint."""
    with caplog.at_level(logging.WARNING):
        out = export(str(fp8_source), tmp_path / "out", backend="eager", **SHAPE)
    config, source = NeuronConfig.load(out), source_quantization(AutoConfig.from_pretrained(fp8_source))
    assert (config.quantization, config.quantization_block) == ("fp8", source.block or ())
    partial = [
        "model.layers.0.self_attn.k_proj",
        "model.layers.0.self_attn.v_proj",
    ]  # [32, 64] in 64x32 blocks
    assert all(m in config.quantization_skip for m in partial) == (
        fp8_source.name.startswith("llama-fp8-FP8_BLOCK")
    )
    assert ("kept in --dtype, their shapes not whole 64x32 blocks" in caplog.text) == (
        source.block == (64, 32)
    )
    assert KEPT in config.quantization_skip

    stored, reference = load_file(out / "model.safetensors"), transformers_weight_only(fp8_source)[0]
    halved = 0
    for module in [n.removesuffix(".scale") for n in stored if n.endswith(".scale")]:
        weight, scale = stored[f"{module}.weight"], stored[f"{module}.scale"]
        src_weight, src_scale = _source_tensors(fp8_source, module)
        assert weight.dtype == torch.float8_e4m3fn and weight.float().abs().max() <= 240
        ratio = (scale / src_scale).unique().tolist()
        assert set(ratio) <= {1.0, 2.0}
        halved += 2.0 in ratio
        normal = src_weight.float().abs() >= 2**-5  # halving is exact but for e4m3's subnormals
        factor = block_expand(scale / src_scale, tuple(weight.shape))
        assert torch.equal(weight.float()[normal] * factor[normal], src_weight.float()[normal]), module
    assert halved > 0  # amax / 448 scales: some groups reach past 240
    for module in [m for m in config.quantization_skip if f"{m}.weight" in stored]:
        assert stored[f"{module}.weight"].dtype == torch.float32 and f"{module}.scale" not in stored
        assert torch.equal(stored[f"{module}.weight"], reference.state_dict()[f"{module}.weight"]), module
    assert_generates_as(NeuronModelForCausalLM.from_pretrained(out), reference)


def _source_tensors(folder, module: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A checkpoint's FP8 weight and its scale, the scale 2-d (a per-tensor [1] as [1, 1])."""
    source = load_file(folder / "model.safetensors")
    scale = source.get(f"{module}.weight_scale_inv", source.get(f"{module}.weight_scale")).float()
    return source[f"{module}.weight"], scale.reshape(1, 1) if scale.dim() == 1 else scale


def test_partial_fp8_blocks_dequantize_element_by_element():
    """A [100, 70] weight in 48x32 blocks (compressed-tensors' partial last blocks, rows and
    columns): each value times the scale of its block."""
    from optimum_neuron_chunked.quantized_checkpoint import SourceQuantization, dequantized

    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(100, 70, generator=generator) * 50).to(torch.float8_e4m3fn)
    scale = torch.rand(3, 3, generator=generator) + 0.5
    expected = torch.tensor(
        [[(weight[i, j].float() * scale[i // 48, j // 32]).item() for j in range(70)] for i in range(100)]
    )
    got = dequantized(weight, scale, SourceQuantization("compressed-tensors", (48, 32), "weight_scale"))
    assert torch.equal(got, expected)


def test_skipped_fp8_projection_is_dequantized_by_its_scale(tmp_path):
    """--quantization fp8 keeps an FP8 checkpoint's weights; a --quantization-skip projection is
    its weight times its scale, as transformers dequantizes it."""
    source = fp8_checkpoint_path("llama", "block")
    stored = load_file(export(str(source), tmp_path / "out", backend="eager", **SHAPE) / "model.safetensors")
    skipped = export(str(source), tmp_path / "skip", backend="eager", quantization="fp8",
                     quantization_skip=("o_proj",), **SHAPE)  # fmt: skip
    kept, reference = load_file(skipped / "model.safetensors"), transformers_weight_only(source)[0]
    for name in [n for n in stored if "o_proj" not in n]:
        assert_bitwise_equal(kept[name], stored[name], name)
    o_proj = "model.layers.1.self_attn.o_proj"
    assert kept[f"{o_proj}.weight"].dtype == torch.float32 and f"{o_proj}.scale" not in kept
    assert torch.equal(kept[f"{o_proj}.weight"], reference.state_dict()[f"{o_proj}.weight"])
    assert_generates_as(NeuronModelForCausalLM.from_pretrained(skipped), reference)


def test_fp8_checkpoint_notes_say_what_the_export_drops(tmp_path, capsys):
    """Activation and KV-cache scales: one line each, only where the checkpoint has them
    (FP8 with static input scales and a KV-cache scheme, by compressed-tensors' API); none for
    dynamic activations; a mixed-precision checkpoint of supported groups is accepted."""
    for quiet in ("FP8_DYNAMIC", "W8_CHANNEL"):  # dynamic activations; none at all
        source = source_quantization(AutoConfig.from_pretrained(fp8_checkpoint_path("llama", quiet)))
        assert dropped_notes(source, "bfloat16") == []
    static = fp8_checkpoint_path("llama", "FP8_STATIC_KV")
    export(str(static), tmp_path / "out", backend="eager", dtype="bfloat16", **SHAPE)
    printed = " ".join("".join(capsys.readouterr()).split())  # the console wraps long lines
    assert "activation scales dropped: the export quantizes weights only" in printed
    assert "KV-cache scales dropped: the export's KV cache is bfloat16 (--dtype)" in printed
    quant = json.loads((static / "config.json").read_text())["quantization_config"]
    group = quant["config_groups"]["group_0"]
    weight_only = {**group, "format": "naive-quantized", "input_activations": None}
    mixed = {**quant, "format": "mixed-precision", "config_groups": {"a": group, "b": weight_only}}
    assert source_quantization(PretrainedConfig(quantization_config=mixed)).block is None


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
    assert_generates_as(NeuronModelForCausalLM.from_pretrained(out), transformers_weight_only(source)[0])


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
        ExportError, match="FP8 checkpoints of phi3 .* unquantized original with --quantization fp8"
    ):
        export(str(fused), tmp_path / "b", backend="eager", **SHAPE)
    with pytest.raises(NeuronConfigError, match="--quantization-skip .* with --quantization"):
        NeuronConfig(backend="eager", quantization_skip=("down_proj",), **SHAPE)
    # compressed-tensors: the scheme decides; an int8 group, or groups mixing scale layouts, refused
    quant = json.loads((fp8_checkpoint_path("llama", "FP8_BLOCK") / "config.json").read_text())[
        "quantization_config"
    ]
    blocks = quant["config_groups"]["group_0"]
    int8 = {**blocks, "format": "int-quantized", "weights": {**blocks["weights"], "type": "int"}}
    channel = {**blocks, "weights": {**blocks["weights"], "strategy": "channel", "block_structure": None}}
    asymmetric = {**channel, "weights": {**channel["weights"], "symmetric": False}}
    for groups, message in [
        ({"g": asymmetric}, "g holds float 8-bit asymmetric channel weights stored float-quantized"),
        ({"group_0": int8}, "group_0 holds int 8-bit block weights stored int-quantized: compressed-tensors checkpoints export when"),
        ({"a": blocks, "b": channel}, r"groups mix FP8 scale layouts \(\(64, 32\), per channel / tensor\)"),
    ]:  # fmt: skip
        with pytest.raises(NeuronConfigError, match=message):
            source_quantization(PretrainedConfig(quantization_config={**quant, "config_groups": groups}))


def test_blockwise_scales_shard_in_whole_blocks_only():
    from optimum_neuron_chunked.export.pipeline import load_hf_config
    from optimum_neuron_chunked.modeling import family_spec
    from optimum_neuron_chunked.modeling.parallel import check_block_shards

    spec = family_spec(load_hf_config(str(checkpoint_path("llama"))))  # 4 heads of 16, 2 KV heads
    check_block_shards(spec, (32, 32), 1)
    with pytest.raises(NeuronConfigError, match="not a whole number of the checkpoint's 32x32 scale blocks"):
        check_block_shards(spec, (32, 32), 4)
    # 64x32 (FP8_BLOCK's partial k/v blocks, kept in --dtype): q_proj's 64 rows split in 2 are not
    check_block_shards(spec, (64, 32), 1)
    check_block_shards(spec, (48, 32), 4)  # no projection whole 48-row blocks: all kept in --dtype
    with pytest.raises(NeuronConfigError, match="q_proj rows per rank \\(32\\) .* 64x32 scale blocks"):
        check_block_shards(spec, (64, 32), 2)


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
def test_vllm_on_quantized_exports_answers_with_transformers_on_their_weights(source, backend, tmp_path):
    """vLLM on an int8 export and on an exported FP8 checkpoint (no flag: the export records its
    quantization): requests together, chunks mixed with decodes; xla: vLLM 0.16.0 in the
    SDK-mirror environment, every graph on torch-xla's device."""
    if source == "int8":
        export_dir = export_with("llama", backend, quantization="int8", **SHAPE)
        hf = AutoModelForCausalLM.from_pretrained(checkpoint_path("llama"), dtype=torch.float32).eval()
        fake_quantize(hf, "int8")
    else:
        export_dir = export(
            str(fp8_checkpoint_path("llama", "block")), tmp_path / "fp8", backend=backend, **SHAPE
        )
        hf = transformers_weight_only(fp8_checkpoint_path("llama", "block"))[0]
    prompts = [prompt(n, seed=50 + i) for i, n in enumerate((1, 33, 3 * 32 + 5, 70))]
    expected = [hf_greedy(hf, p, 8) for p in prompts]
    assert engine_greedy_tokens(export_dir, prompts, 8) == expected
