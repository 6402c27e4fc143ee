"""Prefix caching through vLLM's KV-connector interface: the scheduler asks how many of a new
request's tokens we can provide, schedules only the rest, and we copy them into its pool block.

vLLM's own prefix caching cannot serve a cache of whole-sequence blocks (one `max_model_len`-token block per
request never fills, so nothing is ever hashed). A KV connector is the hook where vLLM's
scheduler asks for external hits and then chunks the remainder itself (vllm/v1/core/sched/
scheduler.py, 0.32: `get_num_new_matched_tokens` before allocation, `update_state_after_alloc`
after it, `build_connector_meta` at the end of `schedule`, `request_finished` when a request
ends). The platform sets this connector itself (`_set_prefix_caching`); the worker never
builds a worker-side instance: our runner reads the step's `PrefixCopies` and runs the copy
graph before any other graph of the step.

Valid because scheduling is synchronous (the platform turns async scheduling off): when the
scheduler runs, every token it scheduled before has been computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger
from vllm.v1.request import RequestStatus

from .block_assignment import BlockAssignment
from .compat import adapter_cache_key, eagle_block_drop
from .prefix_index import BlockCopy, PrefixHit, PrefixIndex, common_prefix_length, worth_waiting

logger = init_logger(f"vllm.{__name__}")

# Shorter common prefixes are computed, not copied (a chat template's first tokens).
MIN_HIT_TOKENS = 16
# The key of kv_connector_extra_config under which the platform passes the pool's block count.
POOL_BLOCKS = "pool_blocks"


@dataclass(frozen=True)
class PrefixCopies(KVConnectorMetadata):
    """What the runner copies before the step's graphs, in this order."""

    copies: tuple[BlockCopy, ...] = ()
    # (block id, pool block) of the blocks allocated this step (block_assignment.py)
    pool_blocks: tuple[tuple[int, int], ...] = ()


def is_prefix_cache_connector(kv_transfer_config) -> bool:
    """Whether vLLM's KV-transfer config is this copy connector, which the platform sets."""
    return kv_transfer_config is not None and kv_transfer_config.kv_connector_module_path == __name__


def is_platform_connector(kv_transfer_config) -> bool:
    """Whether vLLM's KV-transfer config is one the platform sets (not a user's): this copy
    connector (exports of whole-sequence blocks) or the wait connector (paged exports, prefix_wait.py)."""
    modules = (__name__, f"{__package__}.prefix_wait")
    return kv_transfer_config is not None and kv_transfer_config.kv_connector_module_path in modules


def prefilling(requests, adapter) -> list:
    """The prompts of those vLLM `Request`s that are running under LoRA `adapter`
    (compat.adapter_cache_key) and not yet past their prompt."""
    return [
        r.prompt_token_ids
        for r in requests
        if r.status == RequestStatus.RUNNING
        and r.num_computed_tokens < r.num_prompt_tokens
        and adapter_cache_key(r.lora_request) == adapter
    ]


class SchedulerSideConnector(KVConnectorBase_V1):
    """A connector that lives in the scheduler only: the worker never builds one (the runner
    reads the step's metadata itself), so the worker-side hooks are never called."""

    def start_load_kv(self, forward_context, **kwargs) -> None:
        raise NotImplementedError("scheduler-side connector: the runner reads the step's metadata")

    def wait_for_layer_load(self, layer_name: str) -> None:
        raise NotImplementedError("scheduler-side connector: the runner reads the step's metadata")

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        raise NotImplementedError("scheduler-side connector: the runner reads the step's metadata")

    def wait_for_save(self) -> None:
        raise NotImplementedError("scheduler-side connector: the runner reads the step's metadata")


class PrefixCopyConnector(SchedulerSideConnector):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.index = PrefixIndex(MIN_HIT_TOKENS, drop=int(eagle_block_drop(vllm_config.speculative_config)))
        # a wait must save at least a chunk's worth of prefill (the per-request share of a step)
        self.min_wait_gain = vllm_config.scheduler_config.long_prefill_token_threshold or MIN_HIT_TOKENS
        self._promised: dict[str, PrefixHit] = {}  # request id -> hit, until allocation
        self._live: dict[int, Any] = {}  # pool block -> the vLLM Request filling it (read only)
        # pool block -> tokens of its live request computed once the last scheduled step ran; the
        # index reads them only when a new request looks up (not on every decode step)
        self._live_computed: dict[int, int] = {}
        self._copies: list[BlockCopy] = []
        # Every block of the export's pool (KVPool.num_blocks, which the platform passes: the
        # scheduler loads no export), not max_num_seqs: fewer requests may run than the pool holds,
        # and the spare blocks keep more finished prefixes.
        self.assignment = BlockAssignment(
            vllm_config.kv_transfer_config.kv_connector_extra_config[POOL_BLOCKS]
        )
        self._assigned: list[tuple[int, int]] = []

    # -- scheduler side ----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """(tokens a pool block holds, False), or (None, False): ask again next step - the scheduler
        then skips the request this step and tries the next one (Scheduler.schedule, 0.32)."""
        self._promised.pop(request.request_id, None)
        if num_computed_tokens:  # vLLM's own hit (never, with one block per request)
            return 0, False
        # A request that wants every prompt token's logprobs reads no prefix. vLLM 0.32's
        # scheduler drops a connector's hit for it itself (vllm/v1/core/sched/scheduler.py);
        # 0.16.0's does not, so the connector says it (Request.skip_reading_prefix_cache, both).
        if request.skip_reading_prefix_cache:
            return 0, False
        self._sync_live_blocks()
        adapter = adapter_cache_key(request.lora_request)
        hit = self.index.longest_hit(request.prompt_token_ids, adapter)
        if worth_waiting(
            request.prompt_token_ids,
            hit.length if hit else 0,
            prefilling(self._live.values(), adapter),
            self.min_wait_gain,
        ):
            return None, False
        if hit is None:
            return 0, False
        self._promised[request.request_id] = hit
        return hit.length, False

    def _pool_blocks_of(self, request) -> list[int]:
        return [pool_block for pool_block, r in self._live.items() if r.request_id == request.request_id]

    def _sync_live_blocks(self) -> None:
        for pool_block, computed in self._live_computed.items():
            request = self._live[pool_block]
            adapter = adapter_cache_key(request.lora_request)
            if len(self.index.held(pool_block, adapter)) != computed:
                self.index.set(pool_block, request.all_token_ids[:computed], adapter)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        (block_ids,) = blocks.get_block_ids()
        promised = self._promised.pop(request.request_id, None)
        hit = PrefixHit(promised.source, num_external_tokens) if promised and num_external_tokens else None
        pool_block = self._pool_block_for(request, block_ids[0])
        adapter = adapter_cache_key(request.lora_request)
        copy = self.index.admit(pool_block, request.prompt_token_ids, hit, adapter)
        self._live[pool_block] = request
        self._live_computed[pool_block] = len(self.index.held(pool_block, adapter))
        if copy is not None:
            self._copies.append(copy)
            logger.debug(
                "prefix hit: %s copies %d tokens from pool block %d",
                request.request_id,
                copy.length,
                copy.source,
            )

    def _pool_block_for(self, request, block: int) -> int:
        """The pool block the request's block stands for: kept by a request that keeps its block (a
        streaming session's next input), else chosen by affinity/LRU (block_assignment.py).
        vLLM frees a preempted request's block without telling the connector: a block or a
        request found with a stale pool block gives that pool block back first."""
        mapped = self.assignment.pool_block_of(block)
        if mapped is not None and self._live.get(mapped, request).request_id == request.request_id:
            self._live.pop(mapped, None)
            self._live_computed.pop(mapped, None)
            return mapped
        stale = self._pool_blocks_of(request) + ([mapped] if mapped is not None else [])
        for pool_block in stale:
            self._live.pop(pool_block, None)
            self._live_computed.pop(pool_block, None)
            self.assignment.release(pool_block)
        prompt = np.asarray(request.prompt_token_ids, dtype=np.int64)
        adapter = adapter_cache_key(request.lora_request)
        pool_block = self.assignment.assign(block, lambda s: self._reusable(prompt, s, adapter))
        self._assigned.append((block, pool_block))
        return pool_block

    def _reusable(self, prompt: np.ndarray, pool_block: int, adapter) -> int:
        n = min(common_prefix_length(prompt, self.index.held(pool_block, adapter)), len(prompt) - 1)
        return n if n >= self.index.min_hit else 0

    def build_connector_meta(self, scheduler_output) -> PrefixCopies:
        # What the live pool blocks hold once this step ran (it runs before the next schedule).
        # Called before the scheduler adds this step's tokens to num_computed_tokens
        # (Scheduler.schedule, 0.32: build_connector_meta, then _update_after_schedule).
        scheduled = scheduler_output.num_scheduled_tokens
        for pool_block, request in self._live.items():
            self._live_computed[pool_block] = request.num_computed_tokens + scheduled.get(
                request.request_id, 0
            )
        meta = PrefixCopies(tuple(self._copies), tuple(self._assigned))
        self._copies, self._assigned = [], []
        return meta

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._promised.pop(request.request_id, None)
        for pool_block in self._pool_blocks_of(request):
            # the pool block keeps what was computed until it is given to another request
            adapter = adapter_cache_key(request.lora_request)
            self.index.set(pool_block, request.all_token_ids[: request.num_computed_tokens], adapter)
            del self._live[pool_block], self._live_computed[pool_block]
            self.assignment.release(pool_block)
        return False, None
