"""The prefix cache's index and the platform's prefix-caching decision, without a model."""

from __future__ import annotations

import pytest

from optimum_neuron_chunked.vllm.prefix_index import (
    BlockCopy,
    PrefixHit,
    PrefixIndex,
    common_prefix_length,
    worth_waiting,
)


def test_the_longest_common_prefix_over_every_block_wins():
    index = PrefixIndex(min_hit=4)
    index.set(0, range(100))
    index.set(1, [*range(50), 7, 7])
    index.set(2, range(10))
    assert index.longest_hit([*range(60), 9]) == PrefixHit(0, 60)
    assert index.longest_hit([*range(50), 7, 7, 7]) == PrefixHit(1, 52)
    assert index.longest_hit([5, *range(30)]) is None  # differs at the first token


def test_a_hit_leaves_the_last_prompt_token_and_short_hits_are_not_worth_a_copy():
    index = PrefixIndex(min_hit=4)
    index.set(0, range(100))
    assert index.longest_hit(list(range(20))) == PrefixHit(0, 19)  # one token left to sample from
    assert index.longest_hit([0, 1, 2, 9, 9]) is None  # 3 < min_hit
    assert index.longest_hit([0]) is None


def test_admission_copies_unless_the_block_already_holds_the_hit():
    index = PrefixIndex(min_hit=4)
    index.set(0, range(100))
    prompt = [*range(40), 500, 501]
    hit = index.longest_hit(prompt)
    assert index.admit(1, prompt, hit) == BlockCopy(0, 1, 40)
    assert index.held(1).tolist() == list(range(40))  # what the copy puts there
    assert index.held(0).tolist() == list(range(100))  # the source keeps its tokens
    assert index.admit(0, prompt, PrefixHit(0, 40)) is None  # block affinity: no copy
    assert index.held(0).tolist() == list(range(40))  # the rest of block 0 will be overwritten


def test_admission_without_a_hit_forgets_what_the_block_held():
    index = PrefixIndex(min_hit=4)
    index.set(0, range(100))
    assert index.admit(0, [7, 8, 9], None) is None
    assert index.longest_hit(list(range(50))) is None


def test_a_request_waits_for_a_prefix_being_computed_only_if_it_saves_a_chunk():
    system = list(range(100))
    prompt = [*system, 500, 501]
    assert worth_waiting(prompt, 0, [[*system, 7]], min_gain=32)  # 100 tokens to gain
    assert worth_waiting(prompt, 60, [[*system, 7]], min_gain=32)  # 40 more than held now
    assert not worth_waiting(prompt, 80, [[*system, 7]], min_gain=32)  # 20: start now
    assert not worth_waiting(prompt, 0, [[9, *system]], min_gain=32)  # nothing shared
    assert not worth_waiting(prompt[:20], 0, [[*system, 7]], min_gain=32)  # a short prompt
    assert not worth_waiting(prompt, 0, [], min_gain=32)
    # paged: hits are whole blocks, so 100 shared tokens can be 96 at most with blocks of 16
    assert worth_waiting(prompt, 64, [[*system, 7]], min_gain=32, block=16)
    assert worth_waiting(prompt, 64, [[*system, 7]], min_gain=34)
    assert not worth_waiting(prompt, 64, [[*system, 7]], min_gain=34, block=16)  # 96 of the 100


@pytest.mark.parametrize("a,b,n", [([], [1], 0), ([1, 2], [1, 2], 2), ([1, 2, 3], [1, 2], 2), ([1], [2], 0)])
def test_common_prefix_length(a, b, n):
    import numpy as np

    assert common_prefix_length(np.array(a), np.array(b)) == n


def vllm_config(export_dir, **cache):
    from vllm.config import CacheConfig, ModelConfig, VllmConfig

    return VllmConfig(
        model_config=ModelConfig(model=str(export_dir), dtype="float32", seed=0),
        cache_config=CacheConfig(**cache),
    )


def connector_of(config) -> str | None:
    kv = config.kv_transfer_config
    return None if kv is None else f"{kv.kv_connector_module_path}.{kv.kv_connector}"


OURS = "optimum_neuron_chunked.vllm.connector.PrefixCopyConnector"


@pytest.mark.parametrize("export_dir", ["llama-2x4x32-eager"], indirect=True)
def test_prefix_caching_is_on_by_default_off_by_flag_and_the_decision_is_idempotent(export_dir):
    from optimum_neuron_chunked.vllm.platform import NeuronChunkedPlatform

    config = vllm_config(export_dir)  # vLLM's default: --enable-prefix-caching
    assert connector_of(config) == OURS
    assert config.cache_config.enable_prefix_caching is False  # vLLM's own stays off
    NeuronChunkedPlatform.check_and_update_config(config)  # the engine core's second call
    assert connector_of(config) == OURS
    off = vllm_config(export_dir, enable_prefix_caching=False)  # --no-enable-prefix-caching
    NeuronChunkedPlatform.check_and_update_config(off)
    assert connector_of(off) is None


@pytest.mark.parametrize(
    "export_dir,why",
    [("llama-2x1x128-eager", "standard export"), ("gemma3_text-2x4x32-eager", "sliding-window layers")],
    indirect=["export_dir"],
)
def test_exports_that_cannot_reuse_prefixes_serve_without(export_dir, why, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="vllm"):
        config = vllm_config(export_dir)
    assert connector_of(config) is None
    assert any(why in r.getMessage() and "prefix caching off" in r.getMessage() for r in caplog.records)
