"""`vllm serve MODEL` where MODEL is a plain checkpoint: the platform exports it with what
vLLM's flags say (vllm/export_options.py) into the export cache, then serves that export; a
second start finds the entry; every refusal names its flag, before any work."""

from __future__ import annotations

import json

import pytest
from fixtures.export_models import checkpoint_path
from helpers import generate, greedy, prompt

from optimum_neuron_chunked.export_cache import entries
from optimum_neuron_chunked.testing.reference import hf_greedy

SHAPES = dict(max_model_len=64, max_num_seqs=2)
EXPORT_KEYS = {"prefill_chunk_size": 16, "backend": "eager"}


def engine(model: str, **kwargs):
    from vllm import LLM

    return LLM(model=model, seed=0, **(SHAPES | kwargs))


def test_a_plain_checkpoint_is_exported_once_and_served_as_transformers(tmp_path, monkeypatch, hf_reference):
    monkeypatch.setenv("ONC_EXPORT_CACHE", str(tmp_path / "cache"))
    model = str(checkpoint_path("llama"))
    prompts = [prompt(n, seed=9) for n in (5, 40)]
    expected = [hf_greedy(hf_reference("llama"), p, 8) for p in prompts]
    created = None
    for start in ("first", "second"):
        llm = engine(model, additional_config=EXPORT_KEYS)
        try:
            assert [list(o.token_ids) for o in generate(llm, prompts, greedy(8))] == expected, start
            assert llm.llm_engine.model_config.served_model_name == model
        finally:
            llm.llm_engine.engine_core.shutdown()
        ((entry, record),) = entries()
        created = created or record["created"]
        assert record["created"] == created  # the second start built nothing
    config = json.loads((entry / "neuron_config.json").read_text())
    assert (config["batch_size"], config["sequence_length"], config["prefill_chunk_size"]) == (2, 64, 16)
    assert config["dtype"] == "float32"  # `auto` on a float32 checkpoint, off the neuron backend


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(additional_config={"batch_size": 4}), "--additional-config batch_size: pass vLLM's --max-num-seqs"),
        (dict(additional_config={"prefil_chunk_size": 8}), "'prefil_chunk_size' (did you mean 'prefill_chunk_size'?)"),
        (dict(additional_config={"prefill_chunk_size": 100}), "prefill_chunk_size (100) exceeds sequence_length (64)"),
        (dict(additional_config={"backend": "tpu"}), "unknown backend 'tpu'"),
        (dict(additional_config={"quantization": "int8"}, quantization="fp8", dtype="bfloat16"),
         "--quantization fp8 and --additional-config quantization 'int8' disagree"),
        (dict(additional_config=EXPORT_KEYS, tensor_parallel_size=2), "--tensor-parallel-size 2 shards the export"),
    ],
)  # fmt: skip
def test_each_refusal_names_its_flag_before_any_work(tmp_path, monkeypatch, kwargs, message):
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setenv("ONC_EXPORT_CACHE", str(tmp_path / "cache"))
    args = EngineArgs(model=str(checkpoint_path("llama")), **(SHAPES | kwargs))
    with pytest.raises(Exception, match="") as refused:
        args.create_engine_config()
    assert message in " ".join(str(refused.value).split())
    assert not (tmp_path / "cache").exists() or not entries()


def test_an_fp8_checkpoint_is_served_in_bf16_with_its_own_fp8_weights(tmp_path, monkeypatch):
    """vLLM reads the checkpoint's FP8 quantization itself (and refuses it with float32): the
    export keeps the checkpoint's FP8 weights and scales; served tokens equal the loader's on the
    same export (bf16 differs from transformers' by rounding: the fp32 path is checked there)."""
    from fixtures.export_models import fp8_checkpoint_path

    from optimum_neuron_chunked import NeuronModelForCausalLM

    monkeypatch.setenv("ONC_EXPORT_CACHE", str(tmp_path / "cache"))
    source = fp8_checkpoint_path("llama")
    prompts = [prompt(n, seed=50 + i) for i, n in enumerate((1, 33, 50))]
    llm = engine(str(source), dtype="bfloat16", additional_config=EXPORT_KEYS)
    try:
        served = [list(o.token_ids) for o in generate(llm, prompts, greedy(8))]
    finally:
        llm.llm_engine.engine_core.shutdown()
    ((entry, record),) = entries()
    assert (record["options"]["dtype"], json.loads((entry / "neuron_config.json").read_text())["quantization"]) == (
        "bfloat16", "fp8")  # fmt: skip
    model = NeuronModelForCausalLM.from_pretrained(entry)
    loaded = [model.generate(p[None], max_new_tokens=8, do_sample=False, eos_token_id=-1)[0, len(p):].tolist()
              for p in prompts]  # fmt: skip
    assert served == loaded
