"""What chunked prefill buys, served with `vllm serve`, side by side in one run.

Contenders (one random Llama checkpoint): std (CE graph, whole prompts per step), chunked
(vLLM schedules the chunks), chunked-whole (budget >= max_model_len: whole prompts per step,
chunks back to back inside it), native (vLLM's own CPU engine), native-budget (the same at a
token budget of our chunk size).
W1: streams decode, a long prompt arrives; the streams' ITL and decode rate in its prefill
window against before it. W2: prompts of random lengths at fixed concurrency; TTFT, ITL, tok/s.

    python benchmark/serve_bench.py [--quick] [--repeats 3] [--contenders std,chunked,...]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import httpx
import psutil

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(REPO), str(HERE)]

from client import mixed_load_stall, throughput  # noqa: E402
from engine_loop import NATIVE_ENV  # noqa: E402
from host import WORK, results_folder  # noqa: E402
from metrics import summarize_load, summarize_stall  # noqa: E402

from optimum_neuron_chunked.testing.checkpoints import COMMON, build_checkpoint  # noqa: E402
from optimum_neuron_chunked.testing.export_cache import code_key  # noqa: E402
from optimum_neuron_chunked.testing.server import Server  # noqa: E402


@dataclass(frozen=True)
class Setup:
    model: dict
    batch: int
    seq: int
    chunk: int
    backend: str
    w1: dict  # streams, long_prompt, stream_tokens, warmup_s
    w2: dict  # requests, lengths, out_tokens, concurrency
    contenders: tuple[str, ...]
    buckets: tuple[int, ...] = ()  # context buckets of the exports; () = the exporter's default
    widths: tuple[int, ...] = ()  # CP widths of the chunked export; () = the chunk size alone
    decode_widths: tuple[int, ...] = ()  # TG widths (rows) of every export; () = the batch alone
    mixed_step: bool = False  # the chunked export has MX graphs (decodes + a chunk in one call)
    # the paged export (engine_bench's `paged`): its decode rows and KV block size P; its pool
    # holds the slot export's KV bytes (batch x seq positions)
    paged_rows: int = 0
    kv_block_size: int = 0


FULL = Setup(
    model=dict(model_type="llama", hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
               num_attention_heads=8, num_key_value_heads=4, vocab_size=1024, tie_word_embeddings=False),
    batch=8,
    seq=4096,
    chunk=256,
    backend="cpu",
    w1=dict(streams=4, long_prompt=3072, stream_tokens=400, warmup_s=3.0),
    w2=dict(requests=64, lengths=(128, 2048), out_tokens=128, concurrency=8),
    contenders=("std", "chunked", "chunked-whole", "native", "native-budget"),
    # P = 128: divides every bucket (512-4096) and C, vLLM's CPU engine's default block size
    paged_rows=32,
    kv_block_size=128,
)  # fmt: skip
QUICK = Setup(
    model=dict(model_type="llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False),
    batch=4,
    seq=512,
    chunk=64,
    backend="eager",
    w1=dict(streams=3, long_prompt=384, stream_tokens=60, warmup_s=1.0),
    w2=dict(requests=8, lengths=(32, 256), out_tokens=16, concurrency=4),
    contenders=("std", "chunked"),
    paged_rows=16,
    kv_block_size=64,
)  # fmt: skip


def add_common_arguments(p: argparse.ArgumentParser) -> None:
    """The options every engine benchmark takes: a smoke mode, repeats, folders, export shapes."""
    p.add_argument("--quick", action="store_true", help="tiny model and loads (a smoke run)")
    p.add_argument("--repeats", type=int, help="runs per workload (default 3, quick 1)")
    p.add_argument("--contenders", help="comma-separated subset")
    p.add_argument("--work", type=Path, default=WORK / "bench", help="checkpoint and exports (cached)")
    p.add_argument("--results", type=Path, help="default benchmark/results (quick: a temporary folder)")
    p.add_argument("--tag", default="", help="suffix of the results files")
    p.add_argument("--buckets", help="the exports' context buckets, comma-separated, S last")
    p.add_argument("--prefill-widths", help="the chunked export's CP widths, comma-separated, C last")
    p.add_argument("--decode-widths", help="every export's TG widths in rows, comma-separated, B last")
    p.add_argument("--mixed-step", action="store_true", help="the chunked export has MX graphs")


def parse(p: argparse.ArgumentParser, argv: list[str] | None) -> tuple[argparse.Namespace, Setup]:
    """The arguments, and the setup (FULL or QUICK) with the export shapes they give; repeats
    and results folder defaulted (a smoke run's results go to a temporary folder)."""
    args = p.parse_args(argv)
    setup = QUICK if args.quick else FULL

    def ints(text: str | None) -> tuple[int, ...]:
        return tuple(int(x) for x in text.split(",")) if text else ()

    args.repeats = args.repeats or (1 if args.quick else 3)
    if not getattr(args, "engine", None):  # a contender's child process writes no results
        args.results = results_folder(args.results, smoke=args.quick)
    args.work = args.work / ("quick" if args.quick else "full")
    return args, replace(setup, buckets=ints(args.buckets) or setup.buckets,
                         widths=ints(args.prefill_widths) or setup.widths,
                         decode_widths=ints(args.decode_widths) or setup.decode_widths,
                         mixed_step=args.mixed_step or setup.mixed_step)  # fmt: skip


def describe(setup: Setup) -> str:
    shape = f"B={setup.batch} S={setup.seq} C={setup.chunk} {setup.backend} {setup.model}"
    shape += f" buckets {list(setup.buckets)}" if setup.buckets else ""
    shape += f" prefill widths {list(setup.widths)}" if setup.widths else ""
    shape += f" decode widths {list(setup.decode_widths)}" if setup.decode_widths else ""
    return shape + (" mixed steps" if setup.mixed_step else "")


def paged_shape(setup: Setup) -> dict:
    """The paged export's options: `paged_rows` decode rows (TG widths: the slot export's, and
    the rows), a pool of `kv_block_size` blocks holding batch x seq positions."""
    rows, size = setup.paged_rows, setup.kv_block_size
    widths = sorted({w for w in setup.decode_widths or (setup.batch,) if w < rows} | {rows})
    return dict(batch_size=rows, decode_widths=tuple(widths), kv_block_size=size,
                kv_cache_blocks=setup.batch * setup.seq // size)  # fmt: skip


def exports(setup: Setup, work: Path, kinds=("std", "chunked")) -> tuple[Path, dict[str, Path], dict]:
    """The bench checkpoint and its exports (cached under `work`, keyed by shapes and graph code).
    Kinds: std, chunked, paged (chunked with a pool of KV blocks, `paged_shape`), loraN (chunked
    with N adapter slots of rank 16), fp8 (chunked with an fp8 KV pool)."""
    from optimum_neuron_chunked.export.pipeline import export

    ckpt = build_checkpoint("bench", work / "checkpoint", config={**COMMON, **setup.model})
    folders, info = {}, {}
    for kind in kinds:
        chunk = setup.chunk if kind != "std" else 0
        # keyed by the graph code too: a cached export of older model code is not reused
        widths = setup.widths if chunk else ()
        mixed = setup.mixed_step and kind == "chunked"
        options = dict(batch_size=setup.batch, decode_widths=setup.decode_widths)
        if kind == "paged":
            options = paged_shape(setup)
        if kind.startswith("lora"):
            options |= dict(max_loras=int(kind[4:]), max_lora_rank=16)
        options |= dict(kv_cache_dtype="fp8") if kind == "fp8" else {}
        tags = (("b", setup.buckets), ("w", widths), ("r", options["decode_widths"]))
        shape = "".join(f"-{tag}{'.'.join(map(str, v))}" for tag, v in tags if v) + ("-mx" if mixed else "")
        if kind == "paged":
            shape += f"-p{options['kv_block_size']}x{options['kv_cache_blocks']}"
        out = work / f"{kind}-{options['batch_size']}x{setup.seq}x{chunk}{shape}-{setup.backend}-{code_key()}"
        started = time.perf_counter()
        if not (out / "neuron_config.json").is_file():
            export(str(ckpt), out, sequence_length=setup.seq,
                   prefill_chunk_size=chunk, backend=setup.backend, overwrite=True,
                   context_buckets=setup.buckets, prefill_widths=widths,
                   mixed_step=mixed, **options)  # fmt: skip
            info[kind] = {"export_s": round(time.perf_counter() - started, 1)}
        else:
            info[kind] = {"export_s": None}  # cached: see the results file of the run that built it
        info[kind]["graphs_mib"] = round(sum(f.stat().st_size for f in out.rglob("*.pt2")) / 2**20, 1)
        folders[kind] = out
    return ckpt, folders, info


def server_for(name: str, setup: Setup, ckpt: Path, folders: dict[str, Path], log: Path) -> Server:
    limits = ["--max-num-seqs", str(setup.batch), "--max-model-len", str(setup.seq)]
    if name in ("std", "chunked"):
        return Server(folders[name], log, *limits)
    if name == "chunked-whole":
        # max_model_len + max_num_seqs: above any prompt, and not one of vLLM's own default budgets
        # (which the platform reads as "not given", see README)
        budget = str(setup.seq + setup.batch)
        whole = ["--max-num-batched-tokens", budget, "--long-prefill-token-threshold", str(setup.seq)]
        return Server(folders["chunked"], log, *limits, *whole)
    # Prefix caching off, like our static cache: measure the engines, not a cache hit.
    native = [*limits, "--dtype", "float32", "--gpu-memory-utilization", "0.2", "--no-enable-prefix-caching"]
    if name == "native-budget":
        native += ["--max-num-batched-tokens", str(setup.chunk), "--long-prefill-token-threshold", str(setup.chunk)]  # fmt: skip
    return Server(ckpt, log, *native, env=dict(NATIVE_ENV))


class PeakRss:
    """Peak summed RSS of a process group, sampled in a thread."""

    def __init__(self, pgid: int):
        self.pgid, self.peak, self._stop = pgid, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(0.25):
            total = 0
            for p in psutil.process_iter(["pid"]):
                try:
                    if os.getpgid(p.pid) == self.pgid:
                        total += p.memory_info().rss
                except (psutil.Error, ProcessLookupError):
                    pass
            self.peak = max(self.peak, total)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return round(self.peak / 2**20, 1)


def run_contender(name: str, setup: Setup, ckpt: Path, folders: dict, work: Path, repeats: int) -> dict:
    server = server_for(name, setup, ckpt, folders, work / f"{name}.log")
    started = time.perf_counter()
    try:
        server.wait_ready(timeout=900)
    except (RuntimeError, TimeoutError) as e:
        return {"error": str(e)[-600:]}
    result = {"startup_s": round(time.perf_counter() - started, 1), "w1": [], "w2": []}
    print(f"{name}: up in {result['startup_s']} s", file=sys.stderr)
    rss = PeakRss(server.proc.pid)
    try:
        model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
        for i in range(repeats):
            streams, long = asyncio.run(mixed_load_stall(server.url, model, **setup.w1, seed=100 + i))
            result["w1"].append(summarize_stall(streams, long) | {"timeline": timeline(streams, long)})
            traces, wall = asyncio.run(throughput(server.url, model, **setup.w2, seed=200 + i))
            itl_all = [g for t in traces for g in t.gaps]
            result["w2"].append(summarize_load(traces, wall) | {"itl_all": itl_all})
            window = result["w1"][-1].get("prefill_window_s")
            print(f"{name}: W1 window {window}, W2 {wall:.1f} s", file=sys.stderr)
    finally:
        result["peak_rss_mib"] = rss.stop()
        server.stop()
    return result


def timeline(streams, long) -> dict:
    t0 = long.sent
    return {
        "window": [0.0, (long.tokens[0] - t0) if long.tokens else None],
        "streams": [[round(x - t0, 4) for x in s.tokens] for s in streams],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(p)
    args, setup = parse(p, argv)
    names = args.contenders.split(",") if args.contenders else list(setup.contenders)
    args.work.mkdir(parents=True, exist_ok=True)
    ckpt, folders, export_info = exports(setup, args.work)
    results = {name: run_contender(name, setup, ckpt, folders, args.work, args.repeats) for name in names}
    report = dict(setup=asdict(setup), repeats=args.repeats, exports=export_info, contenders=results)
    from report import write_report

    tag = f"{'quick-' if args.quick else ''}{datetime.date.today()}-{platform.node()}"
    paths = write_report(report, args.results, tag + (f"-{args.tag}" if args.tag else ""))
    print("\n".join(str(p) for p in paths))
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
