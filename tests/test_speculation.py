"""Verify graphs through the loader: generate() with prompt-lookup drafts verified K + 1 tokens
a row in one VF call gives transformers' greedy tokens, drafts accepted in part, in whole and
not at all, for whole-sequence-block and paged exports, across chunk and bucket edges and narrow widths."""

from __future__ import annotations

import pytest
import torch
from fixtures.export_models import BUCKETS, CHUNK, SEQUENCE_LENGTH, export_with

from optimum_neuron_chunked import NeuronModelForCausalLM, generation, prompt_lookup
from optimum_neuron_chunked.testing.reference import hf_greedy

K = 4
SHAPE = dict(batch_size=2, sequence_length=SEQUENCE_LENGTH, prefill_chunk_size=CHUNK, context_buckets=BUCKETS,
             decode_widths=(1, 2), speculation_length=K)  # fmt: skip
LAYOUTS = {"whole": {}, "paged": dict(kv_cache_blocks=16, kv_block_size=16)}


def repetitive(n: int, seed: int) -> torch.Tensor:
    """A prompt that repeats a span, so prompt lookup has something to draft."""
    span = torch.randint(4, 380, (11,), generator=torch.Generator().manual_seed(seed))
    return span.repeat(n // 11 + 1)[:n]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_prompt_lookup_generate_equals_transformers(layout, hf_reference, monkeypatch):
    model = NeuronModelForCausalLM.from_pretrained(export_with("llama", "eager", **SHAPE, **LAYOUTS[layout]))
    hf = hf_reference("llama")
    verified = []

    def recording(drafts, argmax):
        verified.append((len(drafts), len(accepted := prompt_lookup.accept_greedy(drafts, argmax)) - 1))
        return accepted

    monkeypatch.setattr(generation, "accept_greedy", recording)
    # prompts ending across a chunk edge; generation crosses bucket 64 for the second
    for prompts, new in (
        ([repetitive(CHUNK + 3, 1), repetitive(2 * CHUNK - 6, 2)], 24),
        ([repetitive(9, 3)], 20),
    ):
        padded = torch.nn.utils.rnn.pad_sequence([p.flip(0) for p in prompts], batch_first=True).flip(1)
        mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(p) for p in prompts], batch_first=True).flip(
            1
        )
        out = model.generate(
            padded, attention_mask=mask, max_new_tokens=new, do_sample=False, prompt_lookup_num_tokens=K
        )
        got = [out[i, padded.shape[1] :].tolist() for i in range(len(prompts))]
        assert got == [hf_greedy(hf, p, new) for p in prompts]
    drafted = [(d, a) for d, a in verified if d]
    assert any(a == d for d, a in drafted) and any(a < d for d, a in drafted), verified  # whole and part
    assert sum(a + 1 for _, a in verified) > len(verified)  # fewer verify calls than tokens


def test_prompt_lookup_needs_the_verify_graphs_and_greedy():
    model = NeuronModelForCausalLM.from_pretrained(export_with("llama", "eager", **SHAPE))
    ids = repetitive(20, 4)[None]
    with pytest.raises(ValueError, match="--speculation-length 5"):
        model.generate(ids, max_new_tokens=4, do_sample=False, prompt_lookup_num_tokens=K + 1)
    with pytest.raises(ValueError, match="do_sample=False"):
        model.generate(ids, max_new_tokens=4, do_sample=True, prompt_lookup_num_tokens=K)


def test_prompt_lookup_drafts_what_followed_the_latest_match():
    assert prompt_lookup.propose([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2) == [7, 1]
    assert prompt_lookup.propose([5, 6, 7], 3) == []
    assert prompt_lookup.accept_greedy([4, 5, 6], [4, 5, 9, 8]) == [4, 5, 9]
    assert prompt_lookup.accept_greedy([4, 5], [4, 5, 8]) == [4, 5, 8]
    assert prompt_lookup.accept_greedy([], [3]) == [3]
