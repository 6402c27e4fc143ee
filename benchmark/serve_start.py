"""`vllm serve CHECKPOINT` start times with the export cache: the first start exports the plain
checkpoint once (compiling its graphs), a second start finds the entry and compiles nothing.
The tiny test Llama on the cpu backend (3 graphs: one CP, one TG, the copy graph), two
data-parallel ranks, a fresh export cache; starts alternate first / second `--repeats` times.

    python benchmark/serve_start.py [--repeats 2] [--backend cpu] [--results DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from host import describe_host, results_folder, save  # noqa: E402

ARGS = ("--data-parallel-size", "2", "--max-model-len", "64", "--max-num-seqs", "2")


def start_time(checkpoint: Path, cache: Path, log: Path, backend: str) -> float:
    """Seconds from launch until the server answers, then stopped."""
    from optimum_neuron_chunked.testing.server import Server

    keys = {"prefill_chunk_size": 16, "backend": backend, "context_buckets": [64]}
    began = time.monotonic()
    srv = Server(checkpoint, log, *ARGS, "--additional-config", json.dumps(keys),
                 env={"ONC_EXPORT_CACHE": str(cache)})  # fmt: skip
    try:
        srv.wait_ready(timeout=900)
        return time.monotonic() - began
    finally:
        if srv.stop():
            raise RuntimeError(f"processes left behind: see {log}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--backend", default="cpu", choices=("cpu", "eager"))
    p.add_argument("--results", type=Path, default=None)
    args = p.parse_args(argv)
    from optimum_neuron_chunked.testing.checkpoints import build_checkpoint, checkpoint_key

    scratch = Path(tempfile.mkdtemp(prefix="serve-start-"))
    try:
        checkpoint = build_checkpoint("llama", scratch / f"llama-{checkpoint_key('llama')}")
        times = {"first": [], "second": []}
        for repeat in range(args.repeats):
            cache = scratch / f"cache-{repeat}"  # each repeat's first start exports anew
            for start in times:
                times[start].append(
                    start_time(checkpoint, cache, scratch / f"{start}-{repeat}.log", args.backend)
                )
                print(f"repeat {repeat}: {start} start {times[start][-1]:.1f} s", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary = {
        k: {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v)} for k, v in times.items()
    }
    data = {"date": datetime.date.today().isoformat(), "machine": describe_host(), "backend": args.backend,
            "args": list(ARGS), "times_s": times, "summary": summary}  # fmt: skip
    lines = [f"# `vllm serve CHECKPOINT` start ({data['date']}, {data['machine']}, {args.backend})", "",
             "| start | median s | min s | max s |", "|---|---|---|---|"]  # fmt: skip
    lines += [
        f"| {k} | {s['median_s']:.1f} | {s['min_s']:.1f} | {s['max_s']:.1f} |" for k, s in summary.items()
    ]
    save(results_folder(args.results, smoke=False), f"serve-start-{data['date']}", data, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
