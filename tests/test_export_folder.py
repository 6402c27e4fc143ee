"""What an export serves, read off its two configs before any graph loads, agrees with the
decoder the backends build: the KV cache vLLM is told about and the ring (sliding-window)
layers that turn prefix caching off."""

from __future__ import annotations

import pytest
from fixtures.export_models import checkpoint_path
from transformers import AutoConfig

from optimum_neuron_chunked.config import NeuronConfig
from optimum_neuron_chunked.export_folder import ExportCapabilities
from optimum_neuron_chunked.modeling import build_model
from optimum_neuron_chunked.testing.checkpoints import FAMILIES

SEQUENCE_LENGTH, CHUNK = 128, 32


@pytest.mark.parametrize("chunk", [CHUNK, 0], ids=["chunked", "std"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_capabilities_describe_the_decoders_kv_cache(family, chunk):
    hf = AutoConfig.from_pretrained(checkpoint_path(family))
    config = NeuronConfig(
        batch_size=2, sequence_length=SEQUENCE_LENGTH, prefill_chunk_size=chunk, backend="eager"
    )
    caps = ExportCapabilities.of(config, hf)
    model = build_model(hf, config)
    caches = [getattr(model, f"{kv}_cache_{i}") for i in range(hf.num_hidden_layers) for kv in "kv"]
    assert {tuple(c.shape[i] for i in (1, 3)) for c in caches} == {(caps.kv.num_kv_heads, caps.kv.head_dim)}
    assert {c.dtype for c in caches} == {caps.kv.dtype}
    assert caps.kv.cache_lengths == tuple(
        getattr(model, f"k_cache_{i}").shape[2] for i in range(caps.kv.num_layers)
    )
    # the pool of one whole-sequence block per batch row
    assert (caps.kv.num_blocks, caps.kv.block_size, caps.kv.whole_sequence_blocks) == (
        config.batch_size,
        SEQUENCE_LENGTH,
        True,
    )
    assert {c.shape[0] for c in caches} == {caps.kv.num_blocks}
    assert caps.kv.bytes_per_block * caps.kv.num_blocks == sum(c.nbytes for c in caches)
    rings = tuple(i for i, n in enumerate(caps.kv.cache_lengths) if n < SEQUENCE_LENGTH)
    assert caps.kv.ring_layers == rings
    if not chunk:  # a CE call writes a whole prompt at once: standard exports keep every position
        assert rings == ()
    # the rule vLLM's KV spec used to re-derive from the HF config
    assert caps.kv.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    assert caps.kv.num_kv_heads == hf.num_key_value_heads


def test_some_test_family_keeps_rings_when_chunked():
    """So the test above meets ring layers at all (gemma3's sliding layers, windows < S - C)."""
    rings = {
        family: ExportCapabilities.of(
            NeuronConfig(
                batch_size=2, sequence_length=SEQUENCE_LENGTH, prefill_chunk_size=CHUNK, backend="eager"
            ),
            AutoConfig.from_pretrained(checkpoint_path(family)),
        ).kv.ring_layers
        for family in FAMILIES
    }
    assert rings["gemma3_text"] and not rings["llama"]
