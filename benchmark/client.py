"""Streaming OpenAI-API client that records the arrival time of every token, and the workloads."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
from metrics import Trace


async def stream(http: httpx.AsyncClient, model: str, name: str, ids: list[int], max_tokens: int) -> Trace:
    body = {
        "model": model,
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    trace = Trace(name, len(ids), time.perf_counter())
    try:
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                trace.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return trace
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                for choice in json.loads(line[6:]).get("choices", []):
                    trace.tokens += [now] * max(1, len(choice.get("token_ids") or ()))
    except httpx.HTTPError as e:
        trace.error = repr(e)
    return trace


def prompt_ids(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(4, 400) for _ in range(n)]


async def mixed_load_stall(
    url: str, model: str, streams: int, long_prompt: int, stream_tokens: int, warmup_s: float, seed: int = 1
) -> tuple[list[Trace], Trace]:
    """W1: `streams` requests decode steadily; after warmup_s a long prompt arrives (tokens
    drawn from `seed`: a fresh seed per repeat keeps prefix caches out of the measurement)."""
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=None) as http:
        running = [
            asyncio.create_task(stream(http, model, f"s{i}", prompt_ids(32, rng), stream_tokens))
            for i in range(streams)
        ]
        await asyncio.sleep(warmup_s)
        long = await stream(http, model, "long", prompt_ids(long_prompt, rng), 8)
        return list(await asyncio.gather(*running)), long


async def throughput(
    url: str,
    model: str,
    requests: int,
    lengths: tuple[int, int],
    out_tokens: int,
    concurrency: int,
    seed: int = 2,
) -> tuple[list[Trace], float]:
    """W2: `requests` prompts of random lengths, `concurrency` in flight at a time. The
    lengths are the same for every seed; the tokens differ, so that a repeat never finds
    its prompts in a prefix cache."""
    lengths_rng, tokens_rng = random.Random(2), random.Random(seed)
    prompts = [prompt_ids(lengths_rng.randint(*lengths), tokens_rng) for _ in range(requests)]
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=None) as http:

        async def one(i: int, ids: list[int]) -> Trace:
            async with gate:
                return await stream(http, model, f"r{i}", ids, out_tokens)

        started = time.perf_counter()
        traces = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        return list(traces), time.perf_counter() - started
