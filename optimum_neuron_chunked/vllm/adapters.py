"""vLLM's LoRA adapters on the export's slots: the worker's add_lora / remove_lora / pin_lora /
list_loras, and each step's rows given their slot.

vLLM drives adapters through the worker (v1/worker/worker_base.py, 0.16.0 and 0.32) and treats a
returned False as success (the engine ANDs the workers' booleans; the server ignores them), so
every refusal raises with its reason: the server answers an error status carrying it. Adapters
are kept on the host (`--max-cpu-loras`, least recently used unpinned one dropped first); a
request naming an adapter vLLM's LRU dropped (or one /v1/unload_lora_adapter forgot on the API
side only) is read again from its `lora_path`. Keys are vLLM's adapter ids, as its scheduler
counts them (`lora_config.max_loras` distinct ids a step: v1/core/sched/scheduler.py).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

from vllm.logger import init_logger
from vllm.lora.utils import get_adapter_absolute_path  # vllm/lora/utils.py, 0.16.0 and 0.32

from ..adapter_slots import SlotTable
from ..graph_runner import GraphRunner
from ..lora_adapter import LoraAdapter, LoraConfigError
from ..lora_targets import resolve_targets
from ..modeling.lora import LoraSpec
from .compat import lora_target_modules

logger = init_logger(f"vllm.{__name__}")


class AdapterManager:
    def __init__(self, graph_runner: GraphRunner, lora_config):
        self.graph_runner = graph_runner
        self.lora_spec = LoraSpec.of(graph_runner.config)
        # vLLM's flags as lora_flags.fit_lora set them: at most the export's rank and targets
        self.max_rank = lora_config.max_lora_rank
        self.targets = set(resolve_targets(lora_target_modules(lora_config)))
        self.max_cpu_loras = lora_config.max_cpu_loras
        self.slots = SlotTable(self.lora_spec.slots)
        self.host: OrderedDict[int, LoraAdapter] = OrderedDict()  # id -> adapter, least recent first

    def add(self, lora_request) -> bool:
        """Read the adapter (LoraConfigError names what cannot be served) and keep it on the host."""
        # a local folder or a Hub id, resolved as vLLM resolves it (offline: the HF cache)
        adapter = self.graph_runner.read_adapter(get_adapter_absolute_path(lora_request.lora_path))
        if adapter.rank > self.max_rank:
            raise LoraConfigError(
                f"{adapter.path}: rank {adapter.rank} exceeds --max-lora-rank {self.max_rank}"
            )
        # as vLLM's --lora-target-modules: the adapter's other modules are left out
        kept = {m: w for m, w in adapter.weights.items() if m.rsplit(".", 1)[-1] in self.targets}
        adapter = dataclasses.replace(adapter, weights=kept)
        if lora_request.lora_int_id in self.host:  # a reload under the same id: the slot is stale
            self.slots.release(lora_request.lora_int_id)
        self.host[lora_request.lora_int_id] = adapter
        self.host.move_to_end(lora_request.lora_int_id)
        self._trim_host()
        logger.info(
            "adapter %s (id %d, rank %d) from %s",
            lora_request.lora_name,
            lora_request.lora_int_id,
            adapter.rank,
            adapter.path,
        )
        return True

    def remove(self, lora_id: int) -> bool:
        if self.host.pop(lora_id, None) is None:
            return False
        self.slots.drop(lora_id)
        return True

    def pin(self, lora_id: int) -> bool:
        if lora_id not in self.host:
            raise ValueError(f"adapter id {lora_id} is not loaded: load it before pinning it")
        self.slots.pin(lora_id)
        return True

    def ids(self) -> set[int]:
        return set(self.host)

    def slots_for(self, requests: dict[str, object]) -> dict[str, int]:
        """Each request's slot (NO_ADAPTER: the base) for a step, `requests` mapping request ids to
        their LoRARequest or None; adapters that enter a slot are written into it now."""
        keys = [lr.lora_int_id if lr is not None and lr.lora_int_id > 0 else None for lr in requests.values()]
        for lr, key in zip(requests.values(), keys, strict=True):
            if key is None:
                continue
            if key not in self.host:
                logger.info("adapter %s (id %d) is read again from %s", lr.lora_name, key, lr.lora_path)
                self.add(lr)
            self.host.move_to_end(key)
        slots = self.slots.place_rows(keys, self._write)
        return dict(zip(requests, slots, strict=True))

    def _write(self, slot: int, lora_id: int) -> None:
        self.graph_runner.write_adapter(slot, self.host[lora_id])

    def _trim_host(self) -> None:
        while len(self.host) > self.max_cpu_loras:
            victim = next((i for i in self.host if i not in self.slots.pinned), None)
            if victim is None:
                return
            self.remove(victim)
