"""What prefix caching buys, engine-level: vLLM's `LLMEngine` stepped in-process, no HTTP.

Contenders (the bench model, fp32, B=8, S=4096, C=256), each `-on` / `-off` (prefix caching):
ours (the chunked export: our KV connector copies a cached prefix into the request's block),
paged (the paged export, serve_bench.paged_shape, 8 rows: vLLM's prefix caching shares blocks),
native (vLLM's CPU engine, the same token budget).
Workloads (fresh random prompts per repeat, 8 requests in flight, 64 tokens out each):
  shared       16 requests = one 2048-token system prompt + a 64-256-token suffix each, cold
  shared-warm  the same 16, after one untimed request with the system prompt
  no-sharing   16 requests of the same lengths, nothing shared
Each contender runs in its own process (vLLM picks its platform once per process).

    python benchmark/prefix_cache.py [--quick] [--repeats 3] [--contenders ours-on,...] [--results DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(REPO), str(HERE)]

from engine_loop import EngineLoop, in_own_process  # noqa: E402
from host import describe_host, save  # noqa: E402
from serve_bench import Setup, add_common_arguments, describe, exports, parse  # noqa: E402

from optimum_neuron_chunked.vllm.limits import full_chunk_budget  # noqa: E402

CONTENDERS = ("ours-on", "ours-off", "paged-on", "paged-off", "native-on", "native-off")
WORKLOADS = ("shared", "shared-warm", "no-sharing")


@dataclass(frozen=True)
class Workload:
    requests: int
    system: int  # shared prefix length
    suffix: tuple[int, int]  # suffix length range
    out_tokens: int
    in_flight: int


FULL_LOAD = Workload(requests=16, system=2048, suffix=(64, 256), out_tokens=64, in_flight=8)
QUICK_LOAD = Workload(requests=6, system=192, suffix=(16, 48), out_tokens=8, in_flight=3)


def prompts(kind: str, load: Workload, vocab: int, seed: int) -> dict[str, list[list[int]]]:
    """{"timed": the workload's prompts, "prime": served untimed before them}. Seeded by the
    repeat only, so shared and shared-warm time the same prompts."""
    import random

    rng = random.Random(seed)
    token = lambda: rng.randrange(4, vocab)  # noqa: E731 - ids 4.. skip the special tokens
    system = [token() for _ in range(load.system)]
    timed = []
    for _ in range(load.requests):
        suffix = [token() for _ in range(rng.randint(*load.suffix))]
        head = system if kind.startswith("shared") else [token() for _ in range(load.system)]
        timed.append(head + suffix)
    prime = [system + [token() for _ in range(load.suffix[0])]] if kind == "shared-warm" else []
    return {"timed": timed, "prime": prime}


def run_engine(name: str, model: str, setup: Setup, load: Workload, work: dict) -> dict:
    """One contender, one workload ({"timed", "prime"} prompts), in this process: per-request
    TTFT, decode steps, tok/s."""
    engine_args = dict(model=model, max_num_seqs=setup.batch, enable_prefix_caching=name.endswith("-on"))
    if name.startswith("native"):  # the budget and threshold our platform derives for the chunked export
        engine_args |= dict(dtype="float32", max_model_len=setup.seq,
                            max_num_batched_tokens=full_chunk_budget(setup.chunk, setup.batch),
                            long_prefill_token_threshold=setup.chunk)  # fmt: skip
    loop = EngineLoop(**engine_args)
    loop.warm_up_buckets(setup.chunk, setup.seq)
    loop.warm_up(work["prime"])
    queue = [(str(i), ids) for i, ids in enumerate(work["timed"])]
    started = time.perf_counter()
    traces = loop.serve(queue, load.out_tokens, load.in_flight)
    wall = time.perf_counter() - started
    loop.close()
    ttft = [t.ttft * 1000 for t in traces]
    later = ttft[load.in_flight :]  # the first wave is sent together, the rest as slots free
    decode = [s.ms for s in loop.steps if not s.prefilling]
    return {
        "ttft_ms_p50": statistics.median(ttft),
        "ttft_ms_mean": statistics.fmean(ttft),
        "ttft_ms_p50_first_wave": statistics.median(ttft[: load.in_flight]),
        "ttft_ms_p50_later": statistics.median(later) if later else None,
        "decode_step_ms_p50": statistics.median(decode) if decode else None,
        "output_tok_s": sum(len(t.tokens) for t in traces) / wall,
        "hit_rate_pct": 100 * sum(loop.cached_tokens.values()) / sum(t.prompt_len for t in traces),
        "wall_s": wall,
        "steps": len(loop.steps),
        "step_ms": [round(s.ms, 2) for s in loop.steps],
        # per request: ms from the run's start to sent and to its first token
        "requests_ms": {t.name: [(t.sent - started) * 1000, (t.tokens[0] - started) * 1000] for t in traces},
    }


def copy_cost(export_dir: Path, repeats: int = 15) -> dict:
    """The copy graph alone: ms per prefix length (median [min-max]), and K/V bytes per token."""
    import torch

    from optimum_neuron_chunked import NeuronModelForCausalLM

    model = NeuronModelForCausalLM.from_pretrained(export_dir)
    hf, nc = model.config, model.neuron_config
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    itemsize = torch.empty(0, dtype=getattr(torch, nc.dtype)).element_size()
    per_token = 2 * hf.num_hidden_layers * hf.num_key_value_heads * head_dim * itemsize
    out = {"bytes_per_token": per_token, "chunk": nc.prefill_chunk_size, "ms": {}}
    for length in sorted({nc.prefill_chunk_size, nc.sequence_length // 2, nc.sequence_length}):
        model.runner.copy_prefix(0, 1, length)  # warm
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            model.runner.copy_prefix(0, 1, length)
            times.append((time.perf_counter() - t0) * 1000)
        out["ms"][length] = [statistics.median(times), min(times), max(times)]
    return out


def run_contender(name: str, kind: str, quick: bool, model: Path, prompt_file: Path) -> dict:
    argv = [__file__, "--engine", name, "--model", str(model), "--prompts", str(prompt_file)]
    argv += ["--quick"] if quick else []
    result = in_own_process(name, argv, prompt_file.with_suffix(f".{name}.json"))
    if "error" in result:
        raise RuntimeError(f"{name} {kind} failed:\n{result['error']}")
    return result


def spread(values: list[float]) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    return f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]"


def render(results: dict) -> str:
    fields = [("ttft_ms_p50", "TTFT p50 ms"), ("ttft_ms_p50_first_wave", "first wave TTFT p50"),
              ("ttft_ms_p50_later", "later TTFT p50"), ("hit_rate_pct", "hit rate %"), ("output_tok_s", "output tok/s"),
              ("decode_step_ms_p50", "decode step ms")]  # fmt: skip
    lines = [
        f"# Prefix caching, engine-level ({results['date']}, {results['machine']})",
        "",
        f"Setup: {results['setup']}; workload: {results['workload']}; repeats: {results['repeats']}. "
        "Medians over repeats [min-max]; each repeat's value is the median over its requests/steps.",
        "",
        "| workload | contender | " + " | ".join(label for _, label in fields) + " |",
        "|---|---|" + "---|" * len(fields),
    ]
    for kind, by_contender in results["runs"].items():
        for name, runs in by_contender.items():
            cells = [spread([r.get(f) for r in runs]) for f, _ in fields]
            lines.append(f"| {kind} | {name} | " + " | ".join(cells) + " |")
    lines += ["", "Ratios (medians):", ""]
    for kind in results["runs"]:
        lines += ratio_lines(kind, results["runs"][kind])
    cost = results.get("copy_cost")
    if cost:
        lines += ["", f"Copy graph alone (K/V {cost['bytes_per_token']} bytes per token, {cost['chunk']} positions "
                  "per call, median [min-max] of 15):", ""]  # fmt: skip
        for length, (med, lo, hi) in cost["ms"].items():
            mib = int(length) * cost["bytes_per_token"] / 2**20
            lines.append(f"- {length} tokens ({mib:.0f} MiB): {med:.2f} ms [{lo:.2f}-{hi:.2f}]")
    return "\n".join(lines) + "\n"


def ratio_lines(kind: str, runs: dict) -> list[str]:
    def ratio(engine: str, field: str) -> float | None:
        on, off = (statistics.median(r[field] for r in runs[n]) if n in runs else None
                   for n in (f"{engine}-on", f"{engine}-off"))  # fmt: skip
        return on / off if on and off else None

    lines = []
    for engine in ("ours", "paged", "native"):
        ttft, tput = ratio(engine, "ttft_ms_p50"), ratio(engine, "output_tok_s")
        if ttft:
            lines.append(f"- {kind}, {engine}: TTFT p50 on/off {ttft:.2f}x, output tok/s on/off {tput:.3f}x")
        if step := ratio(engine, "decode_step_ms_p50"):
            lines.append(f"- {kind}, {engine}: decode step on/off {step:.3f}x")
    return lines


def run_all(args: argparse.Namespace, setup: Setup, load: Workload, models: dict, work: Path) -> dict:
    """{workload: {contender: [one result per repeat]}}, each contender in its own process."""
    runs: dict = {kind: {} for kind in args.workloads.split(",")}
    for repeat in range(args.repeats):
        for kind in runs:
            prompt_file = work / f"prefix-prompts-{kind}-{repeat}.json"
            prompt_file.write_text(json.dumps(prompts(kind, load, setup.model["vocab_size"], seed=repeat)))
            for name in args.contenders.split(","):
                result = run_contender(name, kind, args.quick, models[name.rsplit("-", 1)[0]], prompt_file)
                runs[kind].setdefault(name, []).append(result)
                summary = {k: round(v, 1) for k, v in result.items() if isinstance(v, float)}
                print(f"repeat {repeat} {kind:11s} {name:10s} {json.dumps(summary)}", flush=True)
    return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(p)
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    for name in ("--engine", "--model", "--prompts", "--out"):  # a contender's own process
        p.add_argument(name, help=argparse.SUPPRESS)
    args, setup = parse(p, argv)
    load = QUICK_LOAD if args.quick else FULL_LOAD
    if args.engine:
        result = run_engine(args.engine, args.model, setup, load, json.loads(Path(args.prompts).read_text()))
        Path(args.out).write_text(json.dumps(result))
        return 0
    args.contenders = args.contenders or ",".join(CONTENDERS)
    args.work.mkdir(parents=True, exist_ok=True)
    kinds = ("chunked", "paged") if "paged-" in args.contenders else ("chunked",)
    ckpt, folders, _ = exports(setup, args.work, kinds=kinds)
    models = {"native": ckpt, "ours": folders["chunked"], "paged": folders.get("paged")}
    runs = run_all(args, setup, load, models, args.work)
    date = datetime.date.today().isoformat()
    results = dict(date=date, machine=describe_host(), repeats=args.repeats, setup=describe(setup),
                   workload=asdict(load), runs=runs, copy_cost=copy_cost(folders["chunked"]))  # fmt: skip
    name = f"prefix-{date}-vm{'-quick' if args.quick else ''}{'-' + args.tag if args.tag else ''}"
    save(args.results, name, results, render(results).splitlines())
    return 0


if __name__ == "__main__":
    sys.exit(main())
