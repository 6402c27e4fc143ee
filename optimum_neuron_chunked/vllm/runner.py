"""The step runner: scheduler output -> plan -> prefix copies, graphs -> hybrid sampling -> ModelRunnerOutput.

vLLM calls `execute_model` (graphs run, nothing sampled yet) then `sample_tokens` with the
structured-output bitmask, if any.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, LogprobsTensors, ModelRunnerOutput

from ..graph_runner import GraphRunner
from ..modeling.kv_layout import PrefixCache
from ..prompt_lookup import accept_greedy
from .adapters import AdapterManager
from .batch import BatchState
from .compat import host_sampler
from .connector import PrefixCopies
from .prompt_logprobs import add_chunk
from .sampling import device_sampling_inputs, host_sample, on_device_eligible
from .speculation import Drafter, HeadDrafter, RandomRow, accept_random, is_greedy, verifiable
from .step_plan import StepPlan, describe, fuse_chunk, plan_step

logger = init_logger(f"vllm.{__name__}")  # under vLLM's configured logger (VLLM_LOGGING_LEVEL)


@dataclass
class StepResult:
    """What the graphs produced: logits to sample on the host, tokens sampled on device."""

    plan: StepPlan
    host_logits: dict[str, torch.Tensor] = field(default_factory=dict)
    device_tokens: dict[str, int] = field(default_factory=dict)
    # tokens a request emits this step beside device_tokens (a greedy verified row's, a host-
    # sampled row's); to_verify: the random rows whose drafts are accepted once their bonus token
    # is sampled on the host: req_id -> (drafts, logits [d, V])
    emitted: dict[str, list[int]] = field(default_factory=dict)
    to_verify: dict[str, tuple[list[int], torch.Tensor]] = field(default_factory=dict)
    prompt_logprobs: dict[str, LogprobsTensors | None] = field(default_factory=dict)


class StepRunner:
    def __init__(self, graph_runner: GraphRunner, vllm_config: VllmConfig):
        self.graph_runner = graph_runner  # the export's engine: one method per graph operation
        self.config = graph_runner.config
        self.capabilities = graph_runner.capabilities
        # The prefix-cache policy the platform chose (platform._set_prefix_caching): vLLM's own
        # prefix cache is on only where the layout's policy is SHARED; COPY runs through our
        # connector (its copies arrive in the connector metadata) with vLLM's flag off.
        self.shares_vllm_blocks = (
            self.capabilities.kv.prefix_cache is PrefixCache.SHARED
            and vllm_config.cache_config.enable_prefix_caching
        )
        self.batch = BatchState(vllm_config, self.shares_vllm_blocks)
        self.logprobs_mode = vllm_config.model_config.logprobs_mode
        self.sampler = host_sampler(self.logprobs_mode)
        self.vocab_size = vllm_config.model_config.get_vocab_size()
        self.rng = torch.Generator().manual_seed(vllm_config.model_config.seed or 0)
        # What the last step ran (step tables, debugging); older plans are not kept, so a
        # long-running server holds no per-step state.
        self.last_plan: StepPlan | None = None
        self._pending: tuple[SchedulerOutput, StepResult] | None = None
        speculative = vllm_config.speculative_config
        eagle3 = speculative is not None and speculative.method == "eagle3"
        self.head = HeadDrafter(graph_runner, speculative.num_speculative_tokens) if eagle3 else None
        self.drafter = (
            Drafter(vllm_config, speculative.num_speculative_tokens) if speculative and not eagle3 else None
        )
        self._drafts: dict[str, list[int]] = {}  # proposed after the last step, for the scheduler
        lora_config = vllm_config.lora_config
        self.adapters = AdapterManager(graph_runner, lora_config) if lora_config is not None else None

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        self.batch.update(so)
        if self.head is not None:  # the head drafts during the step's graph calls
            self._drafts = {}
        if so.total_num_scheduled_tokens == 0:
            self.last_plan = None
            return EMPTY_MODEL_RUNNER_OUTPUT
        copies = so.kv_connector_metadata.copies if isinstance(so.kv_connector_metadata, PrefixCopies) else ()
        slots = self.adapters.slots_for(self.batch.adapter_requests(so)) if self.adapters else None
        plan = plan_step(
            self.batch.scheduled_work(so, slots),
            self.config.prefill_chunk_size,
            self.config.batch_size,
            copies,
        )
        if self.config.mixed_step:
            apart = frozenset(self.batch.prompt_logprobs)
            plan = fuse_chunk(
                plan,
                self.config.prefill_chunk_size,
                self.config.decode_widths,
                apart,
                in_order=self.shares_vllm_blocks,
            )
        self.last_plan = plan
        logger.debug("step: %s", describe(plan))
        result = StepResult(plan)
        for c in plan.copies:  # before any graph of the step writes their blocks
            self.graph_runner.copy_prefix(c.source, c.target, c.length)
        self._run_decodes(result)
        self._run_chunks(result)
        self._pending = (so, result)
        return None

    def sample_tokens(self, grammar_output) -> ModelRunnerOutput:
        so, result = self._pending
        self._pending = None
        tokens = {r: [t] for r, t in result.device_tokens.items()} | result.emitted
        logprobs = None
        if result.host_logits:
            drafts = so.scheduled_spec_decode_tokens
            host, logprobs = host_sample(self.batch, self.sampler, result.host_logits, grammar_output, drafts)
            tokens |= {r: [t] for r, t in host.items() if r not in result.to_verify}
            tokens |= self._accept(host, result)
        self.batch.append_tokens(tokens)
        ib = self.batch.input_batch
        if self.drafter is not None:
            self._drafts = self.drafter.propose(ib, tokens, self._verifiable)
        return ModelRunnerOutput(
            req_ids=list(ib.req_ids),
            req_id_to_index=dict(ib.req_id_to_index),
            sampled_token_ids=[tokens.get(r, []) for r in ib.req_ids],
            logprobs=logprobs,
            prompt_logprobs_dict=result.prompt_logprobs,
        )

    def take_draft_token_ids(self):
        """The drafts proposed after the last step (vLLM's engine core hands them to the
        scheduler: EngineCore.post_step, v1/engine/core.py, 0.16.0 and 0.32)."""
        from vllm.v1.outputs import DraftTokenIds

        if not self._drafts:
            return None
        drafts, self._drafts = self._drafts, {}
        return DraftTokenIds(list(drafts), list(drafts.values()))

    def _verifiable(self, req_id: str) -> bool:
        return verifiable(self.batch.requests[req_id].sampling_params)

    def _accept(self, bonus: dict[str, int], result: StepResult) -> dict[str, list[int]]:
        """Random rows with drafts, their bonus tokens sampled: every row's tokens by one
        rejection sampling, rows in vLLM's batch order."""
        req_ids = [r for r in self.batch.input_batch.req_ids if r in result.to_verify]
        if not req_ids:
            return {}
        rows = []
        for r in req_ids:
            state, (drafts, logits) = self.batch.requests[r], result.to_verify[r]
            rows.append(RandomRow(drafts, logits, bonus[r], state.sampling_params, state.generator))
        return dict(zip(req_ids, accept_random(rows), strict=True))

    def _run_decodes(self, result: StepResult) -> None:
        decodes = result.plan.decodes
        if not decodes:
            return
        # With an EAGLE3 head every verifiable row verifies, drafts or not: the draft call after
        # the VF call writes the head's K/V at the row's positions from the aux states the VF call
        # leaves (draft calls follow CP or VF calls only); a TG step would leave a hole there that
        # the head's later passes read. Else the TG graph: a step with no drafts costs no more.
        head_rows = self.head is not None and any(self._verifiable(d.req_id) for d in decodes)
        if head_rows or any(d.drafts for d in decodes):
            self._run_verify(result)
            return
        params = [self.batch.requests[d.req_id].sampling_params for d in decodes]
        caps = self.capabilities
        on_device = caps.on_device_sampling and all(
            on_device_eligible(p, caps.max_topk, self.vocab_size) for p in params
        )
        sampling = device_sampling_inputs(params, self.rng) if caps.on_device_sampling else None
        rows = [torch.tensor([getattr(d, f) for d in decodes]) for f in ("token_id", "position")]
        rows.append([d.blocks for d in decodes])
        adapters = [d.adapter for d in decodes]
        if result.plan.fused is None:
            tokens, logits = self.graph_runner.decode(*rows, sampling, not on_device, adapters)
        else:
            chunk = result.plan.chunks[result.plan.fused]
            chunk_args = (torch.tensor(chunk.token_ids), chunk.start, chunk.blocks)
            tokens, logits, chunk_logits = self.graph_runner.decode_with_chunk(
                *rows, sampling, *chunk_args, not on_device, adapters, chunk.adapter
            )
            if chunk.samples:
                result.host_logits[chunk.req_id] = chunk_logits
        for i, d in enumerate(decodes):
            if on_device:
                result.device_tokens[d.req_id] = int(tokens[i])
            else:
                result.host_logits[d.req_id] = logits[i]

    def _run_verify(self, result: StepResult) -> None:
        """Every decode row through one VF call: its token and drafts scored at once. Greedy rows
        take the graph's argmax; random rows sample their bonus token on the host, then accept
        by rejection sampling; rows needing more than that sample their first position only."""
        decodes = result.plan.decodes
        params = [self.batch.requests[d.req_id].sampling_params for d in decodes]
        greedy = [is_greedy(p) and verifiable(p) for p in params]
        rows = [torch.tensor([d.token_id, *d.drafts]) for d in decodes]
        positions = torch.tensor([d.position for d in decodes])
        blocks = [d.blocks for d in decodes]
        adapters = [d.adapter for d in decodes]
        argmax, logits = self.graph_runner.verify(rows, positions, blocks, not all(greedy), adapters)
        for i, (d, p) in enumerate(zip(decodes, params, strict=True)):
            if greedy[i]:
                result.emitted[d.req_id] = accept_greedy(list(d.drafts), argmax[i].tolist())
            elif d.drafts and verifiable(p):
                result.host_logits[d.req_id] = logits[i, len(d.drafts)]  # the bonus position
                result.to_verify[d.req_id] = (list(d.drafts), logits[i, : len(d.drafts)])
            else:
                result.host_logits[d.req_id] = logits[i, 0]
        if self.head is not None:
            self._sample_now(
                result, [d.req_id for d, p in zip(decodes, params, strict=True) if verifiable(p)]
            )
            self._drafts |= self.head.after_verify(decodes, result.emitted)

    def _sample_now(self, result: StepResult, req_ids: list[str]) -> None:
        """The tokens of the verifiable requests `req_ids` that the host samples (random rows:
        the bonus token, then the rejection rule), sampled now rather than in sample_tokens: the
        head's draft call must follow the graph call whose aux states it reads, and it drafts
        from each row's next token. Verifiable requests have no structured output, so the
        step's grammar bitmask is not needed."""
        pending = {r: result.host_logits.pop(r) for r in req_ids if r in result.host_logits}
        if not pending:
            return
        host, _ = host_sample(self.batch, self.sampler, pending)
        result.emitted |= {r: [t] for r, t in host.items() if r not in result.to_verify}
        result.emitted |= self._accept(host, result)
        for r in pending:
            result.to_verify.pop(r, None)

    def _run_chunks(self, result: StepResult) -> None:
        for chunk in result.plan.separate_chunks:
            tokens = torch.tensor(chunk.token_ids)
            wanted = self.batch.prompt_logprobs.get(chunk.req_id)
            if wanted is None:
                logits = self.graph_runner.prefill(tokens, chunk.start, chunk.blocks, adapter=chunk.adapter)
            else:
                rows = self.graph_runner.prefill(tokens, chunk.start, chunk.blocks, True, chunk.adapter)
                logits = rows[-1]
                prompt = self.batch.requests[chunk.req_id].prompt_token_ids
                done, tensors = add_chunk(wanted, prompt, chunk.start, rows, self.sampler, self.logprobs_mode)
                if done:
                    result.prompt_logprobs[chunk.req_id] = tensors
                    del self.batch.prompt_logprobs[chunk.req_id]
            if chunk.samples:
                result.host_logits[chunk.req_id] = logits
            if self.head is not None:  # every request's: cached prefix blocks hold the head's K/V
                self._draft_after_chunk(chunk, result)

    def _draft_after_chunk(self, chunk, result: StepResult) -> None:
        """The head's pass over a request's chunk, its tokens shifted by one: the next prompt
        token last, or after the prompt's last chunk the token sampled from it (now: a greedy
        row's argmax, as a verified row's, or _sample_now); only then are a verifiable request's
        drafts kept (vLLM ignores drafts for a prefill chunk: Scheduler.update_draft_token_ids)."""
        req_id, end = chunk.req_id, chunk.start + len(chunk.token_ids)
        if not chunk.samples:
            self.head.after_chunk(chunk, self.batch.token_at(req_id, end))
            return
        if not self._verifiable(req_id):
            # The host samples its token after the step (sample_tokens): the argmax stands in,
            # read only by the head's K/V at the prompt's last position; its drafts are unused.
            self.head.after_chunk(chunk, int(result.host_logits[req_id][: self.vocab_size].argmax()))
            return
        if is_greedy(self.batch.requests[req_id].sampling_params):
            logits = result.host_logits.pop(req_id)
            result.emitted[req_id] = [int(logits[: self.vocab_size].argmax())]
        else:
            self._sample_now(result, [req_id])
        self._drafts[req_id] = self.head.after_chunk(chunk, result.emitted[req_id][-1])
