"""CP, CE and TG graph time on the cpu backend (AOTInductor) with each attention core: the
masked softmax (what eager/XLA/Neuron run), SDPA, and for prefill graphs the oneDNN custom op
(chunk_attention); sets backends/cpu/kernels.py's sdpa_prefill_from_window (CP, CE),
sdpa_decode_from_window (TG) and onednn_chunk_attention_from_window.
Serving benchmark's model (serve_bench.FULL), fp32, this machine's CPU. Every other kernel
choice is the cpu backend's (live window, slot views, per-row decode, rowwise linears).

Each graph is compiled once per core; the two are called in turn (this machine drifts by
20-30 % within minutes, so separate runs cannot show a 10 % difference). A chunk of C tokens
ends at --end, a CE prompt holds --end tokens (default: the window); decode rows sit at
--decode contexts (default: every row at the window's last position). Prints the median ms [min-max] per call and writes
benchmark/results/attention-<date>-<host>[-tag].{json,md}.

    python benchmark/attention_kernel.py [--windows 512,4096] [--kinds cp,ce,tg] [--end 512]
                                         [--decode 150,...] [--cores masked_softmax,sdpa,onednn_op]
                                         [--repeats 7] [--tag NAME]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(REPO), str(HERE)]

from host import describe_host  # noqa: E402
from metrics import interleaved_ms, spread_cell  # noqa: E402
from serve_bench import FULL  # noqa: E402

from optimum_neuron_chunked.backends.cpu import keep_freed_heap  # noqa: E402
from optimum_neuron_chunked.backends.cpu.kernels import CpuKernels, kernel_choices  # noqa: E402
from optimum_neuron_chunked.config import NeuronConfig  # noqa: E402
from optimum_neuron_chunked.graphs import GraphSpec, example_inputs, graph_module  # noqa: E402
from optimum_neuron_chunked.modeling import family_spec, model_from_spec  # noqa: E402
from optimum_neuron_chunked.testing.checkpoints import COMMON, build_checkpoint  # noqa: E402

NO_OP = dict(onednn_chunk_attention_from_window=None)
KERNELS = {
    "masked_softmax": replace(
        kernel_choices(), sdpa_prefill_from_window=None, sdpa_decode_from_window=None, **NO_OP
    ),
    "sdpa": replace(kernel_choices(), sdpa_prefill_from_window=1, sdpa_decode_from_window=1, **NO_OP),
    # decode graphs never call the op: their TG time is SDPA's
    "onednn_op": replace(
        kernel_choices(),
        sdpa_prefill_from_window=1,
        sdpa_decode_from_window=1,
        onednn_chunk_attention_from_window=1,
    ),
}


def compiled_call(
    kernel: str, kind: str, window: int, work: Path, end: int | None, contexts: list[int] | None
):
    from transformers import AutoConfig, AutoModelForCausalLM

    ckpt = build_checkpoint("bench", work / "checkpoint", config={**COMMON, **FULL.model})
    config = NeuronConfig(
        batch_size=FULL.batch,
        sequence_length=FULL.seq,
        prefill_chunk_size=0 if kind == "ce" else FULL.chunk,
        context_buckets=(window, FULL.seq) if window < FULL.seq else (FULL.seq,),
        backend="cpu",
    )
    family = family_spec(AutoConfig.from_pretrained(ckpt))
    model = model_from_spec(family, config, kernels=CpuKernels(KERNELS[kernel]))
    model.load_weights(model.weights_from_hf(AutoModelForCausalLM.from_pretrained(ckpt)))
    spec = {
        "cp": GraphSpec("cp", 1, FULL.chunk, window),
        "ce": GraphSpec("ce", 1, window, window),
        "tg": GraphSpec("tg", FULL.batch, 1, window),
    }[kind]
    with torch.no_grad():
        program = torch.export.export(graph_module(model.eval(), spec, config), example_inputs(spec, config))
        package = torch._inductor.aoti_compile_and_package(
            program, package_path=str(work / f"{kernel}-{spec.name}.pt2")
        )
    graph = torch._inductor.aoti_load_package(package)
    inputs = list(example_inputs(spec, config))
    if kind == "cp":
        last = end or window
        inputs[1] = torch.arange(last - FULL.chunk, last, dtype=inputs[1].dtype)[None]
    elif kind == "ce":  # a prompt of `end` tokens, padded to the bucket by repeating the last
        last = end or window
        inputs[1] = torch.arange(window, dtype=inputs[1].dtype).clamp(max=last - 1)[None]
    else:
        rows = contexts or [window] * FULL.batch
        inputs[1] = (torch.tensor(rows + rows[-1:] * (FULL.batch - len(rows))) - 1)[:, None].to(
            inputs[1].dtype
        )
    return lambda _round: graph(*inputs)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--windows", default="512,4096")
    parser.add_argument(
        "--end", type=int, default=None, help="the chunk's end position (default: the window)"
    )
    parser.add_argument("--decode", default=None, help="decode rows' context lengths, comma-separated")
    parser.add_argument("--kinds", default="cp,tg")
    parser.add_argument("--cores", default="masked_softmax,sdpa", help=f"of {','.join(KERNELS)}")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    keep_freed_heap()  # as CpuBackend.load does: the process a cpu export runs in
    contexts = [int(n) for n in args.decode.split(",")] if args.decode else None
    cores = args.cores.split(",")
    rows = []
    with tempfile.TemporaryDirectory(prefix="attention-") as tmp:
        for window in [int(w) for w in args.windows.split(",")]:
            for kind in args.kinds.split(","):
                calls = {k: compiled_call(k, kind, window, Path(tmp), args.end, contexts) for k in cores}
                row = dict(kind=kind, window=window, end=args.end, decode=contexts)
                for kernel, times in interleaved_ms(calls, args.repeats, warmup=2).items():
                    row[kernel] = dict(median_ms=statistics.median(times), ms=times)
                print(row, flush=True)
                rows.append(row)
    meta = dict(
        model=FULL.model,
        batch=FULL.batch,
        chunk=FULL.chunk,
        repeats=args.repeats,
        torch=torch.__version__,
        host=describe_host(),
    )
    stamp = f"attention-{datetime.date.today()}-{platform.node()}{'-' + args.tag if args.tag else ''}"
    lines = [
        f"# Attention core on the cpu backend ({stamp})",
        "",
        f"`{json.dumps(meta)}` - ms per graph call, median [min-max]",
        "",
        f"Chunk end: {args.end or 'the window'}; decode contexts: {contexts or 'every row at the window'}.",
        "",
        f"| graph | window | {' | '.join(cores)} | time / {cores[0]}'s |",
        "|---|---|" + "---|" * (len(cores) + 1),
    ]
    for r in rows:
        size = {"cp": FULL.chunk, "ce": r["window"], "tg": FULL.batch}[r["kind"]]
        cells = [spread_cell(r[c]["ms"]) for c in cores]
        ratios = ", ".join(f"{r[c]['median_ms'] / r[cores[0]]['median_ms']:.2f}x" for c in cores[1:])
        lines.append(
            f"| {r['kind']} ({size} {'rows' if r['kind'] == 'tg' else 'tokens'}) | {r['window']} | "
            + " | ".join(cells)
            + f" | {ratios} |"
        )
    out = REPO / "benchmark" / "results"
    (out / f"{stamp}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=2))
    (out / f"{stamp}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
