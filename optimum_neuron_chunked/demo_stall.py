"""The demo's scenario: streams decode when a long prompt arrives, through vLLM in-process.

vLLM's `LLMEngine` is stepped in this process (no API server, no engine-core process), so a
step's wall time is what the graphs cost. Each step is recorded: its duration, what the
runner ran (the worker's `last_step`) and which requests received a token.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

STREAMS = 3


@dataclass(frozen=True)
class Step:
    ms: float
    ran: str  # "3 decodes + long[0:128]"
    tokens: dict[str, int]  # request -> tokens received this step


@dataclass
class Run:
    """One export through the scenario: steps, and every request's tokens."""

    export: str
    steps: list[Step] = field(default_factory=list)
    arrival: int = 0  # index of the first step after the long prompt arrived
    outputs: dict[str, list[int]] = field(default_factory=dict)

    def first_long_token(self) -> int:
        return next(i for i, s in enumerate(self.steps) if i >= self.arrival and s.tokens.get("long"))

    def long_ttft_ms(self) -> float:
        return sum(s.ms for s in self.steps[self.arrival : self.first_long_token() + 1])

    def prefill_window(self) -> list[Step]:
        """The steps from the long prompt's arrival to its first token."""
        return self.steps[self.arrival : self.first_long_token() + 1]

    def longest_stream_gap_ms(self) -> float:
        """Longest time any stream waited between two tokens, over the whole run."""
        longest = 0.0
        for stream in (f"stream{i}" for i in range(STREAMS)):
            waited = None  # since the stream's last token
            for s in self.steps:
                if waited is not None:
                    waited += s.ms
                if s.tokens.get(stream):
                    longest = max(longest, waited or 0.0)
                    waited = 0.0
        return longest

    def stream_tokens_while_prefilling(self) -> int:
        return sum(n for s in self.prefill_window() for r, n in s.tokens.items() if r != "long")


def stream_prompts(tokenizer) -> list[list[int]]:
    return [tokenizer(f"stream {i}: once upon a time").input_ids for i in range(STREAMS)]


def long_prompt(tokenizer, length: int) -> list[int]:
    text = " ".join(["a long document arrives while the others decode"] * length)
    return tokenizer(text).input_ids[:length]


def run_scenario(exported: Path, long_ids: list[int], stream_ids: list[list[int]], name: str) -> Run:
    """Streams decode for a few steps, then the long prompt arrives; step until all finish."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process
    from vllm import EngineArgs, LLMEngine, SamplingParams

    engine = LLMEngine.from_engine_args(EngineArgs(model=str(exported), seed=0, disable_log_stats=True))
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=48)
    for i, ids in enumerate(stream_ids):
        engine.add_request(f"stream{i}", {"prompt_token_ids": ids}, greedy)
    run = Run(name)
    step(engine, run)  # the streams' prompts
    step(engine, run)  # warm: one decode step
    for _ in range(4):
        step(engine, run)
    engine.add_request(
        "long", {"prompt_token_ids": long_ids}, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4)
    )
    run.arrival = len(run.steps)
    while engine.has_unfinished_requests():
        step(engine, run)
    engine.engine_core.shutdown()
    return run


def step(engine, run: Run) -> None:
    started = time.perf_counter()
    outputs = engine.step()
    ms = (time.perf_counter() - started) * 1000
    (ran,) = engine.collective_rpc("last_step")
    received = {}
    for out in outputs:
        tokens = list(out.outputs[0].token_ids)
        received[out.request_id] = len(tokens) - len(run.outputs.get(out.request_id, []))
        run.outputs[out.request_id] = tokens
    run.steps.append(Step(ms, ran, {r: n for r, n in received.items() if n}))
