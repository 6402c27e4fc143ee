"""W3 long context and the decode roofline.

Per sequence length S (C=256): export a standard (CE) and a chunked (CP) model with one bucket
(S) in a child process (time, peak RSS), then time a prefill of S-1 tokens (the peak RSS it
adds) and a decode step at several contexts. The roofline divides the bytes a decode step reads
(weights + the batch's live KV) by its median time, against this machine's read stream.

    python benchmark/long_context.py [--lengths 1024,4096,8192] [--backend cpu] [--tag NAME]
    python benchmark/long_context.py --quick     # tiny model, eager backend, S=256: a smoke run
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from host import WORK, results_folder, save  # noqa: E402
from serve_bench import FULL, QUICK  # noqa: E402

from optimum_neuron_chunked.modeling.sampler import sampling_params  # noqa: E402
from optimum_neuron_chunked.testing.checkpoints import COMMON, build_checkpoint  # noqa: E402

BATCH = 4
GREEDY = (torch.tensor([sampling_params(temperature=0.0)] * BATCH), torch.zeros(BATCH))  # on-device sampling


@dataclass(frozen=True)
class Scale:
    model: dict  # the checkpoint's shapes (serve_bench's bench model)
    lengths: str  # the sequence lengths S (--lengths)
    backend: str  # (--backend)
    chunk: int  # C of the CP exports
    decode_calls: int  # a decode step's time: the median of this many calls
    stream_mib: int  # the buffer the machine's copy and read streams are measured on


FULL_SCALE = Scale(FULL.model, "1024,4096,8192", "cpu", chunk=256, decode_calls=30, stream_mib=1024)
QUICK_SCALE = Scale(QUICK.model, "256", "eager", chunk=64, decode_calls=5, stream_mib=64)


def child_peak(cmd: list[str]) -> tuple[float, float]:
    """Run cmd; (wall seconds, peak RSS MiB of its process tree)."""
    started, peak = time.perf_counter(), 0
    proc = psutil.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    while proc.poll() is None:
        try:
            peak = max(peak, sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)]))
        except psutil.Error:
            pass
        time.sleep(0.1)
    if proc.returncode:
        raise RuntimeError(proc.stderr.read().decode()[-2000:])
    return time.perf_counter() - started, peak / 2**20


def export_cmd(ckpt: Path, out: Path, seq: int, chunk: int, backend: str) -> list[str]:
    return [
        sys.executable, "-m", "optimum_neuron_chunked.export", "--model", str(ckpt), "--batch_size", str(BATCH),
        "--sequence_length", str(seq), "--prefill-chunk-size", str(chunk), "--context-buckets", str(seq),
        "--backend", backend, "--overwrite", str(out),
    ]  # fmt: skip


def run_figures(out: Path, decode_calls: int) -> dict:
    from optimum_neuron_chunked import NeuronModelForCausalLM
    from optimum_neuron_chunked.generation import prefill_prompt

    model = NeuronModelForCausalLM.from_pretrained(out)
    seq = model.neuron_config.sequence_length
    ids = torch.randint(4, 400, (seq - 1,))
    rss0 = psutil.Process().memory_info().rss
    with PeakSampler() as peak:
        started = time.perf_counter()
        prefill_prompt(model.runner, ids, (0,))
        prefill_s = time.perf_counter() - started
    prefill_extra_mib = (peak.rss - rss0) / 2**20
    decode, spread = {}, {}
    for ctx in sorted({seq // 8, seq // 2, seq - 2}):
        pos = torch.full((BATCH,), ctx)
        rows = (torch.full((BATCH,), 5), pos, torch.arange(BATCH)[:, None], GREEDY)
        model.runner.decode(*rows)  # warm
        times = []
        for _ in range(decode_calls):
            started = time.perf_counter()
            model.runner.decode(*rows)
            times.append(time.perf_counter() - started)
        decode[ctx], spread[ctx] = statistics.median(times), (min(times), max(times))
    hf = model.config
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    weights = (out / "model.safetensors").stat().st_size
    kv_per_token = 2 * hf.num_hidden_layers * hf.num_key_value_heads * head_dim * 4 * BATCH
    roofline = {ctx: (weights + kv_per_token * ctx) / t / 1e9 for ctx, t in decode.items()}
    return {
        "prefill_s": prefill_s,
        "prefill_extra_rss_mib": prefill_extra_mib,
        "decode_step_ms": {c: t * 1e3 for c, t in decode.items()},
        "decode_step_ms_spread": {c: [t * 1e3 for t in ts] for c, ts in spread.items()},
        "decode_gb_s": roofline,
    }


class PeakSampler:
    """Peak RSS of this process while the block runs, sampled every 10 ms from a child
    process (a compiled graph call may hold the GIL for the whole prefill): the transient
    score tensors of a prefill are freed before it returns."""

    WATCH = (
        "import select, sys, psutil\n"
        "p, peak = psutil.Process(int(sys.argv[1])), 0\n"
        "while not select.select([sys.stdin], [], [], 0.01)[0]:\n"
        "    peak = max(peak, p.memory_info().rss)\n"
        "print(peak)\n"
    )

    def __enter__(self):
        cmd = [sys.executable, "-c", self.WATCH, str(os.getpid())]
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        time.sleep(0.2)  # let it start sampling
        return self

    def __exit__(self, *exc):
        out, _ = self._proc.communicate("stop\n")
        self.rss = int(out.strip() or 0)


def copy_bandwidth_gb_s(mib: int) -> float:
    src = torch.empty(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    started = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    return 2 * src.numel() * 4 * 10 / (time.perf_counter() - started) / 1e9  # read + write


def read_bandwidth_gb_s(mib: int) -> float:
    """What a read-only stream reaches (a sum over `mib` MiB): the ceiling for a decode step,
    which reads weights and KV and writes next to nothing."""
    src = torch.ones(mib * 2**20 // 4)
    src.sum()
    started = time.perf_counter()
    for _ in range(5):
        src.sum()
    return src.numel() * 4 * 5 / (time.perf_counter() - started) / 1e9


def measure(args: argparse.Namespace, scale: Scale) -> list[dict]:
    """A CE and a CP export per sequence length: export cost, then run_figures."""
    config = {**COMMON, **scale.model, "max_position_embeddings": 8192}
    ckpt = build_checkpoint("bench", args.work / "checkpoint", config=config)
    rows = []
    for seq in [int(x) for x in (args.lengths or scale.lengths).split(",")]:
        for kind, chunk in (("CE", 0), ("CP", scale.chunk)):
            out = args.work / f"{kind}-{seq}-{args.backend}"
            export_s, export_peak = child_peak(export_cmd(ckpt, out, seq, chunk, args.backend))
            graphs = sum(f.stat().st_size for f in (out / "graphs").rglob("*")) / 2**20
            row = dict(seq=seq, graph=kind, export_s=export_s, export_peak_rss_mib=export_peak, graphs_mib=graphs)  # fmt: skip
            row |= run_figures(out, scale.decode_calls)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def write_report(args: argparse.Namespace, scale: Scale, rows: list[dict]) -> None:
    bandwidth, read = copy_bandwidth_gb_s(scale.stream_mib // 4), read_bandwidth_gb_s(scale.stream_mib)
    tag = f"{datetime.date.today()}-{platform.node()}{'-quick' if args.quick else ''}"
    tag += f"-{args.tag}" if args.tag else ""
    md = [f"# W3 long context ({args.backend}, B={BATCH}, C={scale.chunk}) {tag}", "",
          f"Machine copy bandwidth (read+write): {bandwidth:.1f} GB/s; read-only stream: {read:.1f} GB/s", "",
          f"Decode ms: the median [min-max] of {scale.decode_calls} calls. Decode GB/s: weights + the live KV of the batch, divided by the median step time; % of the read stream.", "",
          "| S | graph | export s | export peak RSS MiB | graphs MiB | prefill S-1 s | prefill peak +RSS MiB | decode ms (ctx) | decode GB/s (ctx) | % of read |",
          "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        spread = r["decode_step_ms_spread"]
        dec = ", ".join(f"{v:.1f} [{spread[c][0]:.1f}-{spread[c][1]:.1f}] ({c})" for c, v in r["decode_step_ms"].items())  # fmt: skip
        gbs = ", ".join(f"{v:.1f} ({c})" for c, v in r["decode_gb_s"].items())
        pct = ", ".join(f"{100 * v / read:.0f} ({c})" for c, v in r["decode_gb_s"].items())
        md.append(f"| {r['seq']} | {r['graph']} | {r['export_s']:.0f} | {r['export_peak_rss_mib']:.0f} | {r['graphs_mib']:.1f} "
                  f"| {r['prefill_s']:.2f} | {r['prefill_extra_rss_mib']:.0f} | {dec} | {gbs} | {pct} |")  # fmt: skip
    plot(rows, args.results / f"w3-{tag}-memory.png")
    md += ["", f"![memory and decode time](w3-{tag}-memory.png)"]
    save(args.results, f"w3-{tag}", {"rows": rows, "copy_gb_s": bandwidth, "read_gb_s": read}, md)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model and workload (a smoke run)")
    p.add_argument("--lengths", default=None, help=f"comma-separated S (default {FULL_SCALE.lengths})")
    p.add_argument(
        "--backend", default=None, help=f"default {FULL_SCALE.backend}, quick {QUICK_SCALE.backend}"
    )
    p.add_argument("--work", type=Path, default=WORK / "w3")
    p.add_argument("--results", type=Path, help="default benchmark/results (quick: a temporary folder)")
    p.add_argument("--tag", default="", help="suffix of the results files")
    args = p.parse_args(argv)
    scale = QUICK_SCALE if args.quick else FULL_SCALE
    args.backend = args.backend or scale.backend
    args.results = results_folder(args.results, smoke=args.quick)
    if args.quick:  # its own checkpoint: build_checkpoint keeps the one a folder holds
        args.work = args.work / "quick"
    write_report(args, scale, measure(args, scale))
    return 0


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for kind in ("CE", "CP"):
        rs = [r for r in rows if r["graph"] == kind]
        axes[0].plot([r["seq"] for r in rs], [r["export_peak_rss_mib"] for r in rs], "o-", label=kind)
        axes[1].plot([r["seq"] for r in rs], [r["prefill_extra_rss_mib"] for r in rs], "o-", label=kind)
        for r in rs:
            ctx = sorted(r["decode_step_ms"])
            style = "o-" if kind == "CE" else "s--"
            axes[2].plot(ctx, [r["decode_step_ms"][c] for c in ctx], style, label=f"{kind} S={r['seq']}")
    axes[0].set_title("export (compile) peak RSS, MiB")
    axes[1].set_title("peak RSS added by a prefill of S-1 tokens, MiB")
    axes[2].set_title(f"decode step ms ({BATCH} rows) vs context (one bucket = S)")
    for ax in axes:
        ax.set_xlabel("sequence length S" if ax is not axes[2] else "context length")
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
