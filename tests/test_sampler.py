from __future__ import annotations

import torch

from optimum_neuron_chunked.modeling.sampler import sample, sampling_params


def params(n, **kw):
    return torch.tensor([sampling_params(**kw)] * n)


def test_greedy_when_temperature_zero_or_top_k_one():
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    rand = torch.rand(8)
    assert torch.equal(sample(logits, params(8, temperature=0.0), rand, 16), logits.argmax(-1))
    assert torch.equal(sample(logits, params(8, top_k=1, temperature=1.0), rand, 16), logits.argmax(-1))


def test_tiny_top_p_keeps_only_the_best_token():
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(1))
    got = sample(logits, params(8, top_p=1e-6, temperature=1.0), torch.rand(8), 16)
    assert torch.equal(got, logits.argmax(-1))


def test_top_k_restricts_candidates_and_rand_picks_among_them():
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0, -1.0]])
    seen = {
        int(sample(logits, params(1, top_k=3, temperature=10.0), torch.tensor([r]), 4))
        for r in torch.linspace(0, 0.999, 50).tolist()
    }
    assert seen == {1, 2, 3}


def test_sampling_follows_the_softmax_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    rand = torch.rand(20000, generator=torch.Generator().manual_seed(2))
    got = sample(logits.expand(20000, -1), params(20000, temperature=1.0), rand, 3)
    freq = torch.bincount(got, minlength=3).float() / 20000
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.3, 0.2]), atol=0.02, rtol=0)


def test_same_random_numbers_same_tokens():
    logits = torch.randn(4, 50)
    rand = torch.rand(4, generator=torch.Generator().manual_seed(3))
    p = params(4, top_k=20, top_p=0.9, temperature=0.8)
    assert torch.equal(sample(logits, p, rand, 32), sample(logits, p, rand.clone(), 32))


def test_staged_topk_equals_topk():
    from optimum_neuron_chunked.modeling.sampler import stage_groups, staged_topk

    for vocab, k in [(50, 16), (512, 8), (1000, 7), (32000, 256), (151936, 64)]:
        logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(vocab))
        want_values, want_ids = torch.topk(logits, k)
        values, ids = staged_topk(logits, k)
        assert torch.equal(values, want_values) and torch.equal(ids, want_ids), (vocab, k)
    assert (
        stage_groups(20, 16) == 1
        and stage_groups(50, 16) == 2
        and stage_groups(512, 8) == 8
        and stage_groups(151936, 64) == 49
    )
