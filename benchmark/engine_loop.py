"""vLLM's `LLMEngine` stepped in this process (no HTTP, no engine-core process): when each
request's tokens arrived and how long each step took.

Token times are the end of the step that produced them: what a client of the engine sees.
One engine per process (vLLM picks its platform once per process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from metrics import Trace

# vLLM's own CPU engine: our platform plugin deselected, a KV cache that fits this machine
NATIVE_ENV = {"VLLM_PLUGINS": "", "VLLM_CPU_KVCACHE_SPACE": "2"}


def in_own_process(name: str, argv: list[str], out: Path) -> dict:
    """Contender `name`'s run (`python argv --out out`) in a process of its own, native ones with
    NATIVE_ENV: the JSON it writes to `out`, or {"error": the end of its stderr}."""
    env = os.environ | (NATIVE_ENV if name.startswith("native") else {})
    cmd = [sys.executable, *argv, "--out", str(out)]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return json.loads(out.read_text()) if proc.returncode == 0 else {"error": proc.stderr[-3000:]}


@dataclass(frozen=True)
class Step:
    ms: float
    started: float  # perf_counter seconds
    prefilling: bool  # some request had no token yet when the step began


class EngineLoop:
    def __init__(self, **engine_args):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process
        from vllm import EngineArgs, LLMEngine

        self.engine = LLMEngine.from_engine_args(
            EngineArgs(**{"seed": 0, "disable_log_stats": True} | engine_args)
        )
        self.traces: dict[str, Trace] = {}
        self.steps: list[Step] = []
        self.cached_tokens: dict[str, int] = {}  # prompt tokens a request did not compute (prefix hits)
        self._running: set[str] = set()
        self.adapters: list = []  # LoRARequests: requests take them round-robin (none: the base)

    def warm_up(self, prompts: list[list[int]]) -> None:
        """Untimed: the graphs' first calls (lazy init, page faults) on these prompts."""
        from vllm import SamplingParams

        for i, ids in enumerate(prompts):
            self.engine.add_request(f"warm-{i}", {"prompt_token_ids": ids}, SamplingParams(max_tokens=2))
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def warm_up_buckets(self, chunk: int, seq: int) -> None:
        """Every graph bucket's first call, on ids no workload uses (3): nothing of it can be
        a prefix hit later."""
        self.warm_up([[3] * n for n in (chunk + 5, seq - 80)])

    def serve(self, queue: list[tuple[str, list[int]]], max_tokens: int, in_flight: int) -> list[Trace]:
        """(name, prompt ids) in order, `in_flight` at a time: the next is sent when one finishes."""
        queue = list(queue)
        traces = [self.add(*queue.pop(0), max_tokens) for _ in range(min(in_flight, len(queue)))]
        while self.busy:
            for _ in self.step():
                if queue:
                    traces.append(self.add(*queue.pop(0), max_tokens))
        return traces

    def add(self, name: str, ids: list[int], max_tokens: int) -> Trace:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
        lora = self.adapters[len(self.traces) % len(self.adapters)] if self.adapters else None
        self.engine.add_request(name, {"prompt_token_ids": ids}, params, lora_request=lora)
        self.traces[name] = trace = Trace(name, len(ids), time.perf_counter())
        self._running.add(name)
        return trace

    def step(self) -> list[str]:
        """One engine step; the names of the requests it finished."""
        prefilling = any(not self.traces[n].tokens for n in self._running)
        started = time.perf_counter()
        outputs = self.engine.step()
        now = time.perf_counter()
        self.steps.append(Step((now - started) * 1000, started, prefilling))
        finished = []
        for out in outputs:  # token_ids are cumulative (RequestOutputKind.CUMULATIVE, the default)
            trace = self.traces.get(out.request_id)
            if trace is None:
                continue
            trace.tokens += [now] * (len(out.outputs[0].token_ids) - len(trace.tokens))
            if out.finished:
                self.cached_tokens[out.request_id] = out.num_cached_tokens or 0
                finished.append(out.request_id)
                self._running.discard(out.request_id)
        return finished

    @property
    def busy(self) -> bool:
        return self.engine.has_unfinished_requests()

    def counters(self, prefix: str) -> dict[str, float]:
        """vLLM's counters named `prefix`... (stats on: disable_log_stats=False)."""
        metrics = self.engine.get_metrics()
        return {m.name: m.value for m in metrics if m.name.startswith(prefix) and hasattr(m, "value")}

    def close(self) -> None:
        self.engine.engine_core.shutdown()
