"""transformers-style generate() over the prefill and decode graphs."""

from __future__ import annotations

import logging

import torch

from .config import prefill_slices
from .graph_runner import GraphRunner
from .modeling.sampler import sample, sampling_params
from .prompt_lookup import accept_greedy, propose

logger = logging.getLogger(__name__)


def generate(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int | None = None,
    do_sample: bool | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    generator: torch.Generator | None = None,
    prompt_lookup_num_tokens: int | None = None,
) -> torch.Tensor:
    """Returns [N, L + new] like transformers: the (left-padded) prompts, then new tokens;
    rows that finished early are filled with pad_token_id. `prompt_lookup_num_tokens` K
    (greedy, exports with --speculation-length >= K): each step verifies up to K tokens drafted
    by prompt lookup (prompt_lookup.py) in one VF call - the same tokens, fewer steps."""
    gen = model.generation_config
    max_new_tokens = max_new_tokens if max_new_tokens is not None else (gen.max_new_tokens or 20)
    eos_ids = _as_list(eos_token_id if eos_token_id is not None else gen.eos_token_id)
    pad = (
        pad_token_id
        if pad_token_id is not None
        else (gen.pad_token_id if gen.pad_token_id is not None else None)
    )
    pad = pad if pad is not None else (eos_ids[0] if eos_ids else 0)
    do_sample = do_sample if do_sample is not None else bool(gen.do_sample)
    row_params = sampling_params(
        top_k=top_k if top_k is not None else (gen.top_k or 0),
        top_p=top_p if top_p is not None else (gen.top_p or 1.0),
        temperature=(temperature if temperature is not None else (gen.temperature or 1.0))
        if do_sample
        else 0.0,
    )
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    prompts = [row[mask.bool()] for row, mask in zip(input_ids, attention_mask, strict=True)]
    max_new_tokens = _fit_new_tokens(model.neuron_config, prompts, max_new_tokens)
    n = len(prompts)
    if n > model.neuron_config.batch_size:
        raise ValueError(
            f"batch of {n} prompts exceeds the compiled batch_size {model.neuron_config.batch_size}: "
            "split it or re-export with a larger --batch_size."
        )
    lookup = _check_lookup(model.neuron_config, prompt_lookup_num_tokens, do_sample)
    new_tokens = _generate_tokens(model, prompts, max_new_tokens, row_params, set(eos_ids), generator, lookup)
    steps = max((len(t) for t in new_tokens), default=0)
    out = torch.full((n, steps), pad, dtype=input_ids.dtype)
    for i, tokens in enumerate(new_tokens):
        out[i, : len(tokens)] = torch.tensor(tokens, dtype=input_ids.dtype)
    return torch.cat([input_ids, out], dim=1)


def _check_lookup(config, k: int | None, do_sample: bool) -> int:
    if not k:
        return 0
    if do_sample:
        raise ValueError("prompt_lookup_num_tokens verifies drafts greedily: pass do_sample=False.")
    if k > config.speculation_length:
        raise ValueError(
            f"prompt_lookup_num_tokens={k} exceeds the export's verify graphs (--speculation-length "
            f"{config.speculation_length}): pass at most that, or re-export with --speculation-length {k}."
        )
    return k


def _generate_tokens(
    model, prompts, max_new_tokens, row_params, eos_ids, generator, lookup=0
) -> list[list[int]]:
    n = len(prompts)
    tokens: list[list[int]] = [[] for _ in range(n)]
    if max_new_tokens == 0:
        return tokens
    params = torch.tensor([row_params] * n)
    runner, config, pool = model.runner, model.neuron_config, model.kv_pool
    seq_ids = []  # each request's KV blocks
    try:
        for prompt in prompts:
            seq_ids.append(pool.acquire(len(prompt) + max_new_tokens))
        for i, prompt in enumerate(prompts):
            logits = prefill_prompt(runner, prompt, seq_ids[i])
            tokens[i].append(
                int(sample(logits[None], params[i : i + 1], _rand(1, generator), config.max_topk)[0])
            )
        live = [i for i in range(n) if not _finished(tokens[i], eos_ids, max_new_tokens)]
        while live:
            kvs = [seq_ids[i] for i in live]
            if lookup:
                _verify_step(
                    runner,
                    [prompts[i].tolist() for i in live],
                    [tokens[i] for i in live],
                    kvs,
                    lookup,
                    max_new_tokens,
                )
                for i in live:
                    _cut_at_eos(tokens[i], eos_ids)
                live = [i for i in live if not _finished(tokens[i], eos_ids, max_new_tokens)]
                continue
            ids = torch.tensor([tokens[i][-1] for i in live])
            positions = torch.tensor([len(prompts[i]) + len(tokens[i]) - 1 for i in live])
            sampling = (params[live], _rand(len(live), generator))
            sampled, logits = runner.decode(ids, positions, kvs, sampling, need_logits=False)
            if sampled is None:  # an export that samples on the host
                sampled = sample(logits, *sampling, config.max_topk)
            for i, token in zip(live, sampled.tolist(), strict=True):
                tokens[i].append(token)
            live = [i for i in live if not _finished(tokens[i], eos_ids, max_new_tokens)]
    finally:
        for seq_id in seq_ids:
            pool.release(seq_id)
    return tokens


def _verify_step(runner: GraphRunner, prompts, tokens, kvs, k: int, max_new_tokens: int) -> None:
    """One VF call: each row's last token and its prompt-lookup drafts (no more than it may
    still emit); the accepted tokens are appended to `tokens` in place."""
    drafts = [
        propose(p + t, min(k, max_new_tokens - len(t) - 1)) if len(t) < max_new_tokens - 1 else []
        for p, t in zip(prompts, tokens, strict=True)
    ]
    rows = [torch.tensor([t[-1], *d]) for t, d in zip(tokens, drafts, strict=True)]
    positions = torch.tensor([len(p) + len(t) - 1 for p, t in zip(prompts, tokens, strict=True)])
    argmax, _ = runner.verify(rows, positions, kvs, need_logits=False)
    for t, d, row in zip(tokens, drafts, argmax.tolist(), strict=True):
        t.extend(accept_greedy(d, row))


def _cut_at_eos(tokens: list[int], eos_ids: set[int]) -> None:
    """Drop what a verify step accepted past an end-of-sequence token."""
    for i, token in enumerate(tokens):
        if token in eos_ids:
            del tokens[i + 1 :]
            return


def prefill_prompt(runner: GraphRunner, input_ids: torch.Tensor, blocks: tuple[int, ...]) -> torch.Tensor:
    """A whole prompt into KV blocks `blocks`, chunk by chunk or
    through CE, whichever the export has -> logits [V] after its last token."""
    config, n = runner.config, input_ids.shape[0]
    if not 0 < n <= config.sequence_length:
        raise ValueError(
            f"prompt of {n} tokens: must hold 1 to sequence_length={config.sequence_length} tokens"
        )
    for piece in prefill_slices(n, config.prefill_chunk_size):
        logits = runner.prefill(input_ids[piece], piece.start, blocks)
    return logits


def _fit_new_tokens(config, prompts, max_new_tokens: int) -> int:
    longest = max(len(p) for p in prompts)
    if min(len(p) for p in prompts) == 0:
        raise ValueError("every prompt needs at least one token (check attention_mask)")
    if longest > config.sequence_length:
        raise ValueError(
            f"prompt of {longest} tokens exceeds the compiled sequence_length {config.sequence_length}: "
            "shorten it or re-export with a larger --sequence_length."
        )
    room = config.sequence_length - longest
    if max_new_tokens > room:
        logger.warning("max_new_tokens=%d capped to %d by sequence_length", max_new_tokens, room)
    return min(max_new_tokens, room)


def _finished(tokens: list[int], eos_ids: set[int], max_new_tokens: int) -> bool:
    return len(tokens) >= max_new_tokens or tokens[-1] in eos_ids


def _rand(n: int, generator: torch.Generator | None) -> torch.Tensor:
    return torch.rand(n, generator=generator)


def _as_list(x) -> list[int]:
    if x is None:
        return []
    return list(x) if isinstance(x, list | tuple) else [int(x)]
