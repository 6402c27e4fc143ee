"""transformers-style generate() over the prefill and decode graphs."""

from __future__ import annotations

import logging

import torch

from .config import prefill_slices
from .generation_plan import GenerationPlan, plan
from .graph_runner import GraphRunner
from .modeling.eagle3 import chain_top
from .modeling.lora import NO_ADAPTER
from .modeling.sampler import sample, sampling_params
from .prompt_lookup import accept_greedy, propose

logger = logging.getLogger(__name__)


def generate(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    generation_config=None,
    logits_processor=None,
    stopping_criteria=None,
    streamer=None,
    generator: torch.Generator | None = None,
    tokenizer=None,
    **kwargs,
) -> torch.Tensor:
    """Returns [N, L + new] like transformers: the (left-padded) prompts, then new tokens;
    rows that finished early are filled with pad_token_id. Takes transformers' generation
    arguments (generation_plan.py: the device samples greedy / temperature / top-k / top-p,
    the host applies transformers' processors for the rest, anything else is refused by name).
    `prompt_lookup_num_tokens` K (greedy, exports with --speculation-length >= K): each step
    verifies up to K tokens drafted by prompt lookup (prompt_lookup.py) in one VF call. Without
    it, greedy generation on an export with an EAGLE3 head (--speculation-head) verifies the
    head's K drafts each step: one VF call, then one DV call drafting the next K on the device.
    `adapter_names`: each row's LoRA adapter (model.load_adapter), "__base__" for the base,
    as peft's mixed batches take them."""
    adapter_names = kwargs.pop("adapter_names", None)
    p = plan(model.generation_config, generation_config, input_ids.shape[1], logits_processor,
             stopping_criteria, tokenizer, **kwargs)  # fmt: skip
    gen = p.config
    eos_ids = _as_list(gen.eos_token_id)
    pad = gen.pad_token_id if gen.pad_token_id is not None else (eos_ids[0] if eos_ids else 0)
    row_params = sampling_params(
        top_k=gen.top_k or 0,
        top_p=gen.top_p or 1.0,
        temperature=(gen.temperature or 1.0) if gen.do_sample else 0.0,
    )
    prompts, max_new_tokens, lookup = _checked_arguments(model, p, input_ids, attention_mask, streamer)
    n = len(prompts)
    head = bool(model.neuron_config.speculation_head) and not lookup and not (gen.do_sample or p.on_host)
    if streamer is not None:
        streamer.put(input_ids.cpu())
    rows = Rows(input_ids, p, generator, streamer, model.adapter_slots(adapter_names, n))
    new_tokens = _generate_tokens(
        model, prompts, max_new_tokens, row_params, set(eos_ids), rows, lookup, head
    )
    if streamer is not None:
        streamer.end()
    steps = max((len(t) for t in new_tokens), default=0)
    out = torch.full((n, steps), pad, dtype=input_ids.dtype)
    for i, tokens in enumerate(new_tokens):
        out[i, : len(tokens)] = torch.tensor(tokens, dtype=input_ids.dtype)
    return torch.cat([input_ids, out], dim=1)


def _checked_arguments(
    model, p: GenerationPlan, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, streamer
) -> tuple[list[torch.Tensor], int, int]:
    """generate's checks: (the prompts without their padding, the new tokens they take -
    max_new_tokens, else what max_length leaves - within the export's sequence_length, prompt
    lookup's K), or ValueError naming what the export cannot take."""
    config, gen = model.neuron_config, p.config
    length = input_ids.shape[1]
    max_new_tokens = gen.max_new_tokens if gen.max_new_tokens is not None else max(gen.max_length - length, 0)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    prompts = [row[mask.bool()] for row, mask in zip(input_ids, attention_mask, strict=True)]
    max_new_tokens = _fit_new_tokens(config, prompts, max_new_tokens)
    n = len(prompts)
    if n > config.batch_size:
        raise ValueError(
            f"batch of {n} prompts exceeds the compiled batch_size {config.batch_size}: "
            "split it or re-export with a larger --batch_size."
        )
    if streamer is not None and n > 1:
        raise ValueError("a streamer takes one prompt at a time (as transformers' streamers).")
    lookup = _check_lookup(config, gen.prompt_lookup_num_tokens, gen.do_sample or p.on_host)
    return prompts, max_new_tokens, lookup


class Rows:
    """Each row's tokens as transformers' processors see them (the padded prompt row, then the
    new tokens), the host's choice of a token where the plan samples on the host, the stopping
    criteria, the streamer and each row's LoRA slot."""

    def __init__(self, input_ids: torch.Tensor, p: GenerationPlan, generator, streamer, slots: list[int]):
        self.input_ids, self.plan, self.generator, self.streamer = input_ids, p, generator, streamer
        self.slots = slots

    def ids(self, i: int, tokens: list[int]) -> torch.Tensor:
        return torch.cat([self.input_ids[i], torch.tensor(tokens, dtype=self.input_ids.dtype)])[None]

    def choose(self, i: int, tokens: list[int], logits: torch.Tensor) -> int:
        return self.plan.next_token(self.ids(i, tokens), logits, self.generator)

    def append(self, i: int, tokens: list[int], token: int, logits: torch.Tensor | None) -> bool:
        """Add `token` to row i; whether a stopping criterion ends the row."""
        tokens.append(token)
        self.stream([token])
        return logits is not None and self.plan.stops(self.ids(i, tokens), logits)

    def stream(self, new_tokens: list[int]) -> None:
        for token in new_tokens if self.streamer is not None else ():
            self.streamer.put(torch.tensor([token]))


def _check_lookup(config, k: int | None, sampled: bool) -> int:
    if not k:
        return 0
    if sampled:
        raise ValueError(
            "prompt_lookup_num_tokens verifies drafts greedily on the device: pass do_sample=False and "
            "no argument that samples on the host (min_new_tokens, repetition_penalty, ...)."
        )
    if k > config.speculation_length:
        raise ValueError(
            f"prompt_lookup_num_tokens={k} exceeds the export's verify graphs (--speculation-length "
            f"{config.speculation_length}): pass at most that, or re-export with --speculation-length {k}."
        )
    return k


def _generate_tokens(
    model, prompts, max_new_tokens, row_params, eos_ids, rows: Rows, lookup=0, head=False
) -> list[list[int]]:
    n = len(prompts)
    tokens: list[list[int]] = [[] for _ in range(n)]
    stopped: set[int] = set()
    if max_new_tokens == 0:
        return tokens
    host = rows.plan.on_host
    params = torch.tensor([sampling_params(temperature=0.0) if host else row_params] * n)
    runner, config, pool = model.runner, model.neuron_config, model.kv_pool
    blocks = []  # each request's KV blocks
    drafts, pending = {}, None  # EAGLE3: each row's drafts; the verify call the next drafts follow
    steps = config.speculation_length if head else 1  # the head's chain writes past a row's tokens
    try:
        for prompt in prompts:  # a row's chain starts at most at its last token's position
            last = len(prompt) + max_new_tokens - 1
            blocks.append(pool.acquire(chain_top(last, steps, config.sequence_length) + 1))
        for i, prompt in enumerate(prompts):
            logits = prefill_prompt(runner, prompt, blocks[i], rows.slots[i], draft=head)
            token = rows.choose(i, tokens[i], logits) if host else int(
                sample(logits[None], params[i : i + 1], _rand(1, rows.generator), config.max_topk)[0]
            )  # fmt: skip
            if head:
                drafts[i] = _draft_after_prompt(runner, prompt, token).tolist()
            if rows.append(i, tokens[i], token, logits if host else None):
                stopped.add(i)
        live = [i for i in range(n) if i not in stopped and not _finished(tokens[i], eos_ids, max_new_tokens)]
        while live:
            kvs = [blocks[i] for i in live]
            if lookup or head:
                before = [len(tokens[i]) for i in live]
                if head:
                    pending = _head_step(runner, live, prompts, tokens, kvs, drafts, pending, max_new_tokens,
                                         [rows.slots[i] for i in live])  # fmt: skip
                else:
                    _verify_step(runner, [prompts[i].tolist() for i in live], [tokens[i] for i in live], kvs,
                                 lookup, max_new_tokens, [rows.slots[i] for i in live])  # fmt: skip
                for i, n in zip(live, before, strict=True):
                    _cut_at_eos(tokens[i], eos_ids)
                    rows.stream(tokens[i][n:])
                live = [i for i in live if not _finished(tokens[i], eos_ids, max_new_tokens)]
                continue
            stopped |= _decode_step(runner, live, prompts, tokens, kvs, params, rows)
            live = [i for i in live if i not in stopped and not _finished(tokens[i], eos_ids, max_new_tokens)]
    finally:
        for row_blocks in blocks:
            pool.release(row_blocks)
    return tokens


def _decode_step(runner: GraphRunner, live, prompts, tokens, kvs, params, rows: Rows) -> set[int]:
    """One TG call of rows `live`, the tokens sampled on the device or the host appended -> the
    rows a stopping criterion ends."""
    host, stopped = rows.plan.on_host, set()
    ids = torch.tensor([tokens[i][-1] for i in live])
    positions = torch.tensor([len(prompts[i]) + len(tokens[i]) - 1 for i in live])
    sampling = (params[live], _rand(len(live), rows.generator))
    sampled, logits = runner.decode(ids, positions, kvs, sampling, host, [rows.slots[i] for i in live])
    if host:
        sampled = torch.tensor([rows.choose(i, tokens[i], row) for i, row in zip(live, logits, strict=True)])
    elif sampled is None:  # an export that samples on the host
        sampled = sample(logits, *sampling, runner.config.max_topk)
    for j, (i, token) in enumerate(zip(live, sampled.tolist(), strict=True)):
        if rows.append(i, tokens[i], token, logits[j] if host else None):
            stopped.add(i)
    return stopped


def _verify_step(runner: GraphRunner, prompts, tokens, kvs, k: int, max_new_tokens: int, slots) -> None:
    """One VF call: each row's last token and its prompt-lookup drafts (no more than it may
    still emit); the accepted tokens are appended to `tokens` in place."""
    drafts = [
        propose(p + t, min(k, max_new_tokens - len(t) - 1)) if len(t) < max_new_tokens - 1 else []
        for p, t in zip(prompts, tokens, strict=True)
    ]
    rows = [torch.tensor([t[-1], *d]) for t, d in zip(tokens, drafts, strict=True)]
    positions = torch.tensor([len(p) + len(t) - 1 for p, t in zip(prompts, tokens, strict=True)])
    argmax, _ = runner.verify(rows, positions, kvs, False, slots)
    for t, d, row in zip(tokens, drafts, argmax.tolist(), strict=True):
        t.extend(accept_greedy(d, row))


def _head_step(runner: GraphRunner, live, prompts, tokens, kvs, drafts, pending, max_new_tokens: int, slots):
    """One EAGLE3 step of rows `live`: the drafts of the previous verify call (one DV call, made
    now that a step follows it), then one VF call of each row's last token and its drafts (no more
    than it may still emit); accepted tokens appended to `tokens` -> what the next drafts follow."""
    if pending is not None:
        verified, rows, next_tokens, accepted = pending
        drafts.update(
            zip(rows, runner.draft_after_verify(verified, next_tokens, accepted).tolist(), strict=True)
        )
    k = runner.config.speculation_length
    row_drafts = [drafts[i][: max(0, min(k, max_new_tokens - len(tokens[i]) - 1))] for i in live]
    token_rows = [torch.tensor([tokens[i][-1], *d]) for i, d in zip(live, row_drafts, strict=True)]
    positions = torch.tensor([len(prompts[i]) + len(tokens[i]) - 1 for i in live])
    argmax, _ = runner.verify(token_rows, positions, kvs, False, slots)
    next_tokens, accepted = [], []
    for i, d, row in zip(live, row_drafts, argmax.tolist(), strict=True):
        kept = accept_greedy(d, row)
        tokens[i].extend(kept)
        next_tokens.append(kept[-1])
        accepted.append(len(kept) - 1)
    return runner.last_verify, list(live), next_tokens, accepted


def _draft_after_prompt(runner: GraphRunner, prompt: torch.Tensor, token: int) -> torch.Tensor:
    """The head's K drafts after a prompt's last chunk, `token` sampled after it."""
    last = prefill_slices(len(prompt), runner.config.prefill_chunk_size)[-1]
    return runner.draft_after_chunk(prompt[last], token, last.start)


def _cut_at_eos(tokens: list[int], eos_ids: set[int]) -> None:
    """Drop what a verify step accepted past an end-of-sequence token."""
    for i, token in enumerate(tokens):
        if token in eos_ids:
            del tokens[i + 1 :]
            return


def prefill_prompt(
    runner: GraphRunner,
    input_ids: torch.Tensor,
    blocks: tuple[int, ...],
    adapter: int = NO_ADAPTER,
    draft: bool = False,
) -> torch.Tensor:
    """A whole prompt into KV blocks `blocks`, chunk by chunk or through CE, whichever the export
    has, under LoRA slot `adapter` -> logits [V] after its last token. `draft`: each chunk but the
    last is followed by the EAGLE3 head's pass over it (the caller drafts after the last, once it
    has the token that follows)."""
    config, n = runner.config, input_ids.shape[0]
    if not 0 < n <= config.sequence_length:
        raise ValueError(
            f"prompt of {n} tokens: must hold 1 to sequence_length={config.sequence_length} tokens"
        )
    for piece in prefill_slices(n, config.prefill_chunk_size):
        logits = runner.prefill(input_ids[piece], piece.start, blocks, adapter=adapter)
        if draft and piece.stop < n:  # the head's K/V of the chunk
            runner.draft_after_chunk(input_ids[piece], int(input_ids[piece.stop]), piece.start)
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
