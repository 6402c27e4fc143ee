"""Hybrid sampling: on device when the TG graph can honour every request, vLLM's sampler otherwise.

On-device sampling (modeling/sampler.py) offers greedy, temperature, top-k (up to the
compiled max_topk) and top-p, driven by host random numbers. Anything else a request asks
for - logprobs, penalties, a seed, min_tokens, min_p, logit bias, allowed or banned tokens,
structured output - is done by vLLM's own Sampler on the graph's logits, so it is never dropped.
"""

from __future__ import annotations

import msgspec
import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.outputs import LogprobsLists
from vllm.v1.sample.sampler import Sampler

from ..modeling.sampler import sampling_params as ods_row  # a row of the TG graph's sampling input
from .batch import BatchState

GREEDY_EPS = 1e-5  # vLLM's threshold: temperature below it is greedy


# SamplingParams fields the TG graph's sampler implements (within max_topk for top_k).
DEVICE_FIELDS = frozenset({"temperature", "top_k", "top_p"})
# Fields that act after a token is sampled (stopping, detokenizing, output shape) or that vLLM
# fills in itself: any value samples the same token.
OUTPUT_FIELDS = frozenset(
    {
        "n",
        "max_tokens",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "detokenize",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "include_stop_str_in_output",
        "output_kind",
        "stream_interval",
        "skip_clone",
        "output_text_buffer_length",
        "_eos_token_id",
        "_all_stop_token_ids",
        "skip_reading_prefix_cache",
        # The platform refuses --watermark-config (features.py), so vLLM's front end resolves
        # every request's `watermarking` to False (InputProcessor.apply_watermarking,
        # vllm/v1/engine/input_processor.py, 0.32): no watermark is ever asked of a sampler.
        "watermarking",
    }
)
_DEFAULTS = SamplingParams()
# The fields a request may set that send it to the host, with their defaults: read once
# (msgspec's field listing costs ~0.5 ms, and this is asked per row per step).
_HOST_ONLY_DEFAULTS = tuple(
    (f.name, getattr(_DEFAULTS, f.name))
    for f in msgspec.structs.fields(SamplingParams)
    if f.name not in DEVICE_FIELDS | OUTPUT_FIELDS
)


def host_fields(params: SamplingParams) -> list[str]:
    """Fields away from their default that on-device sampling does not implement: an
    allow-list, so a field vLLM adds later is sampled on the host, never dropped."""
    return [name for name, default in _HOST_ONLY_DEFAULTS if getattr(params, name) != default]


def on_device_eligible(params: SamplingParams, max_topk: int, vocab_size: int) -> bool:
    """True when on-device sampling gives exactly what `params` asks for."""
    if params.temperature >= GREEDY_EPS and not (0 < params.top_k <= max_topk or vocab_size <= max_topk):
        return False
    return not host_fields(params)


def device_sampling_inputs(
    params: list[SamplingParams], generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """The TG graph's sampling_params [N, 3] and random numbers [N] for these requests."""
    rows = [
        ods_row(
            top_k=p.top_k, top_p=p.top_p, temperature=p.temperature if p.temperature >= GREEDY_EPS else 0.0
        )
        for p in params
    ]
    return torch.tensor(rows, dtype=torch.float32), torch.rand(len(rows), generator=generator)


def host_sample(
    batch: BatchState, sampler: Sampler, logits: dict[str, torch.Tensor], grammar=None, drafts=None
) -> tuple[dict[str, int], LogprobsLists | None]:
    """Sample the requests in `logits` (req_id -> [V]) with vLLM's sampler.

    vLLM's sampling metadata covers the whole InputBatch, so every row is sampled; rows
    without logits this step (partial prefills, on-device rows) are discarded and their
    seeded generators rewound, so a request's random stream only advances when it samples.
    `drafts`: the step's scheduled drafts by request (the grammar bitmask's layout).
    Returns tokens by request and logprobs rows in InputBatch order.
    """
    ib = batch.input_batch
    vocab = ib.vocab_size
    full = torch.zeros(ib.num_reqs, vocab, dtype=torch.float32)
    for req_id, row in logits.items():
        full[ib.req_id_to_index[req_id]] = row[:vocab].float()
    if grammar is not None:
        apply_grammar(grammar, ib.req_id_to_index, full, drafts or {})
    skipped = [i for i, req_id in enumerate(ib.req_ids) if req_id not in logits]
    states = {i: ib.generators[i].get_state() for i in skipped if i in ib.generators}
    out = sampler(full, ib.sampling_metadata)
    for i, state in states.items():
        ib.generators[i].set_state(state)  # CPU generators have no offset to rewind
    sampled = out.sampled_token_ids[:, 0].tolist()
    tokens = {req_id: sampled[ib.req_id_to_index[req_id]] for req_id in logits}
    lists = out.logprobs_tensors.tolists() if out.logprobs_tensors is not None else None
    return tokens, lists


def apply_grammar(grammar, req_id_to_index: dict[str, int], logits: torch.Tensor, drafts: dict) -> None:
    """Mask the structured-output requests' rows of `logits` [N, V] (float32, host) to what their
    grammar allows. `grammar.grammar_bitmask` holds, per request of
    `structured_output_request_ids` in that order, one row for its token and one per draft
    scheduled (`drafts`; vllm/v1/structured_output/utils.py `apply_grammar_bitmask`, 0.16.0 and
    0.32). A structured-output request samples its first position only (its drafts, vLLM's
    placeholders, are never verified): its first row applies. Our own: vLLM 0.16.0's
    `apply_grammar_bitmask` pins host memory, which needs a GPU driver."""
    import xgrammar as xgr

    compact = torch.from_numpy(grammar.grammar_bitmask)
    rows, first, at = [], [], 0
    for req_id in grammar.structured_output_request_ids:
        rows.append(req_id_to_index[req_id])
        first.append(at)
        at += 1 + len(drafts.get(req_id, ()))
    # xgrammar masks logits[i] with bitmask[i] for i in indices: one bitmask row per logits row
    bitmask = torch.full((logits.shape[0], compact.shape[1]), -1, dtype=compact.dtype)
    bitmask[rows] = compact[first]
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)
