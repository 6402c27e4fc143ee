"""Plan one engine step: which requests decode through TG, which prefill chunks run through CP/CE.

Pure functions over frozen dataclasses, so the scheduler interplay is unit-tested without a
model. The runner converts vLLM's SchedulerOutput into `ScheduledWork` and executes the plan.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..config import prefill_slices
from ..modeling.lora import NO_ADAPTER
from .prefix_index import BlockCopy

# Where a request's K/V lives: its pool blocks in position order (graph_runner.py).
KVAddress = tuple[int, ...]


class PlanError(RuntimeError):
    """A step the compiled graphs cannot run (a scheduler configured against the export)."""


@dataclass(frozen=True)
class ScheduledWork:
    """One request's share of a step, as the scheduler gave it.

    `token_ids` are the tokens at positions `start, start + 1, ...`; `num_known_tokens` counts
    prompt + generated tokens so far: the work reaches the end of them when it samples.
    """

    req_id: str
    blocks: KVAddress
    start: int
    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    num_known_tokens: int
    # With vLLM's prefix cache: a request admitted this step may hit blocks that vLLM cached when it
    # allocated them to chunks scheduled before it (KVCacheManager.allocate_slots, vllm/v1/core/
    # kv_cache_manager.py, 0.16.0 and 0.32): it runs as a chunk, in order, never in the TG call
    # that runs ahead of the step's chunks.
    after_earlier_chunks: bool = False
    drafts: tuple[int, ...] = ()  # speculative tokens to verify after a decode's token
    adapter: int = NO_ADAPTER  # the LoRA slot the request's rows run under (vllm/adapters.py)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        """One generated token that samples: TG's work. Derived from `samples`, the one
        predicate: a one-token piece that does not reach the end of the known tokens (vLLM
        recomputing a request from position 0 after a reset) is prefill, whatever its position;
        a one-token prompt is prefill too."""
        one = len(self.token_ids) == 1 and not self.after_earlier_chunks
        return one and self.samples and self.start >= self.num_prompt_tokens

    @property
    def samples(self) -> bool:
        return self.end == self.num_known_tokens


@dataclass(frozen=True)
class DecodeRow:
    req_id: str
    blocks: KVAddress
    token_id: int
    position: int
    drafts: tuple[int, ...] = ()  # verified after token_id, at position + 1, ... (a VF call)
    adapter: int = NO_ADAPTER


@dataclass(frozen=True)
class PrefillChunk:
    """A graph call's worth of prompt: at most C tokens (chunked) or a whole prompt (standard)."""

    req_id: str
    blocks: KVAddress
    start: int
    token_ids: tuple[int, ...]
    samples: bool  # the last chunk of the request's prefill: its logits are sampled
    adapter: int = NO_ADAPTER


@dataclass(frozen=True)
class StepPlan:
    decodes: tuple[DecodeRow, ...]
    chunks: tuple[PrefillChunk, ...]
    copies: tuple[BlockCopy, ...] = ()  # cached prefixes into new requests' blocks, run first
    fused: int | None = None  # index of the chunk that runs with the decodes in one MX call

    @property
    def separate_chunks(self) -> tuple[PrefillChunk, ...]:
        """The chunks that run in their own CP calls."""
        return tuple(c for i, c in enumerate(self.chunks) if i != self.fused)


def plan_step(
    work: list[ScheduledWork], chunk_size: int, batch_size: int, copies: tuple[BlockCopy, ...] = ()
) -> StepPlan:
    """Split the step into one TG call (all decodes) and prefill chunks, after the prefix copies.

    chunk_size 0 means a standard export: a prefill must be a whole prompt from position 0.
    """
    decodes, chunks = [], []
    for w in work:
        if not w.token_ids:
            raise PlanError(f"request {w.req_id} was scheduled with no tokens")
        if w.is_decode:
            decodes.append(DecodeRow(w.req_id, w.blocks, w.token_ids[0], w.start, w.drafts, w.adapter))
        else:
            chunks.extend(_split_prefill(w, chunk_size))
    if len(decodes) > batch_size:
        raise PlanError(f"{len(decodes)} decodes in one step exceed the compiled batch_size {batch_size}")
    _check_copies(copies, work)
    return StepPlan(tuple(decodes), tuple(chunks), tuple(copies))


def fuse_chunk(
    plan: StepPlan,
    chunk_size: int,
    decode_widths: tuple[int, ...],
    apart: frozenset[str] = frozenset(),
    in_order: bool = False,
) -> StepPlan:
    """The plan with its first full chunk (`chunk_size` tokens) set to run with the decodes in
    one MX call (mixed_step exports): its decode part is as wide as the batch (the largest of
    `decode_widths`), so only where the decodes would run in that TG width anyway. The MX
    call pads nothing the separate calls would not: a shorter chunk (a prompt's last) keeps
    its narrower CP graph, fewer decodes their narrower TG graph. A request in `apart` (prompt
    logprobs: every position's logits, which MX does not return) keeps CP.

    `in_order` (vLLM's prefix cache on): a chunk may read blocks that an earlier chunk of the step
    writes - vLLM caches a block for prefix hits when it allocates it for a scheduled chunk
    (`KVCacheManager.allocate_slots`, vllm/v1/core/kv_cache_manager.py, 0.16.0 and 0.32) - so
    only the first chunk may run ahead of the others, with the decodes."""
    narrower = [w for w in decode_widths if w < max(decode_widths)]
    if not plan.decodes or len(plan.decodes) <= max(narrower, default=0):
        return plan
    for i, c in enumerate(plan.chunks[:1] if in_order else plan.chunks):
        if len(c.token_ids) == chunk_size and c.req_id not in apart:
            return dataclasses.replace(plan, fused=i)
    return plan


def _check_copies(copies: tuple[BlockCopy, ...], work: list[ScheduledWork]) -> None:
    """A copy fills a request admitted this step with its prefix: its prefill starts right after.
    Copies exist for pools of whole-sequence blocks only (KVPool.copy_graph): the target's request
    addresses that one block."""
    starts = {w.blocks: w.start for w in work}
    for c in copies:
        if starts.get((c.target,)) != c.length:
            raise PlanError(
                f"prefix copy of {c.length} tokens into block {c.target}, but that block's work starts at "
                f"{starts.get((c.target,))}"
            )


def _split_prefill(w: ScheduledWork, chunk_size: int) -> list[PrefillChunk]:
    if chunk_size == 0:
        if w.start != 0 or not w.samples:
            raise PlanError(
                f"request {w.req_id}: a standard export encodes whole prompts, but the scheduler gave "
                f"positions {w.start}..{w.end} of {w.num_known_tokens}; serve a chunked export for "
                "chunked prefill."
            )
        return [PrefillChunk(w.req_id, w.blocks, 0, w.token_ids, True, w.adapter)]
    pieces = prefill_slices(len(w.token_ids), chunk_size)
    return [
        PrefillChunk(
            w.req_id, w.blocks, w.start + p.start, w.token_ids[p], p is pieces[-1] and w.samples, w.adapter
        )
        for p in pieces
    ]


def describe_chunks(plan: StepPlan) -> str:
    """'a[0:32] b[32:40]': each prefill chunk with its positions."""
    return " ".join(f"{c.req_id}[{c.start}:{c.start + len(c.token_ids)}]" for c in plan.chunks)


def describe(plan: StepPlan) -> str:
    """'copy 0->1[0:64] + 2 decodes + a[0:32] b[64:70]' - the runner's debug log line."""
    parts = [f"copy {c.source}->{c.target}[0:{c.length}]" for c in plan.copies]
    drafts = sum(len(d.drafts) for d in plan.decodes)
    parts += (
        [f"{len(plan.decodes)} decodes" + (f" (+{drafts} drafts)" if drafts else "")] if plan.decodes else []
    )
    if plan.chunks:
        parts.append(describe_chunks(plan))
    line = " + ".join(parts)
    if plan.fused is not None:
        c = plan.chunks[plan.fused]
        line += f" (decodes with {c.req_id}[{c.start}:{c.start + len(c.token_ids)}] in one call)"
    return line
