"""Prompt logprobs from an export compiled with --prompt-logprobs: every position's logits,
chunk by chunk, equal to transformers' log-softmax across chunk boundaries - through the
loader and through vLLM (the loglikelihood requests evaluation harnesses send)."""

from __future__ import annotations

import pytest
import torch
from fixtures.export_models import checkpoint_path
from helpers import prompt

from optimum_neuron_chunked import NeuronModelForCausalLM
from optimum_neuron_chunked.export.pipeline import export

CHUNK = 16


@pytest.fixture(scope="module")
def logits_export(tmp_path_factory):
    out = tmp_path_factory.mktemp("prompt-logprobs") / "out"
    return export(str(checkpoint_path("llama")), out, batch_size=2, sequence_length=128,
                  prefill_chunk_size=CHUNK, backend="eager", prompt_logprobs=True)  # fmt: skip


def hf_log_softmax(hf_reference, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf_reference("llama")(ids[None]).logits[0].float(), dim=-1)


def test_every_position_s_logits_equal_transformers_across_chunks(logits_export, hf_reference):
    model = NeuronModelForCausalLM.from_pretrained(logits_export)
    ids = prompt(3 * CHUNK + 5, seed=80)
    blocks = model.kv_pool.acquire(len(ids))
    rows = [
        model.runner.prefill(ids[start : start + CHUNK], start, blocks, every_position=True)
        for start in range(0, len(ids), CHUNK)
    ]
    got = torch.log_softmax(torch.cat(rows), dim=-1)
    torch.testing.assert_close(got, hf_log_softmax(hf_reference, ids), atol=1e-4, rtol=0)
    assert torch.equal(model.runner.prefill(ids[:CHUNK], 0, blocks), rows[0][-1])  # last row = prefill's


@pytest.mark.slow
def test_vllm_serves_prompt_logprobs_equal_to_transformers(logits_export, hf_reference):
    """A loglikelihood request (prompt = context + continuation, prompt_logprobs=1, one token
    out), beside a request without prompt logprobs; the prompt spans several chunks."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(logits_export), seed=0)
    try:
        scored, other = prompt(3 * CHUNK + 7, seed=81), prompt(20, seed=82)
        outputs = llm.generate(
            [{"prompt_token_ids": scored.tolist()}, {"prompt_token_ids": other.tolist()}],
            [
                SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2),
                SamplingParams(max_tokens=4, temperature=0),
            ],
        )
    finally:
        llm.llm_engine.engine_core.shutdown()
    want = hf_log_softmax(hf_reference, scored)
    got = outputs[0].prompt_logprobs
    assert len(got) == len(scored) and got[0] is None
    for i in range(1, len(scored)):
        token = int(scored[i])
        assert abs(got[i][token].logprob - float(want[i - 1, token])) < 1e-4, i
        top2 = torch.topk(want[i - 1], 2).indices.tolist()
        assert set(top2) <= set(got[i]), (i, top2, list(got[i]))
    continuation = slice(len(scored) - 5, len(scored))  # the harness's loglikelihood of a continuation
    loglikelihood = sum(got[i][int(scored[i])].logprob for i in range(len(scored))[continuation])
    expected = sum(float(want[i - 1, int(scored[i])]) for i in range(len(scored))[continuation])
    assert abs(loglikelihood - expected) < 5e-4
    assert outputs[1].prompt_logprobs is None and len(outputs[1].outputs[0].token_ids) == 4


@pytest.mark.slow
def test_prompt_logprob_variants_the_runner_does_not_compute_are_refused(logits_export):
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(logits_export), seed=0)
    try:
        # vLLM itself refuses prompt_logprob_start without prompt_logprob_token_ids
        for kw in (
            dict(prompt_logprob_token_ids=[[5, 6]] * 9),
            dict(prompt_logprob_token_ids=[[5]] * 6, prompt_logprob_start=3),
        ):
            with pytest.raises(Exception, match="prompt_logprob_token_ids"):  # by vLLM (V1 runner) or us
                llm.generate([{"prompt_token_ids": list(range(4, 14))}], SamplingParams(max_tokens=1, **kw))
        ok = llm.generate([{"prompt_token_ids": list(range(4, 14))}], SamplingParams(max_tokens=2))
        assert len(ok[0].outputs[0].token_ids) == 2  # the engine serves on
    finally:
        llm.llm_engine.engine_core.shutdown()
