"""The decode attention op (backends/cpu/decode_attention.cpp) against the same op built from the
source of another git revision. An export's TG graphs call the op by name, so its source can
change under an export: this compares the two sources on the same shapes.

    python benchmark/decode_op.py --before REV [--contexts 500,510,505,512 ...] [--calls 40] [--tag NAME]
    python benchmark/decode_op.py --before REV --export DIR [--rounds 3] [--calls 30] [--tag NAME]

Without --export: both ops in one process, calls interleaved, each call one decode step's 8
layers over 8 layers' own caches (the bench model's shapes: no reuse of the K/V in L3).
With --export: TG calls of that export (ab_exports.interleaved_decode_ms), the two sources in
alternating processes (one process registers one op under the graphs' name), --rounds each.
--contexts: one step per argument, the rows' context lengths comma-separated.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from metrics import interleaved_ms, save_results, spread_cell  # noqa: E402

from optimum_neuron_chunked.backends.cpu import decode_attention, keep_freed_heap  # noqa: E402
from optimum_neuron_chunked.backends.cpu.extension import build_op_library  # noqa: E402
from optimum_neuron_chunked.backends.cpu.host import host_cpu_capability  # noqa: E402

SOURCE = "optimum_neuron_chunked/backends/cpu/decode_attention.cpp"
NAMESPACE = "optimum_neuron_chunked"
DEFAULT_CONTEXTS = ["500,510,505,512", "4094,4094,4094,4094", "2100,1500,900,400,200,1200,700,300"]
# the bench model (serve_bench.FULL): 8 layers, 8 query heads over 4 KV heads of 64, 8 slots of 4096
LAYERS, SLOTS, KV_HEADS, SEQ, HEAD_DIM, HEADS = 8, 8, 4, 4096, 64, 8


def load_before(rev: str, namespace: str) -> None:
    """Build the op from `rev`'s source, registered as `namespace`::decode_attention."""
    source = subprocess.run(
        ["git", "show", f"{rev}:{SOURCE}"], cwd=HERE.parent, check=True, capture_output=True, text=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "decode_attention_before.cpp"
    path.write_text(source.replace(f"({NAMESPACE},", f"({namespace},"))
    isa = host_cpu_capability()
    build_op_library(
        f"onc_decode_attention_before_{namespace}_{isa.lower()}",
        path,
        decode_attention.compile_flags(isa),
        decode_attention.LINK_FLAGS,
    )


def op_steps_ms(rev: str, contexts: list[list[int]], calls: int) -> list[dict[str, list[float]]]:
    keep_freed_heap()
    decode_attention.load_op()
    load_before(rev, "onc_before")
    ops = {
        "before": torch.ops.onc_before.decode_attention,
        "after": torch.ops.optimum_neuron_chunked.decode_attention,
    }
    shape = (SLOTS, KV_HEADS, SEQ, HEAD_DIM)
    keys, values = [torch.randn(shape) for _ in range(LAYERS)], [torch.randn(shape) for _ in range(LAYERS)]
    times = []
    for rows in contexts:
        query = torch.randn(len(rows), HEADS, HEAD_DIM)
        slots, lengths = torch.arange(len(rows)), torch.tensor(rows)
        args = [(query, k, v, slots, lengths, 0.125) for k, v in zip(keys, values, strict=True)]
        torch.testing.assert_close(ops["before"](*args[0]), ops["after"](*args[0]))
        steps = {name: lambda _i, op=op, args=args: [op(*a) for a in args] for name, op in ops.items()}
        times.append(interleaved_ms(steps, calls))
    return times


def export_child(which: str, rev: str, export: Path, contexts: list[list[int]], calls: int) -> None:
    """One process: TG calls with the op of `which` ("before": rev's source under the graphs' name)."""
    if which == "before":
        load_before(rev, NAMESPACE)
        torch.library.register_fake(f"{NAMESPACE}::decode_attention")(decode_attention._shape)
    from ab_exports import interleaved_decode_ms

    print(json.dumps([interleaved_decode_ms({which: export}, calls, c)[which] for c in contexts]))


def export_steps_ms(rev: str, export: Path, contexts: list[list[int]], calls: int, rounds: int) -> list[dict]:
    times = [{"before": [], "after": []} for _ in contexts]
    spec = [",".join(map(str, c)) for c in contexts]
    for _ in range(rounds):
        for which in ("before", "after"):
            argv = [sys.executable, __file__, "--before", rev, "--export", str(export), "--child", which]
            out = subprocess.run(
                [*argv, "--calls", str(calls), "--contexts", *spec],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            for t, ms in zip(times, json.loads(out.splitlines()[-1]), strict=True):
                t[which] += ms
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", required=True, help="git revision whose decode_attention.cpp is 'before'")
    p.add_argument("--contexts", nargs="+", default=DEFAULT_CONTEXTS)
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--export", type=Path, help="time TG calls of this export, in alternating processes")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--child", choices=("before", "after"), help=argparse.SUPPRESS)
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    contexts = [[int(n) for n in c.split(",")] for c in args.contexts]
    if args.child:
        export_child(args.child, args.before, args.export, contexts, args.calls)
        return 0
    if args.export:
        times = export_steps_ms(args.before, args.export, contexts, args.calls, args.rounds)
        what = (
            f"TG calls of `{args.export.name}`, {args.rounds} processes per source, {args.calls} calls each"
        )
    else:
        times = op_steps_ms(args.before, contexts, args.calls)
        what = f"the op over {LAYERS} layers' caches per call, interleaved, {args.calls} calls each"
    date = datetime.date.today().isoformat()
    lines = [f"# Decode op: {args.before} vs the working tree ({date}, {platform.node()})", "", f"{what}.", "",
             "| rows x context | before ms | after ms | after / before |", "|---|---|---|---|"]  # fmt: skip
    for c, t in zip(contexts, times, strict=True):
        ratio = statistics.median(t["after"]) / statistics.median(t["before"])
        lines.append(
            f"| {len(c)} x {min(c)}-{max(c)} | {spread_cell(t['before'])} | {spread_cell(t['after'])} | {ratio:.3f} |"
        )
    out = HERE / "results" / f"decode-op-{date}-vm{'-' + args.tag if args.tag else ''}"
    save_results(
        out,
        {"before": args.before, "contexts": contexts, "export": str(args.export or ""), "ms": times},
        lines,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
