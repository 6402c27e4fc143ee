"""vLLM features the runner cannot honour are refused when the engine is built, naming the flag;
nothing is loaded and no engine is left behind."""

from __future__ import annotations

import pytest
from helpers import export_params

EXPORT = "llama-2x4x32-eager"


@pytest.mark.parametrize("export_dir", export_params([EXPORT]), indirect=True)
@pytest.mark.parametrize(
    "kwargs,flag,said",
    [
        (dict(enable_lora=True), "--enable-lora", "no LoRA adapter slots; re-export with --max-loras N"),
        (
            dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}),
            "--speculative-config",
            "not supported",
        ),
        (
            dict(kv_transfer_config={"kv_connector": "ExampleConnector", "kv_role": "kv_both"}),
            "--kv-transfer-config",
            "not supported",
        ),
        # an export's tensor parallelism is its own: vLLM's flag may only repeat it
        (dict(tensor_parallel_size=2), "--tensor-parallel-size 2", "differs from the export's 1"),
    ],
    ids=["lora", "speculative", "kv-transfer", "tensor-parallel"],
)
def test_unsupported_features_are_refused_at_start_up(export_dir, kwargs, flag, said):
    from vllm import LLM

    with pytest.raises(Exception, match=flag) as e:
        LLM(model=str(export_dir), seed=0, **kwargs)
    assert said in str(e.value)


@pytest.mark.parametrize("export_dir", export_params([EXPORT]), indirect=True)
def test_model_runner_v2_is_refused_naming_the_variable(export_dir, monkeypatch):
    from vllm import LLM

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(Exception, match="VLLM_USE_V2_MODEL_RUNNER") as e:
        LLM(model=str(export_dir), seed=0)
    assert "not supported" in str(e.value)


def vllm_version() -> str:
    import vllm

    return vllm.__version__


def test_every_refused_config_is_a_vllm_config_field():
    """The list follows vLLM: a renamed field would silently stop being refused."""
    import dataclasses

    from vllm.config import VllmConfig

    from optimum_neuron_chunked.vllm.features import UNSUPPORTED_CONFIGS

    fields = {f.name for f in dataclasses.fields(VllmConfig)}
    # vLLM 0.16.0 lacks the newest (diffusion, engram, weight transfer, watermark): nothing to refuse
    older = {"diffusion_config", "engram_config", "weight_transfer_config", "watermark_config"}
    assert set(UNSUPPORTED_CONFIGS) - older <= fields
    assert set(UNSUPPORTED_CONFIGS) <= fields or vllm_version() == "0.16.0"
