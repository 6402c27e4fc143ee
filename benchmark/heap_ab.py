"""Process-wide settings, before/after: the cpu backend's `keep_freed_heap` (glibc's mmap and
trim thresholds) changes every allocation of the process, and its denormal flush (denormals.py)
every float operation of the calling threads, so the configurations cannot share one process
as ab_exports.py's do. Each configuration runs in its own process, in turn, for --rounds
rounds (the host drifts between runs minutes apart):

    python benchmark/heap_ab.py BEFORE_DIR AFTER_DIR [--rounds 3] [--calls 12] [--tag NAME]
    python benchmark/heap_ab.py EXPORT EXPORT --denormals [--tag denormals]

configurations: "before" = BEFORE_DIR with glibc's default heap, "after" = AFTER_DIR as the
cpu backend loads it (heap kept), "after, default heap" = AFTER_DIR with glibc's default.
--denormals: "as loaded" (flushed) against "denormals kept", both AFTER_DIR.
Each process times a full chunk ending at 512, 2048 and 4096 (CP calls, each on the next
slot; a standard export: whole prompts of 500, 2000 and 3072 tokens, CE calls) and a TG step
of 8 rows at W2-like contexts; medians per process, then the median and
spread over rounds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from metrics import call_ms, save_results, spread_cell  # noqa: E402

ENDS = (512, 2048, 4096)
PROMPTS = (500, 2000, 3072)  # a standard export's CE calls (buckets 512, 2048, 4096)
CONTEXTS = (1900, 300, 700, 1200, 150, 2000, 900, 400)
# name: (folder, keep the freed heap, flush denormals)
CONFIGS = {
    "before": ("before", False, True),
    "after": ("after", True, True),
    "after, default heap": ("after", False, True),
}
DENORMAL_CONFIGS = {"as loaded": ("after", True, True), "denormals kept": ("after", True, False)}


def measure(folder: Path, keep_heap: bool, flush: bool, calls: int) -> dict[str, float]:
    """One process's figures (ms, medians of `calls` after one untimed call each)."""
    import torch

    import optimum_neuron_chunked.backends.cpu as cpu
    import optimum_neuron_chunked.backends.cpu.denormals as denormals
    from optimum_neuron_chunked import NeuronModelForCausalLM

    if not keep_heap:
        cpu.keep_freed_heap = lambda: False
    if not flush:
        denormals.flush_denormals = lambda: None
    runner = NeuronModelForCausalLM.from_pretrained(folder).runner
    width, batch = runner.config.prefill_chunk_size, runner.config.batch_size
    ids = torch.randint(4, 1000, (max(PROMPTS),), generator=torch.Generator().manual_seed(0))
    figures, slot = {}, iter(range(10**6))
    for end in ENDS if width else PROMPTS:  # chunked: one full chunk ending there; standard: a prompt
        tokens, start = (ids[:width], end - width) if width else (ids[:end], 0)
        figures[f"cp_end{end}" if width else f"ce_{end}"] = call_ms(
            lambda t=tokens, s=start: runner.prefill(t, s, next(slot) % batch), calls
        )
    rows = len(CONTEXTS)  # a row decodes at its context length (what it reads; values do not matter)
    params, rand = torch.tensor([[1.0, 1.0, 1.0]] * rows), torch.zeros(rows)
    positions, tokens = torch.tensor(CONTEXTS), torch.ones(rows, dtype=torch.long)
    figures["tg_8_rows"] = call_ms(
        lambda: runner.decode(tokens, positions, torch.arange(rows), params, rand, need_logits=False), calls
    )
    return {name: statistics.median(times) for name, times in figures.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("before", type=Path)
    p.add_argument("after", type=Path)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=12)
    p.add_argument("--denormals", action="store_true", help="denormals flushed against kept")
    p.add_argument("--tag", default="")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)  # FOLDER KEEP_HEAP FLUSH (0/1)
    args = p.parse_args(argv)
    if args.child:
        folder, keep, flush = args.child
        print(json.dumps(measure(Path(folder), keep == "1", flush == "1", args.calls)))
        return 0
    folders = {"before": args.before, "after": args.after}
    configs = DENORMAL_CONFIGS if args.denormals else CONFIGS
    runs = {name: [] for name in configs}
    for _ in range(args.rounds):
        for name, (folder, keep, flush) in configs.items():
            cmd = [sys.executable, __file__, "x", "x", "--calls", str(args.calls), "--child",
                   str(folders[folder]), str(int(keep)), str(int(flush))]  # fmt: skip
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            runs[name].append(json.loads(out.strip().splitlines()[-1]))
    keys = list(next(iter(runs.values()))[0])
    date = datetime.date.today().isoformat()
    title = "Denormals flushed or kept" if args.denormals else "Heap settings, before/after"
    lines = [f"# {title} ({date}, {platform.node()})", "",
             f"before: `{args.before.name}`", f"after: `{args.after.name}`", "",
             f"ms, median [min-max] over {args.rounds} processes per configuration (each the median of "
             f"{args.calls} calls).", "", "| configuration | " + " | ".join(keys) + " |",
             "|---|" + "---|" * len(keys)]  # fmt: skip
    for name, results in runs.items():
        cells = [[r[k] for r in results] for k in keys]
        lines.append(f"| {name} | " + " | ".join(spread_cell(c) for c in cells) + " |")
    out = HERE / "results" / f"heap-{date}-vm{'-' + args.tag if args.tag else ''}"
    save_results(out, {"folders": [str(args.before), str(args.after)], "runs": runs}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
