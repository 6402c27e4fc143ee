"""CP and TG graph time on the cpu backend (AOTInductor) with each attention core: the masked
softmax (what eager/XLA/Neuron run) vs SDPA; sets modeling/kernels.py's sdpa_from_window. Serving benchmark's model (serve_bench.FULL), fp32, this machine's CPU.

Each graph is compiled once per kernel and called with its live context filling the window
(a chunk ending at the window's last position; every decode row at window - 2). Prints the
median ms [min-max] per call and writes benchmark/results/attention-<date>-<host>.{json,md}.

    python benchmark/attention_kernel.py [--windows 512,4096] [--repeats 7]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(REPO), str(HERE)]

from metrics import call_ms  # noqa: E402
from serve_bench import FULL  # noqa: E402

from optimum_neuron_chunked.checkpoints import COMMON, build_checkpoint  # noqa: E402
from optimum_neuron_chunked.config import NeuronConfig  # noqa: E402
from optimum_neuron_chunked.graphs import GraphSpec, example_inputs, graph_module  # noqa: E402
from optimum_neuron_chunked.modeling import family_spec, model_from_spec  # noqa: E402
from optimum_neuron_chunked.modeling.kernels import KernelChoices  # noqa: E402

KERNELS = {"masked_softmax": KernelChoices(), "sdpa": KernelChoices(sdpa_from_window=1)}


def compiled_call(kernel: str, kind: str, window: int, work: Path):
    from transformers import AutoConfig, AutoModelForCausalLM

    ckpt = build_checkpoint("bench", work / "checkpoint", config={**COMMON, **FULL.model})
    config = NeuronConfig(
        batch_size=FULL.batch,
        sequence_length=FULL.seq,
        prefill_chunk_size=FULL.chunk,
        context_buckets=(window, FULL.seq) if window < FULL.seq else (FULL.seq,),
        backend="cpu",
    )
    family = family_spec(AutoConfig.from_pretrained(ckpt))
    model = model_from_spec(family, config, kernels=KERNELS[kernel])
    model.load_weights(model.weights_from_hf(AutoModelForCausalLM.from_pretrained(ckpt)))
    spec = GraphSpec("cp", 1, FULL.chunk, window) if kind == "cp" else GraphSpec("tg", FULL.batch, 1, window)
    with torch.no_grad():
        program = torch.export.export(graph_module(model.eval(), spec, config), example_inputs(spec, config))
        package = torch._inductor.aoti_compile_and_package(
            program, package_path=str(work / f"{kernel}-{spec.name}.pt2")
        )
    graph = torch._inductor.aoti_load_package(package)
    inputs = list(example_inputs(spec, config))
    if kind == "cp":
        inputs[1] = torch.arange(window - FULL.chunk, window, dtype=inputs[1].dtype)[None]
    else:
        inputs[1] = torch.full_like(inputs[1], window - 2)
    return lambda: graph(*inputs)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--windows", default="512,4096")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="attention-") as tmp:
        for window in [int(w) for w in args.windows.split(",")]:
            for kind in ("cp", "tg"):
                row = dict(kind=kind, window=window)
                for kernel in KERNELS:
                    times = call_ms(compiled_call(kernel, kind, window, Path(tmp)), args.repeats, warmup=2)
                    row[kernel] = dict(median_ms=statistics.median(times), spread=[min(times), max(times)])
                row["speedup"] = row["masked_softmax"]["median_ms"] / row["sdpa"]["median_ms"]
                print(row, flush=True)
                rows.append(row)
    meta = dict(
        model=FULL.model, batch=FULL.batch, chunk=FULL.chunk, repeats=args.repeats, torch=torch.__version__
    )
    stamp = f"attention-{datetime.date.today()}-{platform.node()}"
    lines = [
        f"# Attention core on the cpu backend ({stamp})",
        "",
        f"`{json.dumps(meta)}` - ms per graph call, median [min-max]",
        "",
        "| graph | window | masked softmax | SDPA | speedup |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        m, s = r["masked_softmax"], r["sdpa"]
        lines.append(
            f"| {r['kind']} ({FULL.chunk if r['kind'] == 'cp' else FULL.batch} "
            f"{'tokens' if r['kind'] == 'cp' else 'rows'}) | {r['window']} | {m['median_ms']:.1f} "
            f"[{m['spread'][0]:.1f}-{m['spread'][1]:.1f}] | {s['median_ms']:.1f} "
            f"[{s['spread'][0]:.1f}-{s['spread'][1]:.1f}] | {r['speedup']:.2f}x |"
        )
    out = REPO / "benchmark" / "results"
    (out / f"{stamp}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=2))
    (out / f"{stamp}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
