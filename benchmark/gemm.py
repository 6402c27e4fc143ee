"""The linear layers of the bench model on this CPU: ATen `linear` (MKL sgemm), oneDNN on the
plain weight (what the cpu backend's chunk graphs call, layers.CpuLinear) and oneDNN with
prepacked weights (what vLLM's CPU engine dispatches to: `dispatch_cpu_unquantized_gemm`,
vllm/model_executor/layers/utils.py, vLLM 0.32), by rows M (8: a decode step, 64-256: a
chunk). fp32; median of repeats.

    python benchmark/gemm.py [--rows 8,64,256] [--repeats 200] [--tag NAME]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "tests"), str(HERE)]

from host import describe_host  # noqa: E402
from metrics import call_ms  # noqa: E402
from serve_bench import FULL  # noqa: E402

# (out, in) of the bench model's projections: q/o, k/v, gate/up, down
SHAPES = {
    "q, o": (FULL.model["hidden_size"], FULL.model["hidden_size"]),
    "gate, up": (FULL.model["intermediate_size"], FULL.model["hidden_size"]),
    "down": (FULL.model["hidden_size"], FULL.model["intermediate_size"]),
}


def median_us(fn, repeats: int) -> float:
    return statistics.median(call_ms(fn, repeats, warmup=10)) * 1e3


def measure(rows: int, out_features: int, in_features: int, repeats: int) -> dict:
    x, w = torch.randn(rows, in_features), torch.randn(out_features, in_features)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
    w_in_out = w.t().contiguous()  # the same weight stored [in, out]: sgemm without transposing B
    aten = median_us(lambda: torch.nn.functional.linear(x, w), repeats)
    aten_in_out = median_us(lambda: torch.mm(x, w_in_out), repeats)
    onednn = median_us(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), repeats)
    plain = median_us(lambda: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [None], ""), repeats)
    flops, weight_bytes = 2 * rows * out_features * in_features, w.numel() * 4
    return {"rows": rows, "aten_us": aten, "aten_in_out_us": aten_in_out, "onednn_us": onednn,
            "onednn_plain_us": plain,
            "aten_gflops": flops / aten / 1e3, "onednn_gflops": flops / onednn / 1e3,
            "aten_weight_gb_s": weight_bytes / aten / 1e3, "onednn_weight_gb_s": weight_bytes / onednn / 1e3}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="8,64,256")
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--tag", default="", help="suffix of the results files")
    args = p.parse_args(argv)
    results = {
        name: [measure(int(m), *shape, args.repeats) for m in args.rows.split(",")]
        for name, shape in SHAPES.items()
    }
    date = datetime.date.today().isoformat()
    lines = [f"# Linear layers, ATen (MKL) vs oneDNN ({date}, {describe_host()}, "
             f"{torch.get_num_threads()} threads)", "",
             "| layer [out, in] | M | ATen us (GFLOP/s, weight GB/s) | ATen, weight [in, out] us | oneDNN plain weight us | oneDNN prepacked us (GFLOP/s, weight GB/s) | prepacked / ATen |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, rows in results.items():
        for r in rows:
            lines.append(
                f"| {name} {list(SHAPES[name])} | {r['rows']} | {r['aten_us']:.0f} ({r['aten_gflops']:.0f}, "
                f"{r['aten_weight_gb_s']:.1f}) | {r['aten_in_out_us']:.0f} | {r['onednn_plain_us']:.0f} | {r['onednn_us']:.0f} ({r['onednn_gflops']:.0f}, "
                f"{r['onednn_weight_gb_s']:.1f}) | {r['onednn_us'] / r['aten_us']:.2f} |"
            )
    out = HERE / "results" / f"gemm-{date}-vm{'-' + args.tag if args.tag else ''}"
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
