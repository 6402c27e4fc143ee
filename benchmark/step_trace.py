"""Where a workload's wall time goes, step by step: engine_bench's W2 (or W4) on one of our
contenders, each step's time grouped by what the runner planned (decode rows, prefill calls and
their widths/windows). Answers "which kind of step costs the time", which a summary cannot.

    python benchmark/step_trace.py [--contender chunked|paged|...] [--workload w2|w4] [--quick]

Prints the groups (steps, total s, median ms) and saves them to
results/steps-<date>-vm[-<tag>]-<contender>[-w4].{md,json}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from engine_bench import FULL_LOADS, QUICK_LOADS, engine_args, w2, w4  # noqa: E402
from engine_loop import EngineLoop  # noqa: E402
from serve_bench import FULL, QUICK, add_shape_arguments, describe, exports, paged_shape, shaped  # noqa: E402


def step_runner(loop: EngineLoop):
    """Our StepRunner inside the in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    return loop.engine.engine_core.engine_core.model_executor.driver_worker.worker.runner


def step_kind(plan, config) -> str:
    """'tg + cp256@w2048 + cp64@w512' (chunked), 'mx@w2048 + cp64@w512' (the decodes fused with a
    chunk) or 'tg + ce@w1024' (standard): the graph calls a plan makes, each prefill call at the
    bucket covering its end."""
    if plan is None:
        return "empty"
    parts = ["tg"] if plan.decodes and plan.fused is None else []
    for i, c in enumerate(plan.chunks):
        end = c.start + len(c.token_ids)
        graph = f"cp{config.width_for(len(c.token_ids))}" if config.chunked else "ce"
        if i == plan.fused:  # MX attends over the bucket covering its decode rows too
            graph, end = "mx", max(end, *(d.position + 1 for d in plan.decodes))
        parts.append(f"{graph}@w{config.bucket_for(end)}")
    return " + ".join(parts)


WORKLOADS = {"w2": w2, "w4": w4}


def trace(loop: EngineLoop, workload, loads, seed: int) -> tuple[dict, list[tuple[str, float, int]]]:
    """The workload's summary and, per step, (graph calls, ms, decode rows)."""
    runner, kinds = step_runner(loop), []
    step = loop.step

    def traced_step():  # our loop's method, not vLLM's: the plan is read after each step
        finished = step()
        plan = runner.last_plan
        rows = len(plan.decodes) if plan is not None else 0
        kinds.append((step_kind(plan, runner.config), loop.steps[-1].ms, rows))
        return finished

    loop.step = traced_step
    summary = workload(loop, loads, seed)
    loop.step = step
    return summary, kinds


def decode_rows(kinds: list[tuple[str, float, int]], batch: int) -> dict:
    """How full the decode (TG) calls were: each call computes `batch` rows, real or padding."""
    rows = [n for _, _, n in kinds if n]
    return dict(tg_calls=len(rows), real_rows_per_call=round(statistics.mean(rows), 2) if rows else 0.0,
                padding_share=round(1 - sum(rows) / (batch * len(rows)), 3) if rows else 0.0)  # fmt: skip


def piggyback_bound(kinds: list[tuple[str, float, int]]) -> dict:
    """What a mixed step could save at most: every decode (TG) call that shares a step with
    prefill calls made free, each priced at the median decode-only step (which also holds the
    step's scheduling, so the bound is generous)."""
    decode_only = [ms for kind, ms, _ in kinds if kind == "tg"]
    shared = sum(1 for kind, _, _ in kinds if kind.startswith("tg + "))
    step_ms = statistics.median(decode_only) if decode_only else 0.0
    return dict(
        shared_tg_calls=shared, decode_step_ms=round(step_ms, 1), saved_s=round(shared * step_ms / 1000, 2)
    )


def group(kinds: list[tuple[str, float, int]]) -> list[dict]:
    by_kind = defaultdict(list)
    for kind, ms, _ in kinds:
        by_kind[kind].append(ms)
    rows = [
        dict(kind=k, steps=len(v), total_s=round(sum(v) / 1000, 2), median_ms=round(statistics.median(v), 1))
        for k, v in by_kind.items()
    ]
    return sorted(rows, key=lambda r: -r["total_s"])


def render(
    contender: str, workload: str, setup: str, summary: dict, rows: list[dict], tg: dict, bound: dict
) -> str:
    wall = summary["wall_s"]
    best = summary["output_tok_s"] * wall / (wall - bound["saved_s"])
    lines = [
        f"# {workload.upper()} step by step: {contender} ({datetime.date.today().isoformat()}, vm)",
        "",
        f"Setup: {setup}. One {workload.upper()} run (seed 200): {summary['output_tok_s']:.1f} output tok/s, "
        f"wall {wall:.1f} s, {sum(r['steps'] for r in rows)} steps. Decode calls: {tg['tg_calls']}, "
        f"{tg['real_rows_per_call']} real rows per call ({tg['padding_share']:.0%} of rows padding).",
        "",
        f"Decode calls sharing a step with prefill calls: {bound['shared_tg_calls']}; priced at the "
        f"median decode-only step ({bound['decode_step_ms']} ms) they take {bound['saved_s']:.2f} s: a mixed "
        f"step that made them free would give at most {best:.1f} tok/s ({best / summary['output_tok_s']:.3f}x).",
        "",
        "| steps | total s | share of wall | median ms | graph calls |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['steps']} | {r['total_s']:.2f} | {r['total_s'] / wall:.1%} | {r['median_ms']:.1f} | {r['kind']} |"
        for r in rows
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contender", default="chunked", choices=("chunked", "chunked-whole", "std", "paged"))
    p.add_argument("--workload", default="w2", choices=tuple(WORKLOADS))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--work", type=Path, default=Path.home() / ".cache" / "optimum-neuron-chunked" / "bench")
    p.add_argument("--results", type=Path, default=HERE / "results")
    p.add_argument("--tag", default="", help="results file name part (keeps earlier runs of the day)")
    add_shape_arguments(p)
    args = p.parse_args(argv)
    setup, loads = (QUICK, QUICK_LOADS) if args.quick else (FULL, FULL_LOADS)
    setup = shaped(setup, args)
    work = args.work / ("quick" if args.quick else "full")
    work.mkdir(parents=True, exist_ok=True)
    kind = args.contender if args.contender in ("std", "paged") else "chunked"
    _, folders, _ = exports(setup, work, kinds=(kind,))
    loop = EngineLoop(**engine_args(args.contender, str(folders[kind]), setup))
    loop.warm_up_buckets(setup.chunk, setup.seq)
    summary, kinds = trace(loop, WORKLOADS[args.workload], loads, seed=200)
    loop.close()
    rows_per_call = paged_shape(setup)["batch_size"] if kind == "paged" else setup.batch
    rows, tg, bound = group(kinds), decode_rows(kinds, rows_per_call), piggyback_bound(kinds)
    text = render(args.contender, args.workload, describe(setup), summary, rows, tg, bound)
    print(text)
    date = datetime.date.today().isoformat()
    tag = f"-{args.tag}" if args.tag else ""
    load = "" if args.workload == "w2" else f"-{args.workload}"
    out = args.results / f"steps-{date}-vm{'-quick' if args.quick else ''}{tag}-{args.contender}{load}"
    out.with_suffix(".json").write_text(
        json.dumps(dict(summary=summary, decode_calls=tg, piggyback_bound=bound, groups=rows), indent=1)
    )
    out.with_suffix(".md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
