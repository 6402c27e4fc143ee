"""Speculative decoding on verify graphs, drafted by vLLM's model-free n-gram proposer (prompt
lookup) or by the export's EAGLE3 head on the device (HeadDrafter).

A decode row carries its last token and up to K drafts; the verify graph scores all K + 1
positions in one call (graphs.VerifyGraph), and this module turns its output into what each
request emits, with vLLM's semantics (v1/sample/rejection_sampler.py): the accepted drafts,
then the target's token at the first rejection, or the bonus token after the last draft.
The scheduler rolls back what was rejected (`num_computed_tokens -= rejected`,
v1/core/sched/scheduler.py, 0.16.0 and 0.32); K/V the graph wrote past the accepted tokens is
never read, since every key is masked by position and the next call writes those positions
before any query reaches them.

Drafts are proposed only for requests the verify path samples exactly: greedy, temperature,
top-k, top-p and a seed. Any other sampling field (logprobs, penalties, structured output,
...) emits one token sampled on the host from the first position, as without speculation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.sampling_params import SamplingParams

from ..rejection import Drafts, accepted_tokens, rejection_sample
from .compat import ngram_propose
from .sampling import GREEDY_EPS, host_fields

VERIFIABLE_FIELDS = frozenset({"seed"})  # beside the on-device ones (sampling.DEVICE_FIELDS)


def verifiable(params: SamplingParams) -> bool:
    """Whether a request's drafts can be verified with vLLM's rejection semantics here."""
    return set(host_fields(params)) <= VERIFIABLE_FIELDS


def processed_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[T, V] logits as a random request samples from them: temperature, then top-k / top-p
    (vLLM's apply_sampling_constraints, v1/sample/rejection_sampler.py)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    scaled = logits.float() / params.temperature
    rows = scaled.shape[0]
    k = torch.full((rows,), params.top_k) if 0 < params.top_k < scaled.shape[-1] else None
    p = torch.full((rows,), params.top_p) if params.top_p < 1.0 else None
    return apply_top_k_top_p(scaled, k, p)


@dataclass(frozen=True)
class RandomRow:
    """A random request's verify row: its drafts, the logits at them [d, V], the bonus token
    sampled on the host, and how it samples."""

    drafts: list[int]
    logits: torch.Tensor
    bonus: int
    params: SamplingParams
    generator: torch.Generator | None


def accept_random(rows: list[RandomRow]) -> list[list[int]]:
    """The step's random rows with drafts, in vLLM's batch order, through one rejection_sample
    call (as vLLM's RejectionSampler samples a step) -> each row's tokens."""
    generators = {i: r.generator for i, r in enumerate(rows) if r.generator is not None}
    target = torch.cat([processed_logits(r.logits[: len(r.drafts)], r.params) for r in rows])
    out = rejection_sample(
        Drafts.of([r.drafts for r in rows]),
        target,
        torch.tensor([r.bonus for r in rows]),
        generators,
    )
    return accepted_tokens(out)


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < GREEDY_EPS


class Drafter:
    """vLLM's NgramProposer over the running batch (its InputBatch holds every request's tokens)."""

    def __init__(self, vllm_config, length: int):
        from vllm.v1.spec_decode.ngram_proposer import NgramProposer

        self.length = length
        self.proposer = NgramProposer(vllm_config)

    def propose(self, input_batch, emitted: dict[str, list[int]], eligible) -> dict[str, list[int]]:
        """Next drafts of the requests that emitted tokens this step and are `eligible`."""
        sampled = [emitted.get(r, []) if eligible(r) else [] for r in input_batch.req_ids]
        drafts = ngram_propose(
            self.proposer, self.length, sampled, input_batch.num_tokens_no_spec, input_batch.token_ids_cpu
        )
        return {
            r: list(d) for r, d, s in zip(input_batch.req_ids, drafts, sampled, strict=True) if s and len(d)
        }


class HeadDrafter:
    """The export's EAGLE3 head (vLLM's eagle3 method): each draft call runs right after the CP or
    VF call whose aux states it reads (GraphRunner.draft_after_chunk / draft_after_verify),
    so the runner knows the token that follows by then. `length`: num_speculative_tokens, at
    most the compiled K the chain drafts."""

    def __init__(self, graph_runner, length: int):
        self.graph_runner, self.length = graph_runner, length

    def after_chunk(self, chunk, next_token: int) -> list[int]:
        """Drafts after prefill `chunk` (step_plan.PrefillChunk), `next_token` following it: the
        next prompt token, or the one sampled after the prompt."""
        drafts = self.graph_runner.draft_after_chunk(torch.tensor(chunk.token_ids), next_token, chunk.start)
        return drafts.tolist()[: self.length]

    def after_verify(self, decodes, emitted: dict[str, list[int]]) -> dict[str, list[int]]:
        """Drafts of the rows of the VF call just made (step_plan.DecodeRow) that `emitted` tokens
        (accepted drafts, then the bonus or correction token). The call repeats every row of the
        VF call: a row sampled later (not verifiable) passes its own token, its drafts unused."""
        next_tokens, accepted = [], []
        for d in decodes:
            tokens = emitted.get(d.req_id, [d.token_id])
            next_tokens.append(tokens[-1])
            accepted.append(len(tokens) - 1)
        drafts = self.graph_runner.draft_after_verify(self.graph_runner.last_verify, next_tokens, accepted)
        return {
            d.req_id: row[: self.length]
            for d, row in zip(decodes, drafts.tolist(), strict=True)
            if d.req_id in emitted
        }
