"""Verify and paged decode calls against decode calls on an accelerator proxy: the neuron
backend's graphs (the reference kernels, what neuronx-cc receives) replayed as CUDA graphs, where
a decode step is bound by reading the weights, as on Neuron. Llama-3.1-8B dims, random bf16
weights, B rows: per context bucket a TG call (1 token a row) and a VF call (K + 1 tokens a row),
the rows' contexts ending near the bucket's end; with --paged-rows N, a TG call of N rows of a
paged export whose pool holds the B rows' KV bytes (tokens a call: N / paged ms against B / TG ms).

    python benchmark/verify_proxy.py [--rows 8] [--speculation-length 4] [--buckets 512,1024,2048,8192]
    python benchmark/verify_proxy.py --paged-rows 32     # paged rows' decode against the slot rows'
    python benchmark/verify_proxy.py --tiny --device cpu     # a smoke run (results: a temporary folder)
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from host import results_folder, save  # noqa: E402

from optimum_neuron_chunked import graphs  # noqa: E402
from optimum_neuron_chunked.config import NeuronConfig  # noqa: E402
from optimum_neuron_chunked.graphs import INDEX_DTYPE, GraphSpec, example_inputs, graph_module  # noqa: E402
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


def timed(model, spec: GraphSpec, config: NeuronConfig, args: argparse.Namespace) -> list[float]:
    module = graph_module(model, spec, config)
    return time_call(module, inputs(spec, config, args.device), args.device, args.replays)


def measure(args: argparse.Namespace) -> list[dict]:
    """TG and VF ms per context bucket (the median of the replays, and their range); with
    --paged-rows, the paged export's TG ms and its tokens a call over the slot export's."""
    from transformers import LlamaConfig

    buckets = [int(b) for b in args.buckets.split(",")]
    hf_config = LlamaConfig(**(TINY if args.tiny else LLAMA_8B), max_position_embeddings=max(buckets))
    shape = dict(sequence_length=max(buckets), context_buckets=tuple(buckets), dtype="bfloat16", backend="eager")  # fmt: skip
    config = NeuronConfig(batch_size=args.rows, speculation_length=args.speculation_length, **shape)
    with torch.device(args.device):
        model = build_model(hf_config, config).to(args.device).eval()
    rows = []
    for window in buckets:
        specs = graphs.tg_spec(config, args.rows, window), graphs.vf_spec(config, args.rows, window)
        tg_ms, vf_ms = (timed(model, spec, config, args) for spec in specs)
        row = dict(bucket=window, tg_ms=statistics.median(tg_ms), vf_ms=statistics.median(vf_ms),
                   tg_range=(min(tg_ms), max(tg_ms)), vf_range=(min(vf_ms), max(vf_ms)))  # fmt: skip
        row["ratio"] = row["vf_ms"] / row["tg_ms"]
        rows.append(row)
        print(f"bucket {window}: TG {row['tg_ms']:.2f} ms, VF ({config.verify_width} a row) {row['vf_ms']:.2f} ms, "
              f"{row['ratio']:.2f}x", flush=True)  # fmt: skip
    if args.paged_rows:  # the slot model freed first: the paged one holds as many KV bytes
        del model
        size = args.kv_block_size
        paged = NeuronConfig(batch_size=args.paged_rows, prefill_chunk_size=min(256, *buckets), kv_block_size=size,
                             kv_cache_blocks=args.rows * max(buckets) // size, **shape)  # fmt: skip
        with torch.device(args.device):
            model = build_model(hf_config, paged).to(args.device).eval()
        for row in rows:
            ms = timed(model, graphs.tg_spec(paged, args.paged_rows, row["bucket"]), paged, args)
            row |= dict(paged_tg_ms=statistics.median(ms), paged_tg_range=(min(ms), max(ms)))
            row["paged_tokens"] = args.paged_rows / row["paged_tg_ms"] / (args.rows / row["tg_ms"])
            print(f"bucket {row['bucket']}: paged TG ({args.paged_rows} rows) {row['paged_tg_ms']:.2f} ms, "
                  f"{row['paged_tokens']:.2f}x the tokens of {args.rows} rows", flush=True)  # fmt: skip
    return rows


def write(args: argparse.Namespace, rows: list[dict]) -> None:
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    paged = f" | paged TG ms, {args.paged_rows} rows [min-max] | paged / slot tokens" if args.paged_rows else ""  # fmt: skip
    lines = [f"# Verify vs decode calls, {'tiny' if args.tiny else 'Llama-3.1-8B'} dims, bf16, B={args.rows}, "
             f"K={args.speculation_length}, {device}{' (CUDA graphs)' if args.device == 'cuda' else ''}", "",
             f"| bucket | TG ms [min-max] | VF ms [min-max] | VF / TG{paged} |",
             "|---|---|---|---|" + ("---|---|" if paged else "")]  # fmt: skip
    for r in rows:
        line = (f"| {r['bucket']} | {r['tg_ms']:.2f} [{r['tg_range'][0]:.2f}-{r['tg_range'][1]:.2f}] | "
                f"{r['vf_ms']:.2f} [{r['vf_range'][0]:.2f}-{r['vf_range'][1]:.2f}] | {r['ratio']:.2f}x |")  # fmt: skip
        if paged:
            lo, hi = r["paged_tg_range"]
            line += f" {r['paged_tg_ms']:.2f} [{lo:.2f}-{hi:.2f}] | {r['paged_tokens']:.2f}x |"
        lines.append(line)
    data = {"args": vars(args), "device": device, "rows": rows}
    save(results_folder(args.out, smoke=args.tiny), f"verify-proxy-{datetime.date.today()}", data, lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--speculation-length", type=int, default=4)
    p.add_argument("--buckets", default="512,1024,2048,8192")
    p.add_argument("--replays", type=int, default=30)
    p.add_argument("--device", default="cuda")
    p.add_argument("--paged-rows", type=int, default=0, help="also time a paged export's TG call of N rows")
    p.add_argument("--kv-block-size", type=int, default=128, help="the paged export's block size P")
    p.add_argument("--tiny", action="store_true", help="a tiny model: checks the harness anywhere")
    p.add_argument("--out", "--results", help="results folder (default benchmark/results; --tiny: temporary)")
    args = p.parse_args(argv)
    write(args, measure(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
