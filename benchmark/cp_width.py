"""What a CP call costs by its width (the chunk size it was compiled for), at one window:
the case for narrower CP graphs for short chunks (a prompt's last chunk, a prefix hit's
suffix), which today run padded to C. Serving benchmark's model, cpu backend, fp32.

Each width is exported with one context bucket (the window) and its CP graph timed with the
chunk ending at the window's last position. Exports are cached under --work.

    python benchmark/cp_width.py [--widths 64,128,256] [--window 4096] [--repeats 7]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(HERE)]

from fixtures.export_models import code_key  # noqa: E402
from metrics import call_ms  # noqa: E402
from serve_bench import FULL  # noqa: E402

from optimum_neuron_chunked.checkpoints import COMMON, build_checkpoint  # noqa: E402


def time_width(ckpt: Path, work: Path, width: int, window: int, repeats: int) -> list[float]:
    from exporters.neuron import export
    from optimum_neuron_chunked import NeuronModelForCausalLM

    out = work / f"cpw-{FULL.batch}x{window}x{width}-{FULL.backend}-{code_key()}"
    if not (out / "neuron_config.json").is_file():
        export(str(ckpt), out, batch_size=FULL.batch, sequence_length=window, prefill_chunk_size=width,
               backend=FULL.backend, context_buckets=(window,), overwrite=True)  # fmt: skip
    model = NeuronModelForCausalLM.from_pretrained(out)
    ids = torch.randint(4, FULL.model["vocab_size"], (width,))
    return call_ms(lambda: model.runner.prefill(ids, window - width, 0), repeats)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--widths", default="64,128,256")
    p.add_argument("--window", type=int, default=FULL.seq)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument(
        "--work", type=Path, default=Path.home() / ".cache" / "optimum-neuron-chunked" / "bench" / "full"
    )
    args = p.parse_args(argv)
    ckpt = build_checkpoint("bench", args.work / "checkpoint", config={**COMMON, **FULL.model})
    rows = {}
    for width in (int(w) for w in args.widths.split(",")):
        t = time_width(ckpt, args.work, width, args.window, args.repeats)
        rows[width] = [statistics.median(t), min(t), max(t)]
        print(f"cp width {width} at w{args.window}: {rows[width][0]:.1f} ms", flush=True)
    date = datetime.date.today().isoformat()
    lines = [f"# CP call cost by width, window {args.window} ({date}, {platform.node()})", "",
             f"Model {FULL.model}, fp32, {FULL.backend}; median [min-max] of {args.repeats} calls.", "",
             "| width | ms per call | ms per token |", "|---|---|---|"]  # fmt: skip
    for width, (med, lo, hi) in rows.items():
        lines.append(f"| {width} | {med:.1f} [{lo:.1f}-{hi:.1f}] | {med / width:.2f} |")
    name = HERE / "results" / f"cp-width-{date}-vm-w{args.window}"
    name.with_suffix(".json").write_text(json.dumps({"window": args.window, "ms": rows}, indent=1))
    name.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
