"""The vLLM worker: loads the export and hands each engine step to the StepRunner."""

from __future__ import annotations

import os

import torch
from vllm.logger import init_logger
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec
from vllm.v1.worker.worker_base import WorkerBase

from ..backends import get_backend
from ..config import NeuronConfig
from ..graph_runner import GraphRunner
from .compat import no_compilation_times
from .kv_blocks import vllm_num_blocks
from .platform import data_parallel_rank, served_export
from .runner import StepRunner
from .step_plan import describe

logger = init_logger(f"vllm.{__name__}")  # under vLLM's configured logger
KV_LAYER = "neuron_chunked.kv_cache"  # the static cache, as one vLLM "layer"


class NeuronChunkedWorker(WorkerBase):
    runner: StepRunner

    def init_device(self) -> None:
        self.device = torch.device("cpu")
        # Checked by the platform already and again by load_model: only the shapes are read here.
        export = NeuronConfig.load(served_export(self.model_config))
        # Before load_model starts the backend's runtime: data-parallel rank r (one engine core
        # process each, vllm/v1/engine/core.py 0.16.0 and 0.32) takes its own devices.
        rank, size = data_parallel_rank(self.parallel_config)
        env = get_backend(export.backend).device_env(export, rank, size)
        os.environ.update(env)
        if env:
            logger.info("data-parallel rank %d: %s", rank, " ".join(f"{k}={v}" for k, v in env.items()))

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        graph_runner = GraphRunner.load(served_export(self.model_config))
        self.runner = StepRunner(graph_runner, self.vllm_config)
        kv = graph_runner.capabilities.kv
        logger.info(
            "loaded %s; KV cache %d blocks of %d positions, %.3f MiB a block; torch threads: %d",
            self.model_config.model,
            kv.num_blocks,
            kv.block_size,
            kv.bytes_per_block / 2**20,
            torch.get_num_threads(),
        )

    def get_model(self) -> torch.nn.Module:
        return torch.nn.Module()  # the model lives inside the compiled graphs

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        # vLLM accounts the static cache as one layer of every layer's KV heads: its block
        # count is fixed by the platform, so only the page size matters (determine_available_memory).
        # One group of P-token blocks, full attention for every layer (sliding-window layers keep
        # every position, or a ring in a whole-sequence block), so vLLM's block table is the export's.
        # A ring layer's block holds fewer positions than P: vLLM reads only the page size, and the
        # block count is the platform's (num_gpu_blocks_override), so no decision depends on it.
        # An EAGLE3 head's layer is one more of the same KV heads and head_dim in the same blocks
        # (kv_layout.KVLayout.draft; the core refuses heads of other shapes).
        kv = self.runner.capabilities.kv
        kv_spec = FullAttentionSpec(
            block_size=self.cache_config.block_size,
            num_kv_heads=kv.page_kv_heads,
            head_size=kv.head_dim,
            dtype=kv.pool_dtype,  # what a block holds: fp8 exports count one byte a value
        )
        return {KV_LAYER: kv_spec}

    def get_supported_kv_cache_layouts(self) -> list[str]:
        return ["LBNHC"]

    def determine_available_memory(self) -> int:
        # The cache is allocated by the export; vLLM's block count comes from the platform's
        # num_gpu_blocks_override. Report exactly what that many blocks take.
        kv_spec = self.get_kv_cache_spec()[KV_LAYER]
        return kv_spec.page_size_bytes * self.cache_config.num_gpu_blocks_override

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        # Nothing to allocate: the export owns its pool, addressed through kv_blocks.pool_block.
        pool = self.runner.capabilities.kv.num_blocks
        if kv_cache_config.num_blocks > vllm_num_blocks(pool):
            raise RuntimeError(
                f"vLLM sized the KV cache at {kv_cache_config.num_blocks} blocks, the export's "
                f"pool has {pool} (plus vLLM's null block)"
            )

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        # called by vLLM 0.16.0's engine core (vllm/v1/engine/core.py); 0.32 no longer does.
        # The static cache is the export's: initialize_from_config checks vLLM's block count.
        return None

    def compile_or_warm_up_model(self):
        return no_compilation_times()  # the graphs were compiled at export

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def execute_model(self, scheduler_output):
        return self.runner.execute_model(scheduler_output)

    def sample_tokens(self, grammar_output):
        return self.runner.sample_tokens(grammar_output)

    def take_draft_token_ids(self):
        return self.runner.take_draft_token_ids()

    def last_step(self) -> str:
        """What the last step ran, e.g. '3 decodes + long[0:128]' (collective_rpc)."""
        plan = self.runner.last_plan
        return describe(plan) if plan is not None else "-"

    # vLLM's LoRA calls (v1/worker/worker_base.py): a refusal raises, a False would read as success
    def add_lora(self, lora_request) -> bool:
        return self._adapters().add(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self._adapters().remove(lora_id)

    def pin_lora(self, lora_id: int) -> bool:
        return self._adapters().pin(lora_id)

    def list_loras(self) -> set[int]:
        return self._adapters().ids()

    def _adapters(self):
        if self.runner.adapters is None:
            raise ValueError("LoRA adapters are served with --enable-lora (an export with --max-loras slots)")
        return self.runner.adapters

    def get_cache_block_size_bytes(self) -> int:
        return self.get_kv_cache_spec()[KV_LAYER].page_size_bytes

    def check_health(self) -> None:
        return

    def get_kv_connector_handshake_metadata(self) -> None:
        # asked by the engine core when a KV connector is set (prefix caching, connector.py):
        # our connector runs in the scheduler only and exchanges nothing with workers
        return None
