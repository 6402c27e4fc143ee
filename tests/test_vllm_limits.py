"""vLLM arguments against the export: derived defaults and refusals that name the flag."""

from __future__ import annotations

import pytest
from helpers import export_params

from optimum_neuron_chunked.config import NeuronConfig
from optimum_neuron_chunked.vllm.limits import EngineRequest, ServingConfigError, serving_limits

CHUNKED = NeuronConfig(batch_size=4, sequence_length=1024, prefill_chunk_size=128, backend="eager")
STD = NeuronConfig(batch_size=4, sequence_length=1024, backend="eager")


def request(**kw) -> EngineRequest:
    base = dict(
        max_model_len=None,
        max_num_seqs=None,
        max_num_batched_tokens=None,
        long_prefill_token_threshold=0,
        dtype="float32",
    )
    return EngineRequest(**{**base, **kw})


def test_omitted_flags_take_the_export_values():
    limits = serving_limits(CHUNKED, request())
    assert (limits.max_model_len, limits.max_num_seqs) == (1024, 4)
    assert limits.max_num_batched_tokens == 256  # 3 other decodes + a full chunk, in whole chunks
    assert limits.long_prefill_token_threshold == 128
    assert limits.enable_chunked_prefill
    assert (limits.block_size, limits.num_blocks) == (1024, 5)


def test_the_default_budget_always_fits_the_other_decodes_and_a_full_chunk():
    from optimum_neuron_chunked.vllm.limits import full_chunk_budget

    for chunk in (1, 2, 16, 32, 128, 256):
        for seqs in (1, 2, 8, 31, 32, 33, 64, 256):
            budget = full_chunk_budget(chunk, seqs)
            assert budget >= seqs - 1 + chunk and budget % chunk == 0, (chunk, seqs)
            assert budget < seqs - 1 + 2 * chunk  # the smallest such multiple


def test_standard_export_schedules_whole_prompts():
    limits = serving_limits(STD, request(max_model_len=512))
    assert not limits.enable_chunked_prefill
    assert limits.max_num_batched_tokens == 512 + 4
    assert limits.long_prefill_token_threshold == 0
    with pytest.raises(ServingConfigError, match="--max-num-batched-tokens 100"):
        serving_limits(STD, request(max_num_batched_tokens=100))


def test_explicit_flags_within_the_export_are_kept():
    limits = serving_limits(
        CHUNKED,
        request(
            max_model_len=512, max_num_seqs=2, max_num_batched_tokens=1024, long_prefill_token_threshold=64
        ),
    )
    assert (limits.max_model_len, limits.max_num_seqs, limits.max_num_batched_tokens) == (512, 2, 1024)
    assert limits.long_prefill_token_threshold == 64
    # vLLM gets the export's pool whatever the flags: a whole-sequence block per batch row
    assert (limits.block_size, limits.num_blocks) == (1024, 5)


@pytest.mark.parametrize(
    "kw, flag, compiled",
    [
        (dict(max_model_len=4096), "--max-model-len 4096", "sequence_length 1024"),
        (dict(max_num_seqs=8), "--max-num-seqs 8", "batch_size 4"),
        (dict(dtype="bfloat16"), "--dtype bfloat16", "compiled dtype float32"),
        (dict(max_num_seqs=4, max_num_batched_tokens=2), "--max-num-batched-tokens 2", "--max-num-seqs 4"),
    ],
)
def test_refusals_name_the_flag_and_the_compiled_value(kw, flag, compiled):
    with pytest.raises(ServingConfigError) as e:
        serving_limits(CHUNKED, request(**kw))
    assert flag in str(e.value) and compiled in str(e.value)


def test_speculation_is_served_within_the_verify_graphs_and_widens_the_budget():
    speculating = NeuronConfig(
        batch_size=4, sequence_length=1024, prefill_chunk_size=128, speculation_length=4, backend="eager"
    )
    limits = serving_limits(speculating, request(speculative_method="ngram", speculative_tokens=3))
    assert limits.max_num_batched_tokens == 256  # 3 other decodes of 1 + 3 tokens + a full chunk
    k4 = serving_limits(speculating, request(speculative_method="ngram", speculative_tokens=4))
    assert k4.max_num_batched_tokens == 256 and k4.max_num_batched_tokens >= 3 * 5 + 128
    refusals = [
        (speculating, dict(speculative_method="ngram", speculative_tokens=5), "--speculation-length 5"),
        (CHUNKED, dict(speculative_method="ngram", speculative_tokens=2), "no verify graphs"),
        (speculating, dict(speculative_method="eagle", speculative_tokens=2), "n-gram proposer ("),
    ]
    for config, kw, says in refusals:
        with pytest.raises(ServingConfigError, match="--speculative-config") as e:
            serving_limits(config, request(**kw))
        assert says in str(e.value) and "not supported" in str(e.value)


@pytest.mark.parametrize("export_dir", export_params(["llama-2x4x32-eager"]), indirect=True)
@pytest.mark.parametrize(
    "kwargs, budget",
    [
        ({}, 64),  # the export's default
        ({"max_num_batched_tokens": 4096}, 64),  # equals vLLM's LLM-class default: read as not given
        ({"additional_config": {"max_num_batched_tokens": 4096}}, 4096),  # forced exactly
        ({"max_num_batched_tokens": 4096, "additional_config": {"max_num_batched_tokens": 2048}}, 2048),
        ({"max_num_batched_tokens": 100}, 100),  # no default: kept as typed
    ],
)
def test_budgets_through_vllm_llm(export_dir, kwargs, budget):
    """What vllm.LLM's engine actually schedules with, for values equal to vLLM's defaults."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    config = EngineArgs(model=str(export_dir), seed=0, **kwargs).create_engine_config(UsageContext.LLM_CLASS)
    assert config.scheduler_config.max_num_batched_tokens == budget


@pytest.mark.parametrize("export_dir", export_params(["llama-2x4x32-eager"]), indirect=True)
def test_a_forced_value_is_still_checked_against_the_export(export_dir):
    from vllm.engine.arg_utils import EngineArgs

    with pytest.raises(Exception, match=r"--max-num-seqs 256 exceeds the compiled batch_size 2"):
        EngineArgs(model=str(export_dir), additional_config={"max_num_seqs": 256}).create_engine_config()
    with pytest.raises(Exception, match=r"max_num_seqs must be a positive integer"):
        EngineArgs(model=str(export_dir), additional_config={"max_num_seqs": "4"}).create_engine_config()
