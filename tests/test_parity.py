"""Std and chunked exports against HF transformers on the same checkpoint (fp32)."""

from __future__ import annotations

import pytest
import torch
from fixtures.export_models import CHUNK, EXPORTS
from helpers import export_params, prompt

from optimum_neuron_chunked.config import NeuronConfig
from optimum_neuron_chunked.generation import prefill_prompt

# 1, C-1, C, C+1 and 3C+5 tokens: single token, partial, exact and overflowing chunks.
PROMPT_LENGTHS = (1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5)
LOGITS_TOLERANCE = 1e-4  # fp32; observed differences are ~1e-5
NEW_TOKENS = 12


# xla exports of llama alone (~10 s each on XLA's CPU device; test_xla generates with every family's)
PARITY_EXPORTS = [i for i, spec in EXPORTS.items() if spec.backend != "xla" or spec.family == "llama"]


def family_of(export_id: str) -> str:
    return EXPORTS[export_id].family


@pytest.mark.parametrize("export_dir", export_params(PARITY_EXPORTS), indirect=True)
@pytest.mark.parametrize("length", PROMPT_LENGTHS)
def test_prefill_logits_and_greedy_tokens_match_transformers(export_dir, neuron_model, hf_reference, length):
    hf = hf_reference(neuron_model.config.model_type)
    ids = prompt(length)
    with torch.no_grad():
        expected_logits = hf(ids[None]).logits[0, -1]
    logits = prefill_prompt(neuron_model.runner, ids, (1,))
    torch.testing.assert_close(logits, expected_logits, atol=LOGITS_TOLERANCE, rtol=0)
    # logits are peaked enough that greedy does not hinge on rounding
    top2 = expected_logits.topk(2).values
    assert top2[0] - top2[1] > 10 * LOGITS_TOLERANCE

    output = neuron_model.generate(ids[None], max_new_tokens=NEW_TOKENS, do_sample=False)
    expected = hf.generate(ids[None], max_new_tokens=NEW_TOKENS, do_sample=False)
    assert output.tolist() == expected.tolist()


@pytest.mark.parametrize("export_dir", export_params(PARITY_EXPORTS), indirect=True)
def test_left_padded_batch_matches_transformers(export_dir, neuron_model, hf_reference):
    hf = hf_reference(neuron_model.config.model_type)
    pad = hf.generation_config.pad_token_id
    lengths = (3 * CHUNK + 5, CHUNK - 1)
    width = max(lengths)
    input_ids = torch.full((len(lengths), width), pad)
    attention_mask = torch.zeros_like(input_ids)
    for row, n in enumerate(lengths):
        input_ids[row, width - n :] = prompt(n, seed=row)
        attention_mask[row, width - n :] = 1
    output = neuron_model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=NEW_TOKENS)
    expected = hf.generate(
        input_ids, attention_mask=attention_mask, max_new_tokens=NEW_TOKENS, do_sample=False
    )
    assert output.tolist() == expected.tolist()
    # and each row equals its unpadded single run
    for row, n in enumerate(lengths):
        alone = neuron_model.generate(input_ids[row : row + 1, width - n :], max_new_tokens=NEW_TOKENS)
        assert output[row, width:].tolist()[: alone.shape[1] - n] == alone[0, n:].tolist()
    assert neuron_model.kv_pool.num_free == neuron_model.neuron_config.batch_size


def test_gemma3_with_only_local_layers_matches_transformers():
    """No full-attention layer (sliding_window_pattern 6 > num layers): transformers 5.x then
    builds no full-attention rotary, which our unused global rotary must not need."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    from optimum_neuron_chunked.modeling import family_spec
    from optimum_neuron_chunked.modeling.decoder import DecoderModel
    from optimum_neuron_chunked.modeling.kv_layout import KVLayout

    config = Gemma3TextConfig(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=2,
        vocab_size=400,
        sliding_window=24,
        initializer_range=0.25,
    )
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    spec = family_spec(config)
    model = DecoderModel(spec, KVLayout.of(NeuronConfig(batch_size=1, sequence_length=64), spec))
    model.load_weights(model.weights_from_hf(hf))
    ids = prompt(50)[None]
    with torch.no_grad():
        logits = model.logits(model.hidden_states(ids, torch.arange(50)[None], torch.tensor([[0]]), 64))
        torch.testing.assert_close(logits, hf(ids).logits, atol=LOGITS_TOLERANCE, rtol=0)
