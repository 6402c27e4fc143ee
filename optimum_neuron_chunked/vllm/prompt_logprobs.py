"""Prompt logprobs, chunk by chunk, as vLLM's GPU runner computes them
(`_get_prompt_logprobs_dict`, vllm/v1/worker/gpu_model_runner.py, 0.32): the logits after
prompt token i score token i+1; the whole prompt's tensors (num_prompt_tokens - 1 rows) are
returned once, with the chunk that completes the prompt. Needs an export whose prefill
graphs return every position's logits (`--prompt-logprobs`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.v1.outputs import LogprobsTensors
from vllm.v1.sample.sampler import Sampler

RAW_MODES = ("raw_logits", "processed_logits")  # prompt tokens skip the sampling processors


@dataclass
class PromptLogprobs:
    """A request's prompt logprobs while its prompt is computed. Kept by the runner: vLLM keeps
    its own progress on InputBatch (0.16.0) or CachedRequestState (0.32)."""

    num_logprobs: int
    tensors: LogprobsTensors | None = None  # [num_prompt_tokens - 1, num_logprobs + 1] rows


def add_chunk(
    progress: PromptLogprobs,
    prompt_token_ids: list[int],
    start: int,
    rows: torch.Tensor,  # [T, V]: the logits after each token of the chunk at positions start..
    sampler: Sampler,
    logprobs_mode: str,
) -> tuple[bool, LogprobsTensors | None]:
    """Score the chunk's prompt positions into the request's tensors -> (prompt done, tensors)."""
    num_prompt_tokens, num_logprobs = len(prompt_token_ids), progress.num_logprobs
    tensors = progress.tensors
    if tensors is None:
        tensors = LogprobsTensors.empty_cpu(num_prompt_tokens - 1, num_logprobs + 1)
        progress.tensors = tensors
    remaining = num_prompt_tokens - (start + 1)
    done = rows.shape[0] > remaining
    count = remaining if done else rows.shape[0]
    if count > 0:
        logits = rows[:count]
        scores = logits.float() if logprobs_mode in RAW_MODES else sampler.compute_logprobs(logits)
        targets = torch.tensor(prompt_token_ids[start + 1 : start + 1 + count])
        token_ids, logprobs, ranks, *_ = sampler.gather_logprobs(scores, num_logprobs, targets)
        tensors.logprob_token_ids[start : start + count] = token_ids
        tensors.logprobs[start : start + count] = logprobs
        tensors.selected_token_ranks[start : start + count] = ranks
    return done, tensors if done else None
