"""Verify calls against decode calls on an accelerator proxy: the neuron backend's graphs (the
reference kernels, what neuronx-cc receives) replayed as CUDA graphs, where a decode step is
bound by reading the weights, as on Neuron. Llama-3.1-8B dims, random bf16 weights, B rows:
a TG call (1 token a row) and a VF call (K + 1 tokens a row) per context bucket, the rows'
contexts ending near the bucket's end. Prints and saves the median of the replays.

    python benchmark/verify_proxy.py [--rows 8] [--speculation-length 4] [--buckets 512,1024,2048,8192]
    python benchmark/verify_proxy.py --tiny --device cpu     # a smoke run of the harness
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
sys.path.insert(0, str(HERE.parent))

from optimum_neuron_chunked.config import NeuronConfig  # noqa: E402
from optimum_neuron_chunked.graphs import (  # noqa: E402
    INDEX_DTYPE,
    GraphSpec,
    example_inputs,
    graph_module,
    tg_spec,
    vf_spec,
)
from optimum_neuron_chunked.modeling import build_model  # noqa: E402
from optimum_neuron_chunked.modeling.sampler import sampling_params  # noqa: E402

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0)  # fmt: skip
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512)  # fmt: skip


def inputs(spec: GraphSpec, config: NeuronConfig, device: str) -> tuple[torch.Tensor, ...]:
    """The graph's own inputs (graphs.example_inputs: its block tables, one slot a row, and its
    sampling inputs where it samples on device), with rows whose contexts end near the bucket's
    end and greedy sampling."""
    ids, positions, tables, *sampling = example_inputs(spec, config)
    rows, width = positions.shape
    last = torch.arange(spec.window - width - 8 * rows, spec.window - width, 8)[:rows, None]
    positions = (last + torch.arange(width)[None]).to(INDEX_DTYPE)
    ids = torch.randint(4, 500, positions.shape).to(INDEX_DTYPE)
    if sampling:
        sampling = [torch.tensor([sampling_params(temperature=0.0)] * rows), torch.rand(rows)]
    return tuple(t.to(device) for t in (ids, positions, tables, *sampling))


def time_call(module, args, device: str, replays: int) -> list[float]:
    """ms per call: CUDA graph replays timed with events (cpu: plain calls)."""
    with torch.no_grad():
        for _ in range(3):
            module(*args)
        if device == "cpu":
            import time

            start = time.perf_counter()
            for _ in range(replays):
                module(*args)
            return [(time.perf_counter() - start) * 1e3 / replays]  # the mean: a smoke run
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            module(*args)
        times = []
        for _ in range(replays):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(begin.elapsed_time(end))
        return times


def measure(args: argparse.Namespace) -> list[dict]:
    """TG and VF ms per context bucket (the median of the replays, and their range)."""
    from transformers import LlamaConfig

    buckets = [int(b) for b in args.buckets.split(",")]
    dims = TINY if args.tiny else LLAMA_8B
    hf_config = LlamaConfig(**dims, max_position_embeddings=max(buckets))
    config = NeuronConfig(batch_size=args.rows, sequence_length=max(buckets), context_buckets=tuple(buckets),
                          speculation_length=args.speculation_length, dtype="bfloat16", backend="eager")  # fmt: skip
    with torch.device(args.device):
        model = build_model(hf_config, config).to(args.device).eval()
    rows = []
    for window in buckets:
        tg, vf = tg_spec(config, args.rows, window), vf_spec(config, args.rows, window)
        tg_ms, vf_ms = (
            time_call(
                graph_module(model, spec, config),
                inputs(spec, config, args.device),
                args.device,
                args.replays,
            )
            for spec in (tg, vf)
        )
        row = dict(bucket=window, tg_ms=statistics.median(tg_ms), vf_ms=statistics.median(vf_ms),
                   tg_range=(min(tg_ms), max(tg_ms)), vf_range=(min(vf_ms), max(vf_ms)))  # fmt: skip
        row["ratio"] = row["vf_ms"] / row["tg_ms"]
        rows.append(row)
        print(f"bucket {window}: TG {row['tg_ms']:.2f} ms, VF ({config.verify_width} a row) {row['vf_ms']:.2f} ms, "
              f"{row['ratio']:.2f}x", flush=True)  # fmt: skip
    return rows


def write(args: argparse.Namespace, rows: list[dict]) -> None:
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    lines = [f"# Verify vs decode calls, {'tiny' if args.tiny else 'Llama-3.1-8B'} dims, bf16, B={args.rows}, "
             f"K={args.speculation_length}, {device}{' (CUDA graphs)' if args.device == 'cuda' else ''}", "",
             "| bucket | TG ms [min-max] | VF ms [min-max] | VF / TG |", "|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['bucket']} | {r['tg_ms']:.2f} [{r['tg_range'][0]:.2f}-{r['tg_range'][1]:.2f}] | "
                     f"{r['vf_ms']:.2f} [{r['vf_range'][0]:.2f}-{r['vf_range'][1]:.2f}] | {r['ratio']:.2f}x |")  # fmt: skip
    out = Path(args.out) / f"verify-proxy-{datetime.date.today().isoformat()}"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(
        json.dumps({"args": vars(args), "device": device, "rows": rows}, indent=1)
    )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--speculation-length", type=int, default=4)
    p.add_argument("--buckets", default="512,1024,2048,8192")
    p.add_argument("--replays", type=int, default=30)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny model: checks the harness anywhere")
    p.add_argument("--out", "--results", default=str(HERE / "results"), help="folder of the results files")
    args = p.parse_args(argv)
    write(args, measure(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
