"""Every SamplingParams field is either implemented by the TG graph's sampler, harmless to it
(acts after sampling), or sends the request to vLLM's host sampler - never dropped."""

from __future__ import annotations

import msgspec
import pytest
from helpers import export_params, generate, prompt

from optimum_neuron_chunked.vllm.sampling import DEVICE_FIELDS, OUTPUT_FIELDS, host_fields, on_device_eligible


def all_fields() -> list[str]:
    from vllm import SamplingParams

    return [f.name for f in msgspec.structs.fields(SamplingParams)]


@pytest.mark.parametrize("field", all_fields())
def test_a_field_set_away_from_its_default_is_honoured(field):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0)
    default = getattr(params, field)
    setattr(params, field, object())  # any value other than the default
    assert getattr(params, field) != default
    if field in OUTPUT_FIELDS:
        assert on_device_eligible(params, max_topk=256, vocab_size=512)
    elif field not in DEVICE_FIELDS:
        assert host_fields(params) == [field]
        assert not on_device_eligible(params, max_topk=256, vocab_size=512)


@pytest.mark.parametrize(
    "export_dir", export_params(["llama-2x4x32-eager", "llama-2x4x32-xla"]), indirect=True
)
@pytest.mark.parametrize("asked", [dict(temperature=0.0), dict(temperature=0.8, top_k=5, top_p=0.9)])
def test_plain_requests_as_vllm_prepares_them_sample_on_device(export_dir, llm, asked):  # noqa: F811
    """The runner sees the parameters after vLLM's front end has filled in what it resolves
    itself (stop ids, watermarking, ...): those must not send a plain request to the host."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    request = engine.input_processor.process_inputs(
        "plain", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4, **asked),
        supported_tasks=engine.get_supported_tasks(),
    )  # fmt: skip
    assert host_fields(request.sampling_params) == []
    assert on_device_eligible(request.sampling_params, max_topk=256, vocab_size=512)


@pytest.mark.parametrize("export_dir", export_params(["llama-2x4x32-eager"]), indirect=True)
def test_logprob_token_ids_come_with_every_token(export_dir, llm):  # noqa: F811
    from vllm import SamplingParams

    if "logprob_token_ids" not in SamplingParams.__struct_fields__:
        pytest.skip("this vLLM has no SamplingParams.logprob_token_ids (added after 0.16.0)")

    out = generate(llm, [prompt(9)], SamplingParams(max_tokens=4, temperature=0.0, logprob_token_ids=[5, 6]))[
        0
    ]
    assert len(out.token_ids) == 4
    assert len(out.logprobs) == 4 and all({5, 6} <= set(step) for step in out.logprobs)


@pytest.mark.parametrize(
    "export_dir", export_params(["llama-2x4x32-eager", "llama-2x4x32-xla"]), indirect=True
)
def test_greedy_with_min_tokens_and_seed_decode_on_the_host(export_dir, llm):  # noqa: F811
    from vllm import SamplingParams

    plain = generate(llm, [prompt(9)], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    seeded = generate(
        llm, [prompt(9)], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, seed=3)
    )[0]
    assert seeded.token_ids == plain.token_ids  # greedy: a seed changes nothing, on any path
