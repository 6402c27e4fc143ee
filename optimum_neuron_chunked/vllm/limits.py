"""What vLLM may ask of an export: its arguments checked against the compiled shapes, and the
scheduler settings derived from them. Pure, so every refusal is unit-tested.

Derived settings (each overridable by its usual vLLM flag):
  --max-model-len            sequence_length (the compiled KV-cache length)
  --max-num-seqs             batch_size (a decode row per request)
  --max-num-batched-tokens   chunked: full_chunk_budget (every row's decode plus a full chunk,
                             rounded up to whole chunks). Standard: max_model_len + max_num_seqs,
                             so a whole prompt always fits (standard exports cannot split prompts).
  --long-prefill-token-threshold   chunked: prefill_chunk_size, so one request's share of a
                             step stays one chunk if the budget is raised
The KV cache is presented to vLLM as one group: the export's pool of P-token blocks, P a whole
sequence by default (--num-gpu-blocks-override may shrink it).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import NeuronConfig, ceil_div
from ..modeling.eagle3 import chain_top
from ..modeling.kv_layout import KVPool
from .compat import FIRST_CHUNK_HAS_LOOKAHEAD
from .kv_blocks import pool_blocks, vllm_num_blocks


class ServingConfigError(ValueError):
    """vLLM arguments that the compiled graphs cannot serve; the message names the flag."""


@dataclass(frozen=True)
class EngineRequest:
    """vLLM's view before the platform adjusts it. None: the user did not give the flag."""

    max_model_len: int | None
    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    long_prefill_token_threshold: int  # 0 = unset
    dtype: str
    num_gpu_blocks_override: int | None = None
    speculative_method: str | None = None  # --speculative-config's method (None: no speculation)
    speculative_tokens: int = 0  # its num_speculative_tokens
    speculative_head: str | None = None  # its model: eagle3's head
    speculative_options: tuple[str, ...] = ()  # its drafting options away from vLLM's defaults


@dataclass(frozen=True)
class ServingLimits:
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    long_prefill_token_threshold: int
    enable_chunked_prefill: bool
    block_size: int  # the export's P (KVPool.block_size)
    num_blocks: int  # the pool's blocks + vLLM's null block


def full_chunk_budget(chunk: int, max_num_seqs: int, tokens_per_decode: int = 1) -> int:
    """The default token budget of a chunked export: every other row's decode plus a full
    chunk fit (decodes are scheduled first; a budget of C left C - decodes, down to one
    token while the CP graph computes C), rounded up to whole chunks because vLLM gives a
    request running alone the whole budget, ignoring long_prefill_token_threshold: it then
    runs whole chunks back to back, never a sliver (vLLM 0.32; 0.16.0 caps it at one chunk a
    step, compat.LONE_PREFILL_TAKES_BUDGET). With speculation a decode takes its token and
    its drafts (`tokens_per_decode`)."""
    return ceil_div(chunk + (max_num_seqs - 1) * tokens_per_decode, chunk) * chunk


SPECULATIVE_METHODS = ("ngram", "eagle3")
# Scheduler settings --additional-config gives exactly: vLLM cannot tell them from its defaults
# (platform._engine_request); they are not export options (export_options.py).
EXACT_FLAGS = ("max_num_batched_tokens", "max_num_seqs")
NGRAM = '{"method": "ngram", "num_speculative_tokens": K}'
EAGLE3 = '{"method": "eagle3", "model": HEAD, "num_speculative_tokens": K}'


def check_speculative_method(method: str | None, options: tuple[str, ...] = ()) -> None:
    """Refuse a --speculative-config method the runner cannot draft with (None: no speculation),
    or drafting options it does not follow (`options`: compat.drafting_options)."""
    if method not in (None, *SPECULATIVE_METHODS):
        raise ServingConfigError(
            f"--speculative-config method {method!r} is not supported: the runner drafts with vLLM's "
            f"n-gram proposer ({NGRAM}) or an EAGLE3 head compiled into the export ({EAGLE3})."
        )
    if method is not None and options:
        raise ServingConfigError(
            f"--speculative-config {', '.join(options)} is not supported: drafts here are greedy "
            "chains of num_speculative_tokens, verified by vLLM's standard rejection rule (its padded "
            "drafter batch); drop it."
        )


def check_speculation(config: NeuronConfig, request: EngineRequest) -> int:
    """Tokens a decode row carries: 1, or 1 + K when --speculative-config asks for a method the
    runner serves (vLLM's n-gram proposer, or the export's EAGLE3 head) within the export's
    verify graphs."""
    method, k = request.speculative_method, request.speculative_tokens
    check_speculative_method(method, request.speculative_options)
    if method is None:
        return 1
    if method == "eagle3" and not config.speculation_head:
        raise ServingConfigError(
            "--speculative-config method 'eagle3' drafts with the export's EAGLE3 head, and this "
            "export has none: re-export with --speculation-head HEAD --speculation-length K (the export "
            "keeps the head's config in eagle3_head/, the speculative_config model to pass), or serve "
            "the source checkpoint with this --speculative-config: it is exported with the head."
        )
    if not 1 <= k <= config.speculation_length:
        served = (
            f"num_speculative_tokens <= {config.speculation_length}"
            if config.speculation_length
            else "no speculation (it has no verify graphs)"
        )
        raise ServingConfigError(
            f"--speculative-config num_speculative_tokens {k} is not supported by this export: it serves "
            f"{served}; lower it, "
            f"or re-export with --speculation-length {max(k, 1)}."
        )
    return 1 + k


def check_head_chain(config: NeuronConfig, k: int, max_model_len: int) -> None:
    """Paged exports with an EAGLE3 head: the chain a draft call runs after a row writes the head's
    K/V up to K - 1 positions past the row's last token (K compiled; modeling/eagle3.chain_top),
    into blocks vLLM allocated for k lookahead slots past the scheduled tokens, capped at
    max_model_len (v1/core/kv_cache_manager.py allocate_slots, 0.32), while a row's tokens end
    at max_model_len - 2 (v1/core/sched/scheduler.py). Whole-sequence blocks hold every position."""
    pool, compiled = KVPool.of(config), config.speculation_length
    if pool.whole_sequence_blocks:
        return
    if not FIRST_CHUNK_HAS_LOOKAHEAD:
        raise ServingConfigError(
            f"--speculative-config method 'eagle3' on an export of {pool.block_size}-token KV blocks "
            "(--kv-block-size) is not supported on vLLM 0.16.0: its scheduler reserves no lookahead "
            "slots for a request's first chunk, where the head's chain writes; serve an export of "
            "whole-sequence blocks (no --kv-block-size), or use vLLM 0.32."
        )
    if k < compiled - 1:
        raise ServingConfigError(
            f"--speculative-config num_speculative_tokens {k}: the export's head drafts a chain of "
            f"{compiled} (--speculation-length), writing {compiled - 1} positions past a row into "
            f"blocks vLLM reserves num_speculative_tokens lookahead slots for; with "
            f"{pool.block_size}-token KV blocks pass {compiled - 1} or {compiled}."
        )
    last = chain_top(max_model_len - 2, compiled, config.sequence_length)
    held = pool.blocks_holding(max_model_len) * pool.block_size
    if last >= held:
        raise ServingConfigError(
            f"--max-model-len {max_model_len}: the head's chain writes up to position {last}, past "
            f"the {pool.block_size}-token KV blocks vLLM allocates for {max_model_len} positions "
            f"(positions < {held}); pass --max-model-len {config.sequence_length} (the export's), or "
            f"one at most {held - compiled + 2}."
        )


def serving_limits(config: NeuronConfig, request: EngineRequest) -> ServingLimits:
    if request.dtype != config.dtype:
        raise ServingConfigError(
            f"--dtype {request.dtype} differs from the compiled dtype {config.dtype}: "
            f"pass --dtype {config.dtype} (or omit it), or re-export with --dtype {request.dtype}."
        )
    max_model_len = config.sequence_length if request.max_model_len is None else request.max_model_len
    if max_model_len > config.sequence_length:
        raise ServingConfigError(
            f"--max-model-len {max_model_len} exceeds the compiled sequence_length "
            f"{config.sequence_length}: pass --max-model-len {config.sequence_length} or less, "
            f"or re-export with --sequence_length {max_model_len}."
        )
    max_num_seqs = config.batch_size if request.max_num_seqs is None else request.max_num_seqs
    if max_num_seqs > config.batch_size:
        raise ServingConfigError(
            f"--max-num-seqs {max_num_seqs} exceeds the compiled batch_size {config.batch_size}: "
            f"pass --max-num-seqs {config.batch_size} or less, or re-export with --batch_size {max_num_seqs}."
        )
    chunk, per_decode = config.prefill_chunk_size, check_speculation(config, request)
    if request.speculative_method == "eagle3":
        check_head_chain(config, request.speculative_tokens, max_model_len)
    if request.max_num_batched_tokens is not None:
        budget = request.max_num_batched_tokens
    elif config.chunked:
        budget = full_chunk_budget(chunk, max_num_seqs, per_decode)
    else:
        budget = max_model_len + max_num_seqs * per_decode
    if not config.chunked and budget < max_model_len:
        raise ServingConfigError(
            f"--max-num-batched-tokens {budget} is below --max-model-len {max_model_len}: a standard "
            "export encodes whole prompts in one step; raise it, or serve a chunked export."
        )
    if budget < max_num_seqs:
        raise ServingConfigError(
            f"--max-num-batched-tokens {budget} is below --max-num-seqs {max_num_seqs}: raise it."
        )
    threshold = request.long_prefill_token_threshold or (chunk if config.chunked else 0)
    block_size, num_blocks = kv_blocks(config, max_model_len, max_num_seqs, request.num_gpu_blocks_override)
    return ServingLimits(
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        long_prefill_token_threshold=threshold,
        enable_chunked_prefill=config.chunked,
        block_size=block_size,
        num_blocks=num_blocks,
    )


def kv_blocks(
    config: NeuronConfig, max_model_len: int, max_num_seqs: int, override: int | None
) -> tuple[int, int]:
    """(block_size, num_blocks) of vLLM's one KV-cache group: the export's pool (a whole
    sequence a block by default), or fewer blocks if asked, plus vLLM's null block 0
    (vllm/v1/core/block_pool.py, 0.16.0 and 0.32), which num_blocks counts."""
    kv = KVPool.of(config)
    size, pool = kv.block_size, vllm_num_blocks(kv.num_blocks)
    blocks = pool if override is None else override
    if not vllm_num_blocks(1) <= blocks <= pool:
        raise ServingConfigError(
            f"--num-gpu-blocks-override {blocks} is outside the export's KV pool: {kv.num_blocks} blocks of "
            f"{size} tokens plus vLLM's null block; pass {vllm_num_blocks(1)} to {pool}, or omit it."
        )
    needed, served = kv.blocks_holding(max_model_len), pool_blocks(blocks)
    if needed > served:
        raise ServingConfigError(
            f"--max-model-len {max_model_len} needs {needed} KV blocks of {size} tokens, the pool "
            f"serves {served}: pass --max-model-len {served * size} or less"
            + (", or a larger --num-gpu-blocks-override" if blocks < pool else "")
            + f", or re-export with --kv-cache-blocks {needed} or more."
        )
    return size, blocks
