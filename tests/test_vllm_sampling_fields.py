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


def test_the_grammar_bitmask_row_of_a_request_follows_the_drafts_scheduled_before_it():
    """The scheduler's bitmask holds a row per token and draft of each structured request (0.32
    pads an admitted one-token request with -1 drafts): each request is masked by its own first row."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    from optimum_neuron_chunked.vllm.sampling import apply_grammar

    allow = {"a": 3, "b": 7}  # the one token each request's first row allows (32-token vocabulary)
    rows = []
    for req_id, n_drafts in (("a", 2), ("b", 0)):
        first = np.zeros(1, dtype=np.int32)
        first[0] = 1 << allow[req_id]
        rows += [first] + [np.full(1, -1, dtype=np.int32)] * n_drafts  # draft rows: anything
    grammar = SimpleNamespace(structured_output_request_ids=["a", "b"], grammar_bitmask=np.stack(rows))
    logits = torch.zeros(3, 32)
    apply_grammar(grammar, {"x": 0, "a": 1, "b": 2}, logits, {"a": [-1, -1]})
    assert logits[0].isfinite().all()  # not a structured request
    assert [int(logits[i].argmax()) for i in (1, 2)] == [allow["a"], allow["b"]]
    assert all(int(logits[i].isfinite().sum()) == 1 for i in (1, 2))
