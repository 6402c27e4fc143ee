"""vllm.LLM on std and chunked exports, through the platform plugin, against HF transformers."""

from __future__ import annotations

import pytest
import torch
from fixtures.export_models import CHUNK, EXPORTS
from helpers import NEW_TOKENS, export_params, generate, greedy, prompt

from optimum_neuron_chunked.testing.reference import hf_greedy

PROMPT_LENGTHS = (1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5)
ENGINE_EXPORTS = ["llama-2x4x32-eager", "llama-2x1x128-eager", "qwen3_moe-2x4x32-cpu", "llama-2x1x128-cpu"]


@pytest.mark.parametrize("export_dir", export_params(ENGINE_EXPORTS), indirect=True)
def test_greedy_tokens_match_transformers_alone_and_batched(export_dir, llm, hf_reference):
    hf = hf_reference(EXPORTS[export_dir.name.rsplit("-", 1)[0]].family)
    prompts = [prompt(n, seed=1) for n in PROMPT_LENGTHS]
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    alone = [generate(llm, [p], greedy())[0].token_ids for p in prompts]
    batched = [o.token_ids for o in generate(llm, prompts, greedy())]
    assert [list(t) for t in alone] == expected
    assert [list(t) for t in batched] == expected


@pytest.mark.parametrize("export_dir", export_params(ENGINE_EXPORTS[:2]), indirect=True)
def test_logprobs_match_transformers(export_dir, llm, hf_reference):
    hf = hf_reference(EXPORTS[export_dir.name.rsplit("-", 1)[0]].family)
    ids = prompt(CHUNK + 7, seed=2)
    (out,) = generate(llm, [ids], greedy(6, logprobs=3))
    full = torch.cat([ids, torch.tensor(out.token_ids)])
    with torch.no_grad():
        expected = torch.log_softmax(hf(full[None]).logits[0].float(), dim=-1)
    for step, (token, logprobs) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = expected[ids.shape[0] - 1 + step]
        assert set(logprobs) >= set(row.topk(3).indices.tolist())
        for tok, lp in logprobs.items():
            assert lp.logprob == pytest.approx(row[tok].item(), abs=1e-4)
        assert logprobs[token].rank == 1


@pytest.mark.parametrize("export_dir", export_params(ENGINE_EXPORTS[:2]), indirect=True)
def test_repetition_penalty_matches_transformers(export_dir, llm, hf_reference):
    hf = hf_reference(EXPORTS[export_dir.name.rsplit("-", 1)[0]].family)
    ids = prompt(2 * CHUNK + 3, seed=3)
    (out,) = generate(llm, [ids], greedy(12, repetition_penalty=1.8))
    assert list(out.token_ids) == hf_greedy(hf, ids, 12, repetition_penalty=1.8)
    assert list(out.token_ids) != hf_greedy(hf, ids, 12)  # the penalty changed something


@pytest.mark.parametrize("export_dir", export_params(ENGINE_EXPORTS[:2]), indirect=True)
def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(export_dir, llm):
    from vllm import SamplingParams

    ids = prompt(CHUNK + 9, seed=4)
    others = [prompt(n, seed=5) for n in (3 * CHUNK, 7)]
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    first = generate(llm, [ids], seeded)[0].token_ids
    again = generate(llm, [ids], seeded)[0].token_ids
    in_batch = generate(llm, [*others, ids], [greedy(), greedy(), seeded])[2].token_ids
    other_seed = generate(
        llm, [ids], SamplingParams(max_tokens=16, temperature=1.0, seed=99, ignore_eos=True)
    )
    assert first == again == in_batch
    assert other_seed[0].token_ids != first


@pytest.mark.parametrize("export_dir", export_params(ENGINE_EXPORTS[:1]), indirect=True)
def test_on_device_sampling_respects_top_k_one_and_temperature(export_dir, llm, hf_reference):
    """top_k=1 at temperature 1 takes the on-device path and must equal greedy."""
    from vllm import SamplingParams

    hf = hf_reference("llama")
    prompts = [prompt(n, seed=6) for n in (5, CHUNK + 1)]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, top_k=1, ignore_eos=True)
    outs = generate(llm, prompts, params)
    assert [list(o.token_ids) for o in outs] == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
