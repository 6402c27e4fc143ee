"""W1 and W2 at the engine: vLLM's `LLMEngine` stepped in-process, no HTTP (on 2 cores the API
server's noise dominates and hurts the native contender most). serve_bench.py keeps the
serving view; its contenders, model and exports are these.

Contenders (serve_bench.py's bench model, fp32, B=8, S=4096, C=256):
  std            standard export (CE graph), whole prompts per step
  chunked        chunked export, vLLM schedules the chunks (the default)
  chunked-whole  chunked export, budget max_model_len + max_num_seqs: whole prompts per step
  native         vLLM's own CPU engine on the HF checkpoint, its default budget
  native-budget  the same at the budget our platform derives for the chunked export
Workloads (prefix caching off everywhere; fresh token ids per repeat):
  W1  4 streams decode; after 100 tokens each a 3072-token prompt arrives. Its TTFT, the streams' max
      stall (inter-token gap) in its prefill window, the decode step before it (4 streams)
      and the median step inside the window.
  W2  48 prompts of 128-2048 tokens, 64 out, 8 in flight: output tok/s, TTFT p50.
Each contender runs in its own process (vLLM picks its platform once per process).

    python benchmark/engine_bench.py [--quick] [--repeats 3] [--contenders chunked,native-budget]
                                     [--buckets 512,...,4096] [--prefill-widths 64,128,256] [--decode-widths 4,8]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(REPO), str(HERE)]

from client import prompt_ids  # noqa: E402
from engine_loop import NATIVE_ENV, EngineLoop  # noqa: E402
from host import describe_host  # noqa: E402
from metrics import summarize_load, summarize_stall, values_at  # noqa: E402
from serve_bench import FULL, QUICK, Setup, add_shape_arguments, describe, exports, shaped  # noqa: E402

from optimum_neuron_chunked.vllm.limits import full_chunk_budget  # noqa: E402

CONTENDERS = ("std", "chunked", "chunked-whole", "native", "native-budget")


@dataclass(frozen=True)
class Loads:
    streams: int
    stream_prompt: int
    stream_tokens: int
    long_prompt: int
    warm_tokens: int  # each stream's tokens before the long prompt arrives
    requests: int
    lengths: tuple[int, int]
    out_tokens: int
    in_flight: int


FULL_LOADS = Loads(4, 32, 400, 3072, 100, 48, (128, 2048), 64, 8)
QUICK_LOADS = Loads(3, 16, 120, 384, 30, 8, (32, 256), 8, 4)


def engine_args(name: str, model: str, setup: Setup) -> dict:
    limits = dict(model=model, max_num_seqs=setup.batch, max_model_len=setup.seq, enable_prefix_caching=False)
    if name == "chunked-whole":
        return limits | dict(
            max_num_batched_tokens=setup.seq + setup.batch, long_prefill_token_threshold=setup.seq
        )
    if name.startswith("native"):
        limits |= dict(dtype="float32")
    if name == "native-budget":
        limits |= dict(
            max_num_batched_tokens=full_chunk_budget(setup.chunk, setup.batch),
            long_prefill_token_threshold=setup.chunk,
        )
    return limits


def w1(loop: EngineLoop, loads: Loads, seed: int) -> dict:
    rng = random.Random(seed)
    streams = [
        loop.add(f"s{i}-{seed}", prompt_ids(loads.stream_prompt, rng), loads.stream_tokens)
        for i in range(loads.streams)
    ]
    first_step = len(loop.steps)
    # the long prompt arrives once every stream has decoded warm_tokens (by tokens, not time:
    # a fast engine's streams would finish before a fixed delay)
    while min(len(t.tokens) for t in streams) < loads.warm_tokens:
        loop.step()
    long = loop.add(f"long-{seed}", prompt_ids(loads.long_prompt, rng), 8)
    while loop.busy:
        loop.step()
    steps = loop.steps[first_step:]
    first_token = long.tokens[0]
    before = [s.ms for s in steps if not s.prefilling and s.started < long.sent]
    window = [s.ms for s in steps if long.sent <= s.started < first_token]
    decoding_since = max(t.tokens[0] for t in streams)
    return summarize_stall(streams, long, before=long.sent - decoding_since) | {
        "decode_step_ms_before": statistics.median(before) if before else None,
        "step_ms_in_window": statistics.median(window) if window else None,
    }


def w2(loop: EngineLoop, loads: Loads, seed: int) -> dict:
    """serve_bench's W2 prompts (the same lengths every repeat, fresh tokens per seed)."""
    lengths_rng, tokens_rng = random.Random(2), random.Random(seed)
    queue = [
        (f"r{i}-{seed}", prompt_ids(lengths_rng.randint(*loads.lengths), tokens_rng))
        for i in range(loads.requests)
    ]
    started = time.perf_counter()
    traces = loop.serve(queue, loads.out_tokens, loads.in_flight)
    return summarize_load(traces, time.perf_counter() - started)


def run_contender_here(name: str, model: str, setup: Setup, loads: Loads, repeats: int) -> dict:
    loop = EngineLoop(**engine_args(name, model, setup))
    loop.warm_up_buckets(setup.chunk, setup.seq)
    out = {"w1": [], "w2": []}
    for i in range(repeats):
        out["w1"].append(w1(loop, loads, seed=100 + i))
        out["w2"].append(w2(loop, loads, seed=200 + i))
        print(f"{name} repeat {i}: W1 TTFT {out['w1'][-1]['long_ttft_s']:.2f} s, "
              f"W2 {out['w2'][-1]['output_tok_s']:.1f} tok/s", file=sys.stderr, flush=True)  # fmt: skip
    loop.close()
    return out


def run_contender(name: str, model: Path, quick: bool, repeats: int, scratch: Path) -> dict:
    env = dict(os.environ)
    if name.startswith("native"):
        env |= NATIVE_ENV
    out = scratch / f"engine-{name}.json"
    cmd = [sys.executable, __file__, "--engine", name, "--model", str(model), "--out", str(out),
           "--repeats", str(repeats)] + (["--quick"] if quick else [])  # fmt: skip
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        return {"error": proc.stderr[-3000:]}
    return json.loads(out.read_text())


FIGURES = [  # (label, workload, path into a run's summary, scale)
    ("W1 long-prompt TTFT ms", "w1", ("long_ttft_s",), 1000),
    ("W1 max stall of the streams ms", "w1", ("itl_in_window", "max"), 1000),
    ("W1 decode step before the prompt ms", "w1", ("decode_step_ms_before",), 1),
    ("W1 step in the prefill window ms", "w1", ("step_ms_in_window",), 1),
    ("W2 output tok/s", "w2", ("output_tok_s",), 1),
    ("W2 TTFT p50 ms", "w2", ("ttft", "p50"), 1000),
]


def render(results: dict) -> str:
    names = [n for n in results["contenders"] if "error" not in results["contenders"][n]]
    lines = [
        f"# Engine-level W1/W2 ({results['date']}, {results['machine']})",
        "",
        f"Setup: {results['setup']}; loads: {results['loads']}; repeats: {results['repeats']}. "
        "Median [min-max] over repeats; LLMEngine stepped in-process, prefix caching off.",
        "",
        "| figure | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for label, load, path, scale in FIGURES:
        cells = []
        for n in names:
            v = [x * scale for x in values_at(results["contenders"][n][load], *path)]
            cells.append(f"{statistics.median(v):.1f} [{min(v):.1f}-{max(v):.1f}]" if v else "-")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for n, r in results["contenders"].items():
        if "error" in r:
            lines += ["", f"{n} failed: {r['error'][-400:]}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model and loads (a smoke run)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--work", type=Path, default=Path.home() / ".cache" / "optimum-neuron-chunked" / "bench")
    p.add_argument("--tag", default="")
    add_shape_arguments(p)
    p.add_argument("--results", type=Path, default=HERE / "results")
    p.add_argument("--engine", help=argparse.SUPPRESS)
    for name in ("--model", "--out"):
        p.add_argument(name, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    setup, loads = (QUICK, QUICK_LOADS) if args.quick else (FULL, FULL_LOADS)
    setup = shaped(setup, args)
    if args.engine:
        result = run_contender_here(args.engine, args.model, setup, loads, args.repeats)
        Path(args.out).write_text(json.dumps(result))
        return 0
    work = args.work / ("quick" if args.quick else "full")
    work.mkdir(parents=True, exist_ok=True)
    names = args.contenders.split(",")
    ckpt, folders, _ = exports(setup, work, kinds=("std",) * ("std" in names) + ("chunked",))
    contenders = {}
    for name in names:
        model = ckpt if name.startswith("native") else folders["std" if name == "std" else "chunked"]
        contenders[name] = run_contender(name, model, args.quick, args.repeats, work)
        print(f"{name} done", file=sys.stderr, flush=True)
    date = datetime.date.today().isoformat()
    results = dict(date=date, machine=describe_host(), repeats=args.repeats,
                   setup=describe(setup),
                   loads=str(loads), contenders=contenders)  # fmt: skip
    name = f"engine-{date}-vm{'-quick' if args.quick else ''}{'-' + args.tag if args.tag else ''}"
    (args.results / f"{name}.json").write_text(json.dumps(results, indent=1))
    (args.results / f"{name}.md").write_text(render(results))
    print(render(results))
    return 0 if all("error" not in r for r in contenders.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
