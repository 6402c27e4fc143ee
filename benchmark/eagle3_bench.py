"""EAGLE3 on the CPU engine: decode tok/s at concurrency 1 and 4 with no speculation, vLLM's
n-gram proposer (K=3) and the export's head (K 2-4), on the trained tiny pair
(optimum_neuron_chunked/testing/eagle3_heads.py: a tiny llama taught a small grammar, a head
trained on it); mean acceptance length from vLLM's spec-decode counters.

One export (the pair, B=4, S=256, C=32, K=4, the cpu backend) serves every contender, each in a
process of its own per repeat, contenders rotated between repeats; 8 prompts of 16 tokens, greedy,
`--max-tokens` out, 1 or 4 in flight. "/ none" compares tokens a CPU-second of the contender's
process (the engine runs in it), which holds where the wall clock does not on a shared host. On
CPU a verify call of K + 1 tokens a row costs more than a decode call (compute-bound), unlike
Neuron's weight-bound decode: neuron_projection.py projects that.

    python benchmark/eagle3_bench.py [--repeats 3] [--max-tokens 64] [--contenders none,eagle3-3]
        [--backend cpu] [--work DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(REPO), str(HERE)]

from engine_loop import EngineLoop, in_own_process  # noqa: E402
from host import WORK, describe_host, results_folder, save  # noqa: E402

CONTENDERS = ("none", "ngram-3", "eagle3-2", "eagle3-3", "eagle3-4")
CONCURRENCY = (1, 4)
SHAPE = dict(batch_size=4, sequence_length=256, prefill_chunk_size=32, speculation_length=4)


def speculative_config(contender: str, export: Path) -> dict | None:
    method, _, k = contender.partition("-")
    if method == "none":
        return None
    if method == "ngram":
        return dict(method="ngram", num_speculative_tokens=int(k), prompt_lookup_min=1, prompt_lookup_max=3)
    return dict(method="eagle3", model=str(export / "eagle3_head"), num_speculative_tokens=int(k))


def pair_export(backend: str, work: Path) -> tuple[Path, list[list[int]]]:
    """The trained pair exported with its head (once; kept under `work`), and the pair's prompts."""
    from optimum_neuron_chunked.export.pipeline import export
    from optimum_neuron_chunked.testing.eagle3_heads import trained_pair
    from optimum_neuron_chunked.testing.export_cache import code_key

    target, head = trained_pair(work)
    out = (
        work / f"eagle3-bench-{backend}-{target.parent.name}-{code_key(backend)[:16]}"
    )  # new code: new export
    if not (out / "neuron_config.json").is_file():
        export(str(target), out, backend=backend, overwrite=True, speculation_head=str(head), **SHAPE)
    return out, json.loads((target.parent / "manifest.json").read_text())["prompts"]


def run_contender(contender: str, export: Path, prompts: list[list[int]], max_tokens: int) -> dict:
    """In the contender's process: each concurrency's output tok/s, steps and spec counters."""
    loop = EngineLoop(model=str(export), max_num_seqs=4, max_model_len=SHAPE["sequence_length"],
                      disable_log_stats=False, speculative_config=speculative_config(contender, export))  # fmt: skip
    loop.warm_up(prompts[:2])
    result = {}
    for conc in CONCURRENCY:
        before, steps = loop.counters("vllm:spec_decode"), len(loop.steps)
        queue = [(f"c{conc}-{i}", ids) for i, ids in enumerate(prompts)]
        started, cpu_started = time.perf_counter(), time.process_time()
        traces = loop.serve(queue, max_tokens, conc)
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
        after = loop.counters("vllm:spec_decode")
        delta = {k.removeprefix("vllm:spec_decode_"): v - before.get(k, 0) for k, v in after.items()}
        drafts = delta.get("num_drafts", 0)
        tokens = sum(len(t.tokens) for t in traces)
        result[str(conc)] = dict(tok_s=tokens / wall, tok_per_cpu_s=tokens / cpu, steps=len(loop.steps) - steps, tokens=tokens,
                                 acceptance_length=1 + delta.get("num_accepted_tokens", 0) / drafts if drafts else None)  # fmt: skip
    loop.close()
    return result


def table(runs: dict[str, list[dict]], args: argparse.Namespace) -> list[str]:
    lines = [f"# EAGLE3 on the CPU engine ({describe_host()})", "",
             f"Trained tiny pair, {args.backend} backend, 8 prompts x {args.max_tokens} tokens, greedy; "
             f"median (min-max) of {args.repeats} runs, contenders rotated.", "",
             "| contender | in flight | output tok/s | tokens a CPU-second | / none | engine steps | acceptance length |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for conc in map(str, CONCURRENCY):
        base = statistics.median(r[conc]["tok_per_cpu_s"] for r in runs["none"]) if "none" in runs else None
        for name, rs in runs.items():
            tok, per_cpu = [r[conc]["tok_s"] for r in rs], [r[conc]["tok_per_cpu_s"] for r in rs]
            accept = rs[0][conc]["acceptance_length"]
            ratio = f"{statistics.median(per_cpu) / base:.2f}x" if base else "-"
            lines.append(f"| {name} | {conc} | {statistics.median(tok):.1f} ({min(tok):.1f}-{max(tok):.1f}) "
                         f"| {statistics.median(per_cpu):.1f} ({min(per_cpu):.1f}-{max(per_cpu):.1f}) | {ratio} "
                         f"| {rs[0][conc]['steps']} | {f'{accept:.2f}' if accept else '-'} |")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--backend", default="cpu")
    p.add_argument("--work", type=Path, default=WORK, help="where the pair and its export are kept")
    p.add_argument("--results", type=Path, help="folder of the results files (default benchmark/results)")
    p.add_argument("--run", help=argparse.SUPPRESS)  # a contender's own process
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    export, prompts = pair_export(args.backend, args.work)
    if args.run:
        args.out.write_text(json.dumps(run_contender(args.run, export, prompts, args.max_tokens)))
        return 0
    names = args.contenders.split(",")
    runs: dict[str, list[dict]] = {n: [] for n in names}
    folder = results_folder(args.results, smoke=False)
    for r in range(args.repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            argv = [__file__, "--run", name, "--max-tokens", str(args.max_tokens), "--backend", args.backend,
                    "--work", str(args.work)]  # fmt: skip
            result = in_own_process(name, argv, folder / f".eagle3-{name}.json")
            if "error" in result:
                print(f"{name}: {result['error']}", file=sys.stderr)
                return 1
            runs[name].append(result)
    for name in names:
        (folder / f".eagle3-{name}.json").unlink(missing_ok=True)
    save(folder, f"eagle3-{datetime.date.today()}", dict(args=vars(args), runs=runs), table(runs, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
