"""Where a decode step's time goes: torch.profiler over one TG graph (eager, the same ops
AOTInductor compiles) of the serving benchmark's model, B rows at several context buckets.

    python benchmark/profile_decode.py [--windows 1024,4096] [--batch 8]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(REPO), str(HERE)]

from serve_bench import FULL  # noqa: E402

from optimum_neuron_chunked.config import NeuronConfig  # noqa: E402
from optimum_neuron_chunked.graphs import GraphSpec, example_inputs, graph_module  # noqa: E402
from optimum_neuron_chunked.modeling import build_model  # noqa: E402
from optimum_neuron_chunked.testing.checkpoints import COMMON, build_checkpoint  # noqa: E402

TOP = 12


def tg_step(window: int, batch: int, work: Path):
    from transformers import AutoConfig, AutoModelForCausalLM

    ckpt = build_checkpoint("bench", work / "checkpoint", config={**COMMON, **FULL.model})
    config = NeuronConfig(
        batch_size=batch, sequence_length=window, context_buckets=(window,), backend="eager"
    )
    model = build_model(AutoConfig.from_pretrained(ckpt), config)
    model.load_weights(model.weights_from_hf(AutoModelForCausalLM.from_pretrained(ckpt)))
    spec = GraphSpec("tg", batch, 1, window)
    graph = graph_module(model.eval(), spec, config)
    ids, _, seq_ids, params, rand = example_inputs(spec, config)
    positions = torch.full((batch, 1), window - 2)
    return lambda: graph(ids, positions, seq_ids, params, rand)


def profile_window(window: int, batch: int, work: Path) -> dict:
    step = tg_step(window, batch, work)
    with torch.no_grad():
        for _ in range(3):
            step()
        started = time.perf_counter()
        for _ in range(5):
            step()
        step_ms = (time.perf_counter() - started) / 5 * 1e3
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                step()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    top = [
        {"op": e.key, "calls": e.count // 5, "self_ms": e.self_cpu_time_total / 5e3,
         "share": e.self_cpu_time_total / total}
        for e in events[:TOP]
    ]  # fmt: skip
    return {"window": window, "batch": batch, "step_ms": step_ms, "top": top}


def markdown(results: list[dict], tag: str) -> str:
    lines = [f"# profile_decode {tag}", "", f"Model {FULL.model}; one TG step, eager, torch.profiler.", ""]
    for r in results:
        lines += [
            f"## B={r['batch']}, window {r['window']}: {r['step_ms']:.1f} ms a step (unprofiled)",
            "",
            "| op | calls/step | self ms/step | share |",
            "|---|---|---|---|",
        ]
        lines += [f"| `{t['op']}` | {t['calls']} | {t['self_ms']:.2f} | {t['share']:.0%} |" for t in r["top"]]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--windows", default="1024,4096")
    parser.add_argument("--batch", type=int, default=FULL.batch)
    parser.add_argument(
        "--work", type=Path, default=Path.home() / ".cache" / "optimum-neuron-chunked" / "bench"
    )
    parser.add_argument("--results", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    results = [profile_window(int(w), args.batch, args.work) for w in args.windows.split(",")]
    tag = f"{datetime.date.today()}-{platform.node()}"
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / f"profile-{tag}.json").write_text(json.dumps(results, indent=1))
    text = markdown(results, tag)
    (args.results / f"profile-{tag}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
