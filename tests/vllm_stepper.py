"""vLLM's real V1 scheduler driving the real worker and runner in this process, step by step:
the harness of the step-table tests."""

from __future__ import annotations

import torch

from optimum_neuron_chunked.vllm.step_plan import describe_chunks

EXPORT = "llama-2x4x32-eager"
XLA_EXPORT = "llama-2x4x32-xla"  # the graphs on torch-xla's device, served by the SDK's vLLM


class Engine:
    """Scheduler + worker in this process; `step()` returns what the step ran."""

    def __init__(self, export_dir, config=None):
        from vllm.config import ModelConfig, VllmConfig
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        from optimum_neuron_chunked.vllm.worker import KV_LAYER, NeuronChunkedWorker

        config = config or VllmConfig(
            model_config=ModelConfig(model=str(export_dir), dtype="float32", seed=0)
        )
        self.worker = NeuronChunkedWorker(config, 0, 0, "tcp://127.0.0.1:0", is_driver_worker=True)
        self.worker.init_device()
        self.worker.load_model()
        num_blocks = config.cache_config.num_gpu_blocks_override
        spec = self.worker.get_kv_cache_spec()[KV_LAYER]
        kv = KVCacheConfig(num_blocks, [], [KVCacheGroupSpec([KV_LAYER], spec)])
        self.worker.initialize_from_config(kv)
        config.cache_config.num_gpu_blocks = num_blocks
        self.scheduler = Scheduler(config, kv, StructuredOutputManager(config), block_size=spec.block_size)
        self.block_hasher = block_hasher(config, spec.block_size)
        self.tokens: dict[str, list[int]] = {}
        self.verified: list[tuple[str, int, int]] = []  # (request, drafts, accepted) per verify row
        # (request, its tokens so far) -> the drafts to schedule next, instead of the proposer's
        self.drafts_for = None

    def add(
        self, req_id: str, ids: torch.Tensor, max_tokens: int, resumable: bool = False, **sampling
    ) -> None:
        """A greedy request; `resumable`: a streaming-input session, whose next input re-adds the
        id; `sampling`: further SamplingParams fields."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **sampling)
        self.add_request(req_id, ids, params, resumable)

    def add_request(
        self, req_id: str, ids: torch.Tensor, params, resumable: bool = False, lora_request=None
    ) -> None:
        import inspect

        from vllm.v1.request import Request

        # vLLM 0.16.0's Request takes the eos token id (vllm/v1/request.py); 0.32 reads it from params
        eos = {"eos_token_id": None} if "eos_token_id" in inspect.signature(Request).parameters else {}
        request = Request(
            req_id, ids.tolist(), params, None, resumable=resumable, block_hasher=self.block_hasher,
            lora_request=lora_request, **eos
        )  # fmt: skip
        self.scheduler.add_request(request)
        self.tokens.setdefault(req_id, [])

    def abort(self, req_id: str) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)

    def step(self) -> str:
        """One engine step -> 'a+b | c[0:32]' (decodes | prefill chunks with their positions)."""
        so = self.scheduler.schedule()
        out = self.worker.execute_model(so)
        if out is None:
            out = self.worker.sample_tokens(None)
        self.scheduler.update_from_output(so, out)
        for req_id, index in out.req_id_to_index.items():
            self.tokens[req_id] += out.sampled_token_ids[index]
        drafts = self.worker.take_draft_token_ids()  # as EngineCore.post_step (v1/engine/core.py)
        if self.drafts_for is not None:
            from vllm.v1.outputs import DraftTokenIds

            ids = [r for r, t in self.tokens.items() if t and r in self.scheduler.requests]
            drafts = DraftTokenIds(ids, [self.drafts_for(r, self.tokens[r]) for r in ids])
        if drafts is not None:
            self.scheduler.update_draft_token_ids(drafts)
        if so.total_num_scheduled_tokens == 0:
            return ""
        plan = self.worker.runner.last_plan
        for d in plan.decodes:
            if d.drafts:
                emitted = out.sampled_token_ids[out.req_id_to_index[d.req_id]]
                self.verified.append((d.req_id, len(d.drafts), len(emitted) - 1))
        decodes = "+".join(d.req_id for d in plan.decodes)
        return f"{decodes} | {describe_chunks(plan)}".strip()

    def step_until(self, done, max_steps: int = 200) -> None:
        """Step until `done()`; a scheduler that never gets there fails instead of hanging."""
        for _ in range(max_steps):
            if done():
                return
            self.step()
        raise AssertionError(f"not done after {max_steps} steps: {self.tokens}")

    @property
    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def block_hasher(config, block_size: int):
    """vLLM's prefix-cache hashes of a request's blocks, built as its engine core builds them
    (vllm/v1/engine/core.py, 0.16.0 and 0.32): without them vLLM's own prefix cache never hits."""
    if not config.cache_config.enable_prefix_caching:
        return None
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return get_request_block_hasher(block_size, hash_fn)
