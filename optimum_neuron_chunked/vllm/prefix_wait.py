"""Paged exports: vLLM's own prefix cache shares the blocks; this connector only makes a new
request wait while a running prefill computes more of its prompt than the cache holds yet.

vLLM caches a block when it allocates it to a scheduled chunk (`KVCacheManager.allocate_slots`
-> `cache_blocks`, vllm/v1/core/kv_cache_manager.py, 0.16.0 and 0.32), so a request arriving
beside another with the same prefix hits the blocks scheduled so far and computes the rest of
the prefix itself, in parallel with the other: n such requests compute it up to n times, and
each takes its share of every step's token budget. The copy connector's rule
(`prefix_index.worth_waiting`) stops that: the request waits (the scheduler skips a request
answered None and asks again next step, `Scheduler.schedule`, 0.16.0 and 0.32) until the blocks
it shares with a running prefill are scheduled, then hits all of them. It copies nothing:
`build_connector_meta` is empty and the worker never builds a connector.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from .compat import adapter_cache_key
from .connector import MIN_HIT_TOKENS, SchedulerSideConnector, prefilling
from .prefix_index import worth_waiting


class PrefixWaitConnector(SchedulerSideConnector):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        self.min_wait_gain = vllm_config.scheduler_config.long_prefill_token_threshold or MIN_HIT_TOKENS
        self._admitted: dict[str, Any] = {}  # request id -> the vLLM Request (read only)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """(0, False): vLLM's own hit stands; (None, False): ask again next step. Called with
        the local hit, which counts the blocks allocated to chunks scheduled this step."""
        if request.skip_reading_prefix_cache:  # reads no prefix: nothing to wait for
            return 0, False
        computing = prefilling(self._admitted.values(), adapter_cache_key(request.lora_request))
        if worth_waiting(
            request.prompt_token_ids, num_computed_tokens, computing, self.min_wait_gain, self.block_size
        ):
            return None, False
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._admitted[request.request_id] = request  # a resumed request is admitted again

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._admitted.pop(request.request_id, None)
        return False, None
