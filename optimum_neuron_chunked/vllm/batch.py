"""Per-request state of the running batch, kept in step with vLLM's scheduler.

vLLM sends each request's prompt and sampling parameters once (when it is first scheduled)
and then only how far it got; the runner keeps the rest: the tokens generated so far, the
KV block and the sampling state. Host sampling reuses vLLM's own `InputBatch`, which
derives the sampler's metadata (penalties, seeds, logits processors, ...) from that state.

With whole-sequence blocks the cache is presented to vLLM as one block of `max_model_len`
tokens per request, so vLLM's block pool is the allocator - a finished or aborted request
frees its block in the scheduler itself. vLLM's block b is pool block `kv_blocks.pool_block(b)`,
except with prefix caching, where the connector chooses the pool block of each block it sees
allocated (block_assignment.py) and the step's `PrefixCopies` bring the choice.
Paged exports: a request's KV address is its list of blocks (kv_blocks.py).
"""

from __future__ import annotations

import torch
from vllm.config import VllmConfig
from vllm.sampling_params import SamplingType
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.sample.logits_processor import build_logitsprocs
from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

from ..config import ceil_div
from ..modeling.lora import NO_ADAPTER
from .compat import input_batch_args
from .connector import PrefixCopies, is_prefix_cache_connector
from .kv_blocks import dropped, next_block_ids, pool_block, request_blocks
from .prompt_logprobs import PromptLogprobs
from .step_plan import KVAddress, ScheduledWork


def usable_drafts(drafts) -> list[int]:
    """A request's scheduled drafts up to the first placeholder: vLLM 0.32 pads a request admitted
    with one new token with -1 drafts (v1/core/sched/scheduler.py), which its rejection sampler
    rejects; a row verified without them emits the same one token."""
    out = []
    for token in drafts or ():
        if token < 0:
            break
        out.append(token)
    return out


class BatchState:
    """The running requests (`CachedRequestState`) and vLLM's `InputBatch` over them."""

    def __init__(self, vllm_config: VllmConfig, shares_vllm_blocks: bool = False):
        self.shares_vllm_blocks = shares_vllm_blocks  # vLLM's prefix cache: admitted requests may hit blocks
        mc, sc = vllm_config.model_config, vllm_config.scheduler_config
        block_size = vllm_config.cache_config.block_size
        cpu = torch.device("cpu")
        custom = tuple(mc.logits_processors or ())
        self.input_batch = InputBatch(
            max_num_reqs=sc.max_num_seqs,
            max_model_len=mc.max_model_len,
            max_num_batched_tokens=sc.max_num_batched_tokens,
            device=cpu,
            vocab_size=mc.get_vocab_size(),
            block_sizes=[block_size],
            max_num_blocks_per_req=[ceil_div(mc.max_model_len, block_size)],
            logitsprocs=build_logitsprocs(vllm_config, cpu, False, False, custom),
            logitsprocs_need_output_token_ids=bool(custom),
            **input_batch_args(block_size),
        )
        self.requests: dict[str, CachedRequestState] = {}
        # vLLM block id -> pool block, as the prefix-copy connector assigned them; None: kv_blocks.pool_block
        self.assigned: dict[int, int] | None = (
            {} if is_prefix_cache_connector(vllm_config.kv_transfer_config) else None
        )
        # Requests whose prompt logprobs are still to come.
        self.prompt_logprobs: dict[str, PromptLogprobs] = {}

    def address(self, block_ids: tuple[list[int], ...]) -> KVAddress:
        """The request's pool blocks, in position order (one KV-cache group): kv_blocks.pool_block
        of vLLM's block, unless the prefix-copy connector assigned it (block_assignment.py)."""
        return tuple(self._pool_block(b) for b in request_blocks(block_ids))

    def _pool_block(self, block: int) -> int:
        if self.assigned is None:
            return pool_block(block)
        if block not in self.assigned:
            raise RuntimeError(
                f"block {block} was allocated without a pool block from the prefix-copy connector"
            )
        return self.assigned[block]

    def update(self, so: SchedulerOutput) -> None:
        """Apply what the scheduler changed since the last step (finished, new, advanced)."""
        if isinstance(so.kv_connector_metadata, PrefixCopies):
            self.assigned.update(so.kv_connector_metadata.pool_blocks)
        batch = self.input_batch
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            self.prompt_logprobs.pop(req_id, None)
            batch.remove_request(req_id)
        resumed = so.scheduled_cached_reqs.resumed_req_ids
        # Running but not scheduled this step (preempted): out of the batch, state kept.
        for req_id in batch.req_id_to_index.keys() - (so.num_scheduled_tokens.keys() - resumed):
            batch.remove_request(req_id)
        for req_id in so.preempted_req_ids or ():  # vLLM freed its blocks
            if req_id in self.requests:
                self.requests[req_id].block_ids = dropped(self.requests[req_id].block_ids)
        to_add = [self._new_state(new) for new in so.scheduled_new_reqs]  # after the removals
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            state.num_computed_tokens = cached.num_computed_tokens[i]
            new_blocks = cached.new_block_ids[i]
            state.block_ids = next_block_ids(state.block_ids, new_blocks, req_id in resumed)
            if req_id in cached.all_token_ids:  # resumed: vLLM resends prompt + outputs
                del state.output_token_ids[cached.num_output_tokens[i] :]
            index = batch.req_id_to_index.get(req_id)
            if index is None:
                to_add.append(state)
            else:
                batch.num_computed_tokens_cpu[index] = state.num_computed_tokens
                if new_blocks is not None and req_id not in resumed:
                    batch.block_table.append_row(new_blocks, index)
        for state in to_add:
            batch.add_request(state)
        batch.condense()
        batch.refresh_metadata()  # every step: min_tokens bookkeeping lives there

    def _new_state(self, new) -> CachedRequestState:
        if new.req_id in self.requests:
            return self._continue_session(new)
        params = new.sampling_params
        generator = None
        if params is not None and params.sampling_type == SamplingType.RANDOM_SEED:
            generator = torch.Generator(device="cpu")
            generator.manual_seed(params.seed)
        state = CachedRequestState(
            req_id=new.req_id,
            prompt_token_ids=list(new.prompt_token_ids),
            mm_features=new.mm_features,
            sampling_params=params,
            generator=generator,
            block_ids=new.block_ids,
            num_computed_tokens=new.num_computed_tokens,
            output_token_ids=[],
            lora_request=new.lora_request,
        )
        self.requests[new.req_id] = state
        if params is not None and params.prompt_logprobs is not None:
            k = params.prompt_logprobs
            self.prompt_logprobs[new.req_id] = PromptLogprobs(self.input_batch.vocab_size if k == -1 else k)
        return state

    def _continue_session(self, new) -> CachedRequestState:
        """A streaming-input session's next input: vLLM resends the request as new, its prompt
        now the old prompt + the outputs it kept + the new input, computed up to where the
        block's cache is valid. As vLLM's GPU runner does (`_update_streaming_request`,
        vllm/v1/worker/gpu_model_runner.py, 0.32), the state is updated in place - its
        generator goes on - and re-enters the batch."""
        self.input_batch.remove_request(new.req_id)  # scheduled the step before: still in it
        state = self.requests[new.req_id]
        state.prompt_token_ids = list(new.prompt_token_ids)
        state.num_prompt_tokens = len(state.prompt_token_ids)
        state.sampling_params = new.sampling_params
        state.block_ids = new.block_ids
        state.num_computed_tokens = new.num_computed_tokens
        state.output_token_ids.clear()
        return state

    def adapter_requests(self, so: SchedulerOutput) -> dict[str, object]:
        """Each scheduled request's LoRARequest, or None (the base)."""
        return {req_id: self.requests[req_id].lora_request for req_id in so.num_scheduled_tokens}

    def scheduled_work(self, so: SchedulerOutput, slots: dict[str, int] | None = None) -> list[ScheduledWork]:
        """The step as plain data for the planner, in the scheduler's order; `slots`: each
        request's LoRA slot (vllm/adapters.py), none for the base."""
        admitted = {new.req_id for new in so.scheduled_new_reqs} | so.scheduled_cached_reqs.resumed_req_ids
        work = []
        for req_id, n in so.num_scheduled_tokens.items():
            state = self.requests[req_id]
            start = state.num_computed_tokens
            known = state.prompt_token_ids + state.output_token_ids
            scheduled_drafts = so.scheduled_spec_decode_tokens.get(req_id, ())
            n -= len(scheduled_drafts)
            work.append(
                ScheduledWork(
                    req_id=req_id,
                    blocks=self.address(state.block_ids),
                    start=start,
                    token_ids=tuple(known[start : start + n]),
                    num_prompt_tokens=state.num_prompt_tokens,
                    num_known_tokens=len(known),
                    after_earlier_chunks=self.shares_vllm_blocks and req_id in admitted,
                    drafts=tuple(usable_drafts(scheduled_drafts)),
                    adapter=(slots or {}).get(req_id, NO_ADAPTER),
                )
            )
        return work

    def token_at(self, req_id: str, position: int) -> int:
        """The known token (prompt, then output) of a request at `position`."""
        state = self.requests[req_id]
        prompt = state.prompt_token_ids
        return prompt[position] if position < len(prompt) else state.output_token_ids[position - len(prompt)]

    def append_tokens(self, tokens: dict[str, list[int]]) -> None:
        """Record the tokens each request emitted (output lists are mutated in place: InputBatch
        holds them)."""
        batch = self.input_batch
        for req_id, emitted in tokens.items():
            self.requests[req_id].output_token_ids.extend(emitted)
            i = batch.req_id_to_index[req_id]
            end = int(batch.num_tokens_no_spec[i])
            batch.token_ids_cpu[i, end : end + len(emitted)] = emitted
            batch.is_token_ids[i, end : end + len(emitted)] = True
            batch.num_tokens_no_spec[i] = end + len(emitted)
