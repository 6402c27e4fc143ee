"""Latency figures from token arrival times (pure: no server, unit-tested)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Trace:
    """One streamed request: when it was sent and when each of its tokens arrived (seconds)."""

    name: str
    prompt_len: int
    sent: float
    tokens: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.tokens[0] - self.sent if self.tokens else None

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.tokens, self.tokens[1:], strict=False)]


def percentiles(values: list[float], qs=(50, 99)) -> dict[str, float]:
    if not values:
        return {f"p{q}": float("nan") for q in qs} | {"max": float("nan")}
    arr = np.asarray(values)
    return {f"p{q}": float(np.percentile(arr, q)) for q in qs} | {"max": float(arr.max())}


def gaps_within(traces: list[Trace], start: float, end: float) -> list[float]:
    """Inter-token gaps of `traces` that overlap [start, end] (a stall spanning it counts)."""
    return [
        b - a for t in traces for a, b in zip(t.tokens, t.tokens[1:], strict=False) if b >= start and a <= end
    ]


def token_rate(traces: list[Trace], start: float, end: float) -> float:
    """Tokens per second the traces received in [start, end]."""
    if end <= start:
        return float("nan")
    return sum(start <= x <= end for t in traces for x in t.tokens) / (end - start)


def summarize_stall(streams: list[Trace], long: Trace, before: float = 2.0) -> dict:
    """W1: the decode streams before and while the long prompt is prefilled.

    The prefill window runs from the long request's send time to its first token.
    """
    if not long.tokens:
        return {"error": long.error or "the long request produced no token"}
    window = (long.sent, long.tokens[0])
    inside = gaps_within(streams, *window)
    return {
        "prefill_window_s": window[1] - window[0],
        "itl_in_window": percentiles(inside),
        "itl_before": percentiles(gaps_within(streams, window[0] - before, window[0])),
        "decode_tok_s_before": token_rate(streams, window[0] - before, window[0]),
        "decode_tok_s_in_window": token_rate(streams, *window),
        "long_ttft_s": long.ttft,
    }


def summarize_load(traces: list[Trace], wall: float) -> dict:
    done = [t for t in traces if t.tokens and not t.error]
    return {
        "requests": len(traces),
        "failed": len(traces) - len(done),
        "ttft": percentiles([t.ttft for t in done]),
        "itl": percentiles([g for t in done for g in t.gaps]),
        "output_tok_s": sum(len(t.tokens) for t in done) / wall,
        "wall_s": wall,
    }


def values_at(runs: list[dict], *path: str) -> list[float]:
    """A figure of each repeated run (runs that lack it are left out)."""
    values = []
    for run in runs:
        value = run
        for key in path:
            value = value.get(key, {}) if isinstance(value, dict) else None
        if isinstance(value, int | float):
            values.append(float(value))
    return values


def median_of(runs: list[dict], *path: str) -> tuple[float, float]:
    """Median and spread (max - min) of a figure over repeated runs."""
    values = values_at(runs, *path)
    if not values:
        return float("nan"), float("nan")
    return statistics.median(values), max(values) - min(values)
