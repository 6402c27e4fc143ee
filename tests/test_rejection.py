"""Rejection sampling of model-free drafts: vLLM 0.32's own CPU path gives the same tokens on
identical inputs and random streams, and accepted tokens follow the target distribution."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from optimum_neuron_chunked.rejection import Drafts, accepted_tokens, rejection_sample

V = 16


def vllm_rejection_sample():
    """vLLM 0.32's rejection_sample on CPU tensors (its CPU platform's kernel overrides)."""
    from vllm.platforms.cpu import CpuPlatform

    if not hasattr(CpuPlatform, "register_triton_kernel_overrides"):
        pytest.skip("this vLLM has no CPU rejection sampler (0.16.0)")
    CpuPlatform.import_kernels()
    CpuPlatform.register_triton_kernel_overrides()
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.rejection_sampler import rejection_sample as theirs

    def run(drafts: Drafts, logits, bonus, generators):
        rows = len(drafts.counts)
        greedy = torch.zeros(rows, dtype=torch.bool)
        metadata = SamplingMetadata(
            temperature=torch.where(greedy, 0.0, 1.0), all_greedy=bool(greedy.all()),
            all_random=not bool(greedy.any()), top_p=None, top_k=None, generators=generators,
            max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
            frequency_penalties=torch.zeros(rows), presence_penalties=torch.zeros(rows),
            repetition_penalties=torch.ones(rows), output_token_ids=[[] for _ in range(rows)],
            allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors(),
        )  # fmt: skip
        cumulative = torch.tensor(drafts.counts, dtype=torch.int32).cumsum(0).to(torch.int32)
        out = theirs(drafts.token_ids.to(torch.int32), list(drafts.counts), max(drafts.counts), cumulative,
                     None, logits.clone(), bonus[:, None].clone(), metadata)  # fmt: skip
        return out.to(torch.int64)

    return run


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")
def test_tokens_equal_vllms_cpu_path_on_the_same_random_streams():
    """Random rows (greedy ones accept on the device's argmax: prompt_lookup.accept_greedy)."""
    theirs = vllm_rejection_sample()
    for trial in range(40):
        source = torch.Generator().manual_seed(trial)
        counts = [int(n) for n in torch.randint(0, 5, (4,), generator=source)]
        counts[trial % 4] = max(counts[trial % 4], 1)
        logits = torch.randn(sum(counts), V, generator=source) * 2
        # drafts often equal to the argmax, so that some rows accept several
        argmax = logits.argmax(-1)
        noise = torch.randint(0, V, argmax.shape, generator=source)
        ids = torch.where(torch.rand(argmax.shape, generator=source) < 0.6, argmax, noise)
        drafts = Drafts(ids, tuple(counts))
        bonus = torch.randint(0, V, (4,), generator=source)
        seeded = {r: trial * 10 + r for r in range(4) if (r + trial) % 2}
        got = []
        for implementation in (rejection_sample, theirs):
            torch.manual_seed(1000 + trial)
            generators = {r: torch.Generator().manual_seed(s) for r, s in seeded.items()}
            got.append(implementation(drafts, logits, bonus, generators))
        assert torch.equal(got[0], got[1]), (trial, counts, got)


def first_tokens(sample, target: torch.Tensor, draft: int, trials: int) -> torch.Tensor:
    """Counts of the first token emitted after one draft `draft`, over `trials` steps."""
    logits = target.log()[None]
    counts = torch.zeros(len(target))
    torch.manual_seed(0)
    for _ in range(trials):
        out = sample(Drafts(torch.tensor([draft]), (1,)), logits, torch.tensor([0]), {})
        counts[accepted_tokens(out)[0][0]] += 1
    return counts


def always_accept(drafts, logits, bonus, generators):
    return torch.cat([drafts.token_ids, bonus])[None]


def test_accepted_tokens_follow_the_target_distribution():
    target = torch.tensor([0.1, 0.2, 0.3, 0.4])
    trials = 4000

    def chi_square(counts):
        expected = target * trials
        return float(((counts - expected) ** 2 / expected).sum())

    critical = 16.27  # chi-square, 3 degrees of freedom, p = 0.001
    assert chi_square(first_tokens(rejection_sample, target, draft=3, trials=trials)) < critical
    assert chi_square(first_tokens(rejection_sample, target, draft=0, trials=trials)) < critical
    assert chi_square(first_tokens(always_accept, target, draft=0, trials=trials)) > critical
