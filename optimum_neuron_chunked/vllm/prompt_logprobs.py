"""Prompt logprobs, chunk by chunk, as vLLM's GPU runner computes them
(`_get_prompt_logprobs_dict`, vllm/v1/worker/gpu_model_runner.py, 0.32): the logits after
prompt token i score token i+1; the whole prompt's tensors (num_prompt_tokens - 1 rows) are
returned once, with the chunk that completes the prompt. Needs an export whose prefill
graphs return every position's logits (`--prompt-logprobs`)."""

from __future__ import annotations

import torch
from vllm.v1.outputs import LogprobsTensors
from vllm.v1.sample.sampler import Sampler
from vllm.v1.worker.gpu_input_batch import CachedRequestState

RAW_MODES = ("raw_logits", "processed_logits")  # prompt tokens skip the sampling processors


def add_chunk(
    state: CachedRequestState,
    num_logprobs: int,
    start: int,
    rows: torch.Tensor,  # [T, V]: the logits after each token of the chunk at positions start..
    sampler: Sampler,
    logprobs_mode: str,
) -> tuple[bool, LogprobsTensors | None]:
    """Score the chunk's prompt positions into the request's tensors -> (prompt done, tensors)."""
    num_prompt_tokens = len(state.prompt_token_ids)
    tensors = state.in_progress_prompt_logprobs_cpu
    if tensors is None:
        tensors = LogprobsTensors.empty_cpu(num_prompt_tokens - 1, num_logprobs + 1)
        state.in_progress_prompt_logprobs_cpu = tensors
    remaining = num_prompt_tokens - (start + 1)
    done = rows.shape[0] > remaining
    count = remaining if done else rows.shape[0]
    if count > 0:
        logits = rows[:count]
        scores = logits.float() if logprobs_mode in RAW_MODES else sampler.compute_logprobs(logits)
        targets = torch.tensor(state.prompt_token_ids[start + 1 : start + 1 + count])
        token_ids, logprobs, ranks, *_ = sampler.gather_logprobs(scores, num_logprobs, targets)
        tensors.logprob_token_ids[start : start + count] = token_ids
        tensors.logprobs[start : start + count] = logprobs
        tensors.selected_token_ranks[start : start + count] = ranks
    if done:
        state.in_progress_prompt_logprobs_cpu = None
    return done, tensors if done else None
