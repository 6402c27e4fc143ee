"""MoE expert cost: the selected experts gathered per token vs every expert run densely.

One sparse MLP layer (modeling/moe.py) at two scaled shapes, eager torch on this machine's
CPU, for the token counts a decode step (M = batch rows) and a prefill chunk (M = C) give.
Prints the median ms (and min-max over repeats) of each strategy and which one the graphs'
static rule picks (`MoeSpec.selects_experts` with Backend.kernels(config).expert_selection: 1.0 is
neuronx-distributed's selective-loading threshold, used by eager/neuron; the cpu backend's
fraction is set from this benchmark). Writes benchmark/results/moe-<date>-<host>.{json,md}.

    python benchmark/moe_experts.py [--repeats 15]
    python benchmark/moe_experts.py --render benchmark/results/moe-<date>-<host>.json
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

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent)]

from metrics import call_ms  # noqa: E402

from optimum_neuron_chunked.backends import get_backend  # noqa: E402
from optimum_neuron_chunked.config import NeuronConfig  # noqa: E402
from optimum_neuron_chunked.modeling.moe import MoeSpec, SparseMoE  # noqa: E402
from optimum_neuron_chunked.modeling.parallel import TorchLayers  # noqa: E402

# (name, hidden, expert intermediate, experts, top_k): Qwen3-30B-A3B's routing (128 experts,
# top-8) and Mixtral's (8, top-2) at a width this machine holds in fp32 (one layer).
SHAPES = [("qwen3-moe-like", 1024, 384, 128, 8), ("mixtral-like", 1024, 1792, 8, 2)]
TOKENS = [1, 2, 4, 8, 16, 64, 128, 256]


def time_ms(fn, repeats: int) -> list[float]:
    return call_ms(fn, repeats)


def measure(hidden: int, inter: int, experts: int, top_k: int, tokens: int, repeats: int) -> dict:
    spec = MoeSpec(experts, top_k, inter, (True,), normalize_top_k=True)
    moe = SparseMoE(hidden, spec, TorchLayers()).eval()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.02)
    x = torch.randn(tokens, hidden)
    with torch.inference_mode():
        weights, chosen = moe.router(x)
        selected = time_ms(lambda: (moe.experts.selected(x, chosen) * weights[..., None]).sum(1), repeats)
        every = time_ms(lambda: moe.experts.every(x), repeats)
    row = dict(tokens=tokens, selected_ms=statistics.median(selected), every_ms=statistics.median(every))
    row |= dict(
        selected_spread=[round(min(selected), 2), round(max(selected), 2)],
        every_spread=[round(min(every), 2), round(max(every), 2)],
    )
    row["faster"] = "selected" if row["selected_ms"] < row["every_ms"] else "every"
    return row


def picks(row: dict, backend: str) -> str:
    spec = MoeSpec(row["experts"], row["top_k"], row["intermediate"], (True,), normalize_top_k=True)
    fraction = get_backend(backend).kernels(NeuronConfig(batch_size=1, sequence_length=64)).expert_selection
    return "selected" if spec.selects_experts(row["tokens"], fraction) else "every"


def render(stamp: str, meta: dict, rows: list[dict]) -> str:
    lines = [
        f"# MoE experts: selected vs every ({stamp})",
        "",
        f"`{json.dumps(meta)}` - one sparse layer, eager, median ms [min-max]",
        "",
        "| shape (E, k) | tokens | selected ms | every ms | faster | NxD rule (eager, neuron) | cpu rule |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['shape']} ({r['experts']}, {r['top_k']}) | {r['tokens']} | {r['selected_ms']:.2f} "
        f"{r['selected_spread']} | {r['every_ms']:.2f} {r['every_spread']} | {r['faster']} | "
        f"{picks(r, 'neuron')} | {picks(r, 'cpu')} |"
        for r in rows
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--render", type=Path, help="re-render the markdown of a saved JSON result")
    args = parser.parse_args()
    if args.render:
        saved = json.loads(args.render.read_text())
        text = render(args.render.stem, saved["meta"], saved["rows"])
        args.render.with_suffix(".md").write_text(text)
        print(text)
        return 0
    torch.manual_seed(0)
    results = []
    for name, hidden, inter, experts, top_k in SHAPES:
        for tokens in TOKENS:
            row = dict(shape=name, hidden=hidden, intermediate=inter, experts=experts, top_k=top_k)
            row |= measure(hidden, inter, experts, top_k, tokens, args.repeats)
            print(row, flush=True)
            results.append(row)
    stamp = f"moe-{datetime.date.today()}-{platform.node()}"
    out = REPO / "benchmark" / "results"
    meta = dict(
        repeats=args.repeats, threads=torch.get_num_threads(), dtype="float32", torch=torch.__version__
    )
    (out / f"{stamp}.json").write_text(json.dumps(dict(meta=meta, rows=results), indent=2))
    text = render(stamp, meta, results)
    (out / f"{stamp}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
