"""Weights streamed from the checkpoint's safetensors (checkpoint_stream) equal, byte for byte,
those of the path through the whole transformers model, for every family and weight layout."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from fixtures.export_models import checkpoint_path
from safetensors.torch import load_file, save_file

from optimum_neuron_chunked import NeuronModelForCausalLM
from optimum_neuron_chunked.checkpoint_stream import checkpoint_folder, stream_weights
from optimum_neuron_chunked.config import NeuronConfig, NeuronConfigError
from optimum_neuron_chunked.export.pipeline import export
from optimum_neuron_chunked.modeling import build_model, model_from_spec
from optimum_neuron_chunked.safetensors_io import SafetensorsWriter
from optimum_neuron_chunked.testing.checkpoints import COMMON, FAMILIES, build_checkpoint

SHAPE = dict(batch_size=2, sequence_length=128, prefill_chunk_size=32, context_buckets=(64, 128))


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert (got[name].dtype, got[name].shape) == (tensor.dtype, tensor.shape), name
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), (
            name
        )


def eager_weights(model: Path, out: Path, weights: str, dtype: str = "float32") -> dict[str, torch.Tensor]:
    folder = export(str(model), out, backend="eager", dtype=dtype, weights=weights, **SHAPE)
    return load_file(folder / "model.safetensors")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_streamed_export_equals_the_transformers_path(family, dtype, tmp_path):
    checkpoint = checkpoint_path(family)
    want = eager_weights(checkpoint, tmp_path / "transformers", "transformers", dtype)
    assert_same_tensors(eager_weights(checkpoint, tmp_path / "stream", "stream", dtype), want)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_streamed_neuron_shards_equal_save_weights_at_tp2(family, tmp_path):
    """The neuron backend's per-rank files (KV heads replicated, vocabulary padded, tied
    lm_head stored) as NeuronBackend.save_weights writes them from the loaded decoder."""
    from transformers import AutoModelForCausalLM

    from optimum_neuron_chunked.backends.neuron import NeuronBackend
    from optimum_neuron_chunked.export.pipeline import load_hf_config

    checkpoint = checkpoint_path(family)
    hf_config = load_hf_config(str(checkpoint))
    try:
        config = NeuronConfig(
            backend="neuron", instance_type="trn1", tp_degree=2, model_type=hf_config.model_type, **SHAPE
        )
        decoder = build_model(hf_config, config)
    except NeuronConfigError as e:
        pytest.skip(f"{family} does not split in 2: {e}")
    hf_model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    decoder.load_weights(decoder.weights_from_hf(hf_model))
    (tmp_path / "old").mkdir()
    NeuronBackend().save_weights(decoder, config, tmp_path / "old")
    meta = model_from_spec(decoder.spec, config, device="meta")
    files, tied = NeuronBackend().stream_targets(config)
    stream_weights(checkpoint, hf_config, config, meta, files, tied, tmp_path / "new")
    for f in files:
        assert_same_tensors(load_file(tmp_path / "new" / f.path), load_file(tmp_path / "old" / f.path))


def test_sharded_checkpoint_exports_as_the_single_file_one(tmp_path):
    """Several safetensors files and model.safetensors.index.json, as save_pretrained shards."""
    from transformers import AutoModelForCausalLM

    single = checkpoint_path("qwen3_moe")
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(single, dtype=torch.float32).save_pretrained(
        sharded, max_shard_size="100KB"
    )
    for extra in single.glob("tokenizer*"):
        shutil.copy(extra, sharded)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert not (sharded / "model.safetensors").exists()
    want = eager_weights(single, tmp_path / "single", "stream")
    assert_same_tensors(eager_weights(sharded, tmp_path / "from-shards", "stream"), want)
    assert_same_tensors(load_file(tmp_path / "from-shards" / "model.safetensors"), want)
    ids = torch.arange(4, 4 + 40)[None]
    tokens = [
        NeuronModelForCausalLM.from_pretrained(tmp_path / name).generate(
            ids, max_new_tokens=6, do_sample=False
        )
        for name in ("single", "from-shards")
    ]
    assert tokens[0].tolist() == tokens[1].tolist()


def test_a_hub_id_streams_from_the_hub_cache(tmp_path, monkeypatch):
    """A repo id resolves to its snapshot in the hub cache (offline here), streamed as a folder."""
    checkpoint = checkpoint_path("llama")
    snapshot = tmp_path / "hub" / "models--org--tiny-llama" / "snapshots" / ("0" * 40)
    shutil.copytree(checkpoint, snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    assert checkpoint_folder("org/tiny-llama") == snapshot


def test_streaming_never_builds_the_transformers_model(tmp_path, monkeypatch):
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("the streamed path loaded the whole transformers model")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    eager_weights(checkpoint_path("gemma3_text"), tmp_path / "out", "stream")


def mxfp4_checkpoint(path: Path) -> Path:
    """A tiny gpt-oss checkpoint whose experts are MXFP4 as on the hub (openai/gpt-oss-20b):
    `*_blocks` [E, rows, cols/32, 16] uint8 (two fp4 values a byte), `*_scales` [E, rows, cols/32]."""
    config = {**COMMON, **FAMILIES["gpt_oss"], "intermediate_size": 64}  # divisible by the 32-wide blocks
    build_checkpoint("gpt_oss", path, config=config)
    state = load_file(path / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        rows, cols = state.pop(name).transpose(1, 2).shape[1:]  # on disk [E, out, in]
        experts = FAMILIES["gpt_oss"]["num_local_experts"]
        blocks, scales = (experts, rows, cols // 32, 16), (experts, rows, cols // 32)
        state[f"{name}_blocks"] = torch.randint(0, 256, blocks, generator=generator, dtype=torch.uint8)
        # exponents 2^-5 .. 2^2 (127 is 2^0): weights of the usual magnitude
        state[f"{name}_scales"] = torch.randint(122, 130, scales, generator=generator, dtype=torch.uint8)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    hf_config = json.loads((path / "config.json").read_text())
    hf_config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "lm_head"],
    }
    (path / "config.json").write_text(json.dumps(hf_config))
    return path


def test_mxfp4_experts_dequantise_per_tensor_as_transformers_does(tmp_path):
    checkpoint = mxfp4_checkpoint(tmp_path / "mxfp4")
    got = eager_weights(checkpoint, tmp_path / "stream", "stream")
    assert got["model.layers.0.mlp.experts.gate_proj"].abs().sum() > 0
    try:
        want = eager_weights(checkpoint, tmp_path / "transformers", "transformers")
    except ModuleNotFoundError as e:  # transformers 4.57's Mxfp4 quantizer imports accelerate
        pytest.skip(f"transformers cannot load the MXFP4 checkpoint here: {e}")
    assert_same_tensors(got, want)


def test_the_writer_lays_tensors_out_aligned_takes_them_in_any_order_and_files_load(tmp_path):
    tensors = {
        "b": torch.randn(3, 5).to(torch.bfloat16),
        "a": torch.randn(7),
        "scalar": torch.tensor(2.5),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
    }
    writer = SafetensorsWriter(
        tmp_path / "x.safetensors", {n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()}
    )
    assert writer.order == ["a", "empty", "scalar", "b", "mask"]  # element size, then name
    with pytest.raises(ValueError, match=r"expected torch.float32 \(7,\)"):
        writer.write("a", tensors["b"])
    for name in reversed(writer.order):
        writer.write(name, tensors[name])
    with pytest.raises(ValueError, match="written twice"):
        writer.write("a", tensors["a"])
    writer.close()
    assert_same_tensors(load_file(tmp_path / "x.safetensors"), tensors)


def test_the_cpu_decoder_holds_the_tensors_aotinductor_inlines(tmp_path):
    """0-d and 1-d tensors (rotary buffers, norms, biases) are real; matrices are left empty."""
    from optimum_neuron_chunked.checkpoint_stream import empty_but_inlined

    checkpoint = checkpoint_path("qwen2")  # q/k/v biases, tied embeddings
    stored = eager_weights(checkpoint, tmp_path / "out", "stream")
    config = NeuronConfig(backend="cpu", model_type="qwen2", **SHAPE)
    meta = build_model_meta(checkpoint, config)
    decoder = empty_but_inlined(meta, tmp_path / "out" / "model.safetensors")
    state = decoder.state_dict()
    small = {name for name, tensor in stored.items() if tensor.dim() <= 1}
    assert {"model.rotary_emb.attention_scaling", "model.layers.0.self_attn.q_proj.bias"} <= small
    assert_same_tensors({name: state[name] for name in small}, {name: stored[name] for name in small})
    assert all(not t.is_meta for t in state.values())


def build_model_meta(checkpoint: Path, config: NeuronConfig):
    from optimum_neuron_chunked.export.pipeline import load_hf_config
    from optimum_neuron_chunked.modeling import family_spec

    return model_from_spec(family_spec(load_hf_config(str(checkpoint))), config, device="meta")
