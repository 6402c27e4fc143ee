from __future__ import annotations

import json
import re

import pytest

from optimum_neuron_chunked.config import CONFIG_NAME, NeuronConfig, NeuronConfigError
from optimum_neuron_chunked.graphs import graph_specs
from optimum_neuron_chunked.modeling.kv_layout import KVPool


def test_round_trip(tmp_path):
    config = NeuronConfig(batch_size=4, sequence_length=1024, prefill_chunk_size=128)
    config.save(tmp_path)
    assert NeuronConfig.load(tmp_path) == config


def test_exports_written_with_prompt_logits_still_load(tmp_path):
    config = NeuronConfig(batch_size=4, sequence_length=1024, prompt_logprobs=True)
    config.save(tmp_path)
    path = tmp_path / CONFIG_NAME
    old = {
        ("prompt_logits" if k == "prompt_logprobs" else k): v for k, v in json.loads(path.read_text()).items()
    }
    path.write_text(json.dumps(old))
    assert NeuronConfig.load(tmp_path) == config


def test_default_buckets_halve_down_to_512():
    assert NeuronConfig(batch_size=1, sequence_length=4096).context_buckets == (512, 1024, 2048, 4096)
    assert NeuronConfig(batch_size=1, sequence_length=128).context_buckets == (128,)
    assert NeuronConfig(batch_size=1, sequence_length=4096, prefill_chunk_size=1024).context_buckets == (
        1024,
        2048,
        4096,
    )


def test_bucket_for_picks_the_smallest_cover():
    config = NeuronConfig(batch_size=1, sequence_length=4096)
    assert [config.bucket_for(n) for n in (1, 512, 513, 4096)] == [512, 512, 1024, 4096]
    with pytest.raises(NeuronConfigError, match="exceeds"):
        config.bucket_for(4097)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(batch_size=0, sequence_length=128), "--batch_size 1 or more"),
        (dict(batch_size=1, sequence_length=128, prefill_chunk_size=256), "--prefill-chunk-size <= 128"),
        (dict(batch_size=1, sequence_length=128, dtype="int8"), "choose one of"),
        (dict(batch_size=1, sequence_length=128, backend="tpu"), "choose one of"),
        (dict(batch_size=1, sequence_length=128, context_buckets=(64,)), "must equal sequence_length"),
        (
            dict(batch_size=1, sequence_length=128, prefill_chunk_size=64, context_buckets=(32, 128)),
            "at least one chunk",
        ),
        (dict(batch_size=1, sequence_length=128, prefill_widths=(32,)), "with --prefill-chunk-size C"),
        (
            dict(batch_size=1, sequence_length=128, prefill_chunk_size=64, prefill_widths=(16, 32)),
            "--prefill-chunk-size 64 as the largest",
        ),
        (
            dict(batch_size=1, sequence_length=128, prefill_chunk_size=64, prefill_widths=(0, 64)),
            "from 1 up to the chunk size",
        ),
        (dict(batch_size=4, sequence_length=128, decode_widths=(1, 2)), "--batch_size 4 as the largest"),
        (dict(batch_size=4, sequence_length=128, decode_widths=(1, 8)), "--batch_size 4 as the largest"),
        (dict(batch_size=4, sequence_length=128, decode_widths=(0, 4)), "from 1 up to the batch size"),
        (dict(batch_size=1, sequence_length=128, prefill_chunk_size=8, speculation_length=8), "<= 7"),
        (
            dict(
                batch_size=1,
                sequence_length=128,
                prefill_chunk_size=32,
                speculation_length=4,
                mixed_step=True,
            ),
            "do not combine",
        ),
    ],
)
def test_invalid_configs_say_what_to_change(kwargs, message):
    with pytest.raises(NeuronConfigError, match=message):
        NeuronConfig(**kwargs)


def test_graph_sets():
    chunked = NeuronConfig(batch_size=4, sequence_length=1024, prefill_chunk_size=128)
    assert [s.name for s in graph_specs(chunked)] == ["cp_w512", "tg_w512", "cp_w1024", "tg_w1024", "copy"]
    std = NeuronConfig(batch_size=4, sequence_length=1024)
    assert [(s.name, s.batch, s.width) for s in graph_specs(std)] == [
        ("ce_w512", 1, 512),
        ("tg_w512", 4, 1),
        ("ce_w1024", 1, 1024),
        ("tg_w1024", 4, 1),
    ]


def test_prefill_widths():
    chunked = NeuronConfig(batch_size=4, sequence_length=1024, prefill_chunk_size=128)
    assert (
        chunked.prefill_widths == (128,)
        and NeuronConfig(batch_size=4, sequence_length=1024).prefill_widths == ()
    )
    narrow = NeuronConfig(
        batch_size=4, sequence_length=1024, prefill_chunk_size=128, prefill_widths=(128, 32)
    )
    assert narrow.prefill_widths == (32, 128)
    assert [narrow.width_for(n) for n in (1, 32, 33, 128)] == [32, 32, 128, 128]
    with pytest.raises(NeuronConfigError, match="exceeds the chunk size 128"):
        narrow.width_for(129)
    assert [s.name for s in graph_specs(narrow)] == [
        "cp_w512_c32", "cp_w512", "tg_w512", "cp_w1024_c32", "cp_w1024", "tg_w1024", "copy",
    ]  # fmt: skip
    # an export written before the field existed: the chunk size alone
    d = chunked.to_dict()
    del d["prefill_widths"]
    assert NeuronConfig.from_dict(d) == chunked


def test_decode_widths():
    plain = NeuronConfig(batch_size=4, sequence_length=1024, prefill_chunk_size=128)
    assert plain.decode_widths == (4,) and [plain.decode_width_for(n) for n in (1, 4)] == [4, 4]
    narrow = NeuronConfig(batch_size=4, sequence_length=1024, prefill_chunk_size=128, decode_widths=(4, 1, 2))
    assert narrow.decode_widths == (1, 2, 4)
    assert [narrow.decode_width_for(n) for n in (1, 2, 3, 4)] == [1, 2, 4, 4]
    with pytest.raises(NeuronConfigError, match="exceeds the batch size 4"):
        narrow.decode_width_for(5)
    assert [(s.name, s.batch) for s in graph_specs(narrow) if s.kind == "tg"] == [
        ("tg_w512_r1", 1), ("tg_w512_r2", 2), ("tg_w512", 4),
        ("tg_w1024_r1", 1), ("tg_w1024_r2", 2), ("tg_w1024", 4),
    ]  # fmt: skip
    # an export written before the field existed: the batch size alone
    d = narrow.to_dict()
    assert d["decode_widths"] == [1, 2, 4]
    del d["decode_widths"]
    assert NeuronConfig.from_dict(d) == plain


def test_verify_graphs_per_bucket_and_decode_width():
    config = NeuronConfig(
        batch_size=4, sequence_length=1024, prefill_chunk_size=128, decode_widths=(2, 4), speculation_length=4
    )
    assert [(s.name, s.batch, s.width) for s in graph_specs(config) if s.kind == "vf"] == [
        ("vf_w512_r2", 2, 5), ("vf_w512", 4, 5), ("vf_w1024_r2", 2, 5), ("vf_w1024", 4, 5),
    ]  # fmt: skip
    d = config.to_dict()
    del d["speculation_length"]  # an export written before the field existed: no verify graphs
    assert NeuronConfig.from_dict(d).speculation_length == 0


def phi3_config(**kw):
    from transformers import Phi3Config

    return Phi3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, **kw)


def test_rotary_variants_computed_at_run_time_are_refused_by_name():
    from optimum_neuron_chunked.modeling import family_spec
    from optimum_neuron_chunked.modeling.family import UnsupportedArchitectureError

    assert family_spec(phi3_config()).fused_projections  # Phi-3-mini-4k style: served
    # the form both transformers 4.57 (Phi3Config._rope_scaling_validation) and 5.x accept
    longrope = {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    for kw, name in [
        (
            dict(
                rope_scaling=longrope, max_position_embeddings=131072, original_max_position_embeddings=4096
            ),
            "rope_type 'longrope' (phi3)",
        ),
        (dict(partial_rotary_factor=0.75), "partial_rotary_factor 0.75 (phi3)"),
    ]:
        with pytest.raises(UnsupportedArchitectureError, match=re.escape(name)):
            family_spec(phi3_config(**kw))


def test_gemma3_variants_we_do_not_compute_are_refused_by_name():
    from transformers import Gemma3TextConfig

    from optimum_neuron_chunked.modeling import family_spec
    from optimum_neuron_chunked.modeling.family import UnsupportedArchitectureError

    small = dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=2
    )
    spec = family_spec(Gemma3TextConfig(**small, sliding_window=32))
    assert spec.sliding_windows == (32, 32) and spec.local_rope and spec.gemma_norms  # pattern 6: both local
    for kw, name in [
        (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
        (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ]:
        with pytest.raises(UnsupportedArchitectureError, match=name):
            family_spec(Gemma3TextConfig(**small, **kw))


def test_moe_layouts_read_off_the_config():
    from transformers import GptOssConfig, MixtralConfig, Qwen3MoeConfig

    from optimum_neuron_chunked.backends.cpu.kernels import kernel_choices
    from optimum_neuron_chunked.modeling import family_spec

    qwen = family_spec(
        Qwen3MoeConfig(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=False)
    )
    assert qwen.moe.sparse_layers == (False, True, False, False) and not qwen.moe.normalize_top_k
    mixtral = family_spec(MixtralConfig(num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2))
    assert mixtral.moe.normalize_top_k and mixtral.moe.num_experts == 8 and not mixtral.moe.router_bias
    oss = family_spec(GptOssConfig(num_hidden_layers=2, num_local_experts=32, num_experts_per_tok=4))
    assert oss.attention_sinks and oss.moe.softmax_over_top_k and oss.moe.swiglu_limit == 7.0
    assert oss.sliding_windows == (128, None)  # alternating, sliding first
    # a decode of 2 rows x top-4 reads 8 of 32 experts; 8 rows (32 selections) run them all
    assert oss.moe.selects_experts(2) and not oss.moe.selects_experts(8)
    # the cpu backend gathers only small selections (a copy per call): 1 row (4/32) yes, 2 rows no
    cpu = kernel_choices().expert_selection
    assert oss.moe.selects_experts(1, cpu) and not oss.moe.selects_experts(2, cpu)


def test_quantized_checkpoints_are_dequantized_or_refused():
    from transformers import LlamaConfig

    from optimum_neuron_chunked.export.pipeline import quantization_kwargs

    assert quantization_kwargs(LlamaConfig()) == {}
    mxfp4 = quantization_kwargs(LlamaConfig(quantization_config={"quant_method": "mxfp4"}))
    assert mxfp4["quantization_config"].dequantize
    with pytest.raises(
        NeuronConfigError, match=r"quantized with gptq.*export the unquantized original checkpoint"
    ):
        quantization_kwargs(LlamaConfig(quantization_config={"quant_method": "gptq", "bits": 4}))
    with pytest.raises(
        NeuronConfigError, match=r"bitsandbytes.*call model.dequantize\(\) and save_pretrained"
    ):
        quantization_kwargs(LlamaConfig(quantization_config={"quant_method": "bitsandbytes"}))


def test_paged_kv_options():
    """--kv-cache-blocks / --kv-block-size: errors name the flags; paged exports have no copy graph."""
    shapes = dict(batch_size=2, sequence_length=64, prefill_chunk_size=16, context_buckets=(32, 64))
    for fields, message in [
        (dict(kv_cache_blocks=8), r"--kv-cache-blocks \(8\) and --kv-block-size \(0\) .* pass both"),
        (dict(kv_block_size=8), r"--kv-cache-blocks \(0\) and --kv-block-size \(8\) .* pass both"),
        (dict(kv_cache_blocks=-8, kv_block_size=8), "pass both, positive"),
        (dict(kv_cache_blocks=8, kv_block_size=8, prefill_chunk_size=0), "with --prefill-chunk-size"),
        (dict(kv_cache_blocks=8, kv_block_size=12), "--kv-block-size 12 must divide every context bucket"),
        (dict(kv_cache_blocks=8, kv_block_size=64), "--kv-block-size 64 is the whole --sequence_length"),
    ]:
        with pytest.raises(NeuronConfigError, match=message):
            NeuronConfig(**(shapes | fields))
    paged = NeuronConfig(**shapes, kv_cache_blocks=8, kv_block_size=8, mixed_step=True)
    pool = KVPool.of(paged)
    assert (pool.num_blocks, pool.block_size, pool.whole_sequence_blocks) == (8, 8, False)
    assert [pool.blocks_holding(w) for w in paged.context_buckets] == [4, 8]
    whole = NeuronConfig(**shapes)  # the pool of one whole-sequence block per batch row
    pool = KVPool.of(whole)
    assert (pool.num_blocks, pool.block_size, pool.whole_sequence_blocks) == (2, 64, True)
    assert [pool.blocks_holding(w) for w in whole.context_buckets] == [1, 1]
    assert [s.name for s in graph_specs(paged)] == [
        "cp_w32",
        "tg_w32",
        "mx_w32",
        "cp_w64",
        "tg_w64",
        "mx_w64",
    ]
    assert NeuronConfig.from_dict(paged.to_dict()) == paged


def test_the_export_command_of_a_config_makes_the_same_config():
    """An export refused for its version names the command that makes it again (export_folder)."""
    import argparse
    import shlex

    from optimum_neuron_chunked.export.cli import add_export_arguments

    config = NeuronConfig(batch_size=8, sequence_length=4096, prefill_chunk_size=256, mixed_step=True,
                          kv_cache_blocks=64, kv_block_size=128, decode_widths=(4, 8), backend="neuron",
                          on_device_sampling=False, instance_type="trn1", quantization="int8",
                          quantization_skip=("down_proj", "model.layers.1?.*"))  # fmt: skip
    parser = argparse.ArgumentParser()
    add_export_arguments(parser)
    words = shlex.split(config.export_command("out dir/", model="org/model"))
    assert words[:3] == ["optimum-cli", "export", "neuron"]
    args = parser.parse_args(words[3:])
    assert (args.model, args.output) == ("org/model", "out dir/")
    options = {
        f: v for f, v in vars(args).items() if f not in ("model", "output", "overwrite") and v is not None
    }
    assert NeuronConfig(**options) == config
