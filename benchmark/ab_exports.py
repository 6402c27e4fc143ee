"""Before/after of graph code on the same shapes: CP calls of two exports, interleaved in one
process (this machine's speed drifts by 20-30 % between runs minutes apart, so separate runs
cannot show a 5-10 % change). An export keeps the graphs it was compiled with, so the
"before" folder is one exported by the older code (benchmark exports are keyed by it).

    python benchmark/ab_exports.py BEFORE_DIR AFTER_DIR [--calls 16] [--tokens T] [--end P] [--tag NAME]

--tokens: the chunk's real tokens (default the chunk size); --end: the position after its last
token (default the sequence length: the largest bucket, read whole).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent)]

from optimum_neuron_chunked import NeuronModelForCausalLM  # noqa: E402


def interleaved_ms(
    folders: dict[str, Path], calls: int, tokens: int | None = None, end: int | None = None
) -> dict[str, list[float]]:
    """One chunk of `tokens` ending before position `end`, each export in turn, each call on
    the next slot; the first round is untimed (lazy init)."""
    models = {name: NeuronModelForCausalLM.from_pretrained(f) for name, f in folders.items()}
    configs = (
        {m.neuron_config.prefill_chunk_size for m in models.values()},
        {m.neuron_config.sequence_length for m in models.values()},
    )
    if any(len(c) != 1 for c in configs):
        raise SystemExit(f"the exports differ in shape (chunk sizes, lengths): {configs}")
    width, seq = (c.pop() for c in configs)
    batch = min(m.neuron_config.batch_size for m in models.values())
    tokens, end = tokens or width, end or seq
    ids = torch.randint(4, 1000, (tokens,), generator=torch.Generator().manual_seed(0))
    times = {name: [] for name in models}
    for i in range(calls + 1):
        for name, model in models.items():
            started = time.perf_counter()
            model.runner.prefill(ids, end - tokens, i % batch)
            if i:
                times[name].append((time.perf_counter() - started) * 1000)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("before", type=Path)
    p.add_argument("after", type=Path)
    p.add_argument("--calls", type=int, default=16)
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--end", type=int, default=None)
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    times = interleaved_ms({"before": args.before, "after": args.after}, args.calls, args.tokens, args.end)
    date = datetime.date.today().isoformat()
    lines = [f"# CP calls, two exports interleaved ({date}, {platform.node()})", "",
             f"before: `{args.before.name}`", f"after: `{args.after.name}`", "",
             f"A chunk of {args.tokens or 'C'} tokens ending at position {args.end or 'S'}; "
             f"median [min-max] of {args.calls} calls each.", "", "| export | ms per call |", "|---|---|"]  # fmt: skip
    for name, t in times.items():
        lines.append(f"| {name} | {statistics.median(t):.1f} [{min(t):.1f}-{max(t):.1f}] |")
    ratio = statistics.median(times["after"]) / statistics.median(times["before"])
    lines += ["", f"after / before: {ratio:.3f}"]
    out = HERE / "results" / f"ab-{date}-vm{'-' + args.tag if args.tag else ''}"
    out.with_suffix(".json").write_text(
        json.dumps({"folders": [str(args.before), str(args.after)], "ms": times})
    )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
