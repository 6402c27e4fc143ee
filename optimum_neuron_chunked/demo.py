"""The embedded default job: what chunked prefill buys, on a small local checkpoint.

Exports the same checkpoint twice - standard (one context-encoding graph per prompt) and
chunked (prompts fed chunk by chunk) - then, through vLLM in this process, lets a few streams
decode when a long prompt arrives, for each export. Prints how long the streams stalled and
a per-step timeline, and checks every token against transformers (loader and vLLM).

python -m optimum_neuron_chunked.demo [--out demo-out] [--backend cpu]
"""

from __future__ import annotations

import argparse
import os
import re
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from .demo_stall import STREAMS, Run, long_prompt, run_scenario, stream_prompts

BATCH, SEQUENCE, CHUNK = 4, 2048, 128
BUCKETS = (512, SEQUENCE)  # short contexts attend over 512 positions; two graphs of each kind


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="demo-out", help="work folder (checkpoint + exports)")
    parser.add_argument("--backend", default="cpu", choices=("cpu", "eager"))
    parser.add_argument("--long-prompt", type=int, default=1900, help="tokens of the long prompt")
    args = parser.parse_args(argv)
    # The demo's output is its tables; vLLM's INFO lines would bury them. vLLM reads the level
    # once, when its logger module is first imported (below, in run_scenario); a level the
    # user set still wins.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .testing.checkpoints import build_checkpoint

    console = Console(width=120)
    console.print(
        "[bold]The demo model has random weights:[/] its text is noise. What is checked is that "
        "every token equals transformers' greedy token on the same checkpoint."
    )
    work = Path(args.out)
    checkpoint = build_checkpoint("demo", work / "checkpoint")
    exports = {
        kind: export_once(checkpoint, work, kind, args.backend, console) for kind in ("standard", "chunked")
    }
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()

    long_ids = long_prompt(tokenizer, args.long_prompt)
    stream_ids = stream_prompts(tokenizer)
    ok = all(loader_matches(exports[k], reference, long_ids, k, console) for k in exports)
    runs = [run_scenario(exports[k], long_ids, stream_ids, k) for k in exports]
    expected = {"long": greedy(reference, long_ids, 4)}
    expected |= {f"stream{i}": greedy(reference, ids, 48) for i, ids in enumerate(stream_ids)}
    same = {run.export: run.outputs == expected for run in runs}
    console.print(stall_table(runs, same, len(long_ids)))
    scale = 30 / max(s.ms for run in runs for s in run.prefill_window())
    for run in runs:
        console.print(timeline(run, scale))
    return 0 if ok and all(same.values()) else 1


def export_once(checkpoint: Path, work: Path, kind: str, backend: str, console: Console) -> Path:
    from optimum_neuron_chunked.export.pipeline import export

    chunk = CHUNK if kind == "chunked" else 0
    out = work / f"export-{backend}-{kind}-{BATCH}x{SEQUENCE}x{chunk}-b{BUCKETS[0]}"
    if not (out / "neuron_config.json").is_file():
        started = time.perf_counter()
        export(str(checkpoint), out, batch_size=BATCH, sequence_length=SEQUENCE,
               prefill_chunk_size=chunk, context_buckets=BUCKETS, backend=backend, overwrite=True,
               console=console)  # fmt: skip
        console.print(f"exported {kind} ({backend}) in {time.perf_counter() - started:.0f}s: {out}")
    return out


def greedy(reference, ids: list[int], n: int) -> list[int]:
    """transformers' argmax continuation that, like vLLM's ignore_eos, neither stops at nor
    avoids eos (generate's min_new_tokens would suppress it)."""
    tokens, step, past = [], torch.tensor([ids]), None
    with torch.no_grad():
        for _ in range(n):
            out = reference(step, past_key_values=past, use_cache=True)
            past = out.past_key_values
            tokens.append(int(out.logits[0, -1].argmax()))
            step = torch.tensor([[tokens[-1]]])
    return tokens


def loader_matches(exported: Path, reference, ids: list[int], kind: str, console: Console) -> bool:
    from .causal_lm import NeuronModelForCausalLM

    model = NeuronModelForCausalLM.from_pretrained(exported)
    prompt = torch.tensor([ids])
    got = model.generate(prompt, max_new_tokens=8, do_sample=False)
    same = torch.equal(got, reference.generate(prompt, max_new_tokens=8, do_sample=False))
    console.print(f"loader, {kind}: greedy tokens equal transformers': {mark(same)}")
    return same


def mark(ok: bool) -> str:
    return "[green]True[/]" if ok else "[red]False[/]"


def stall_table(runs: list[Run], same: dict[str, bool], long_tokens: int) -> Table:
    table = Table(
        title=f"{STREAMS} streams decoding when a {long_tokens}-token prompt arrives "
        f"(vLLM in-process, {BATCH} sequences, chunk {CHUNK})"
    )
    for column in (
        "export",
        "long-prompt TTFT",
        "streams' longest gap",
        "stream tokens meanwhile",
        "vLLM == HF",
    ):
        table.add_column(column, justify="right")
    for run in runs:
        table.add_row(
            run.export,
            f"{run.long_ttft_ms():.0f} ms",
            f"{run.longest_stream_gap_ms():.0f} ms",
            str(run.stream_tokens_while_prefilling()),
            mark(same[run.export]),
        )
    return table


def timeline(run: Run, scale: float) -> Table:
    """The steps around the long prompt's prefill, one row each, with a bar of its duration
    (`scale` characters per ms, the same for every export)."""
    around = run.steps[run.arrival - 1 : run.first_long_token() + 2]
    table = Table(title=f"{run.export}: steps around the long prompt's prefill", show_edge=False)
    for column in ("step", "ms", "ran", "stream tokens", ""):
        table.add_column(column, no_wrap=True)
    for i, s in enumerate(around, start=run.arrival - 1):
        streams = sum(n for r, n in s.tokens.items() if r != "long")
        what = re.sub(r"-[0-9a-f]{8}\[", "[", s.ran)  # vLLM's internal suffix of request ids
        what += " <- first token" if i == run.first_long_token() else ""
        table.add_row(str(i), f"{s.ms:.0f}", what, str(streams), "#" * max(1, round(s.ms * scale)))
    return table


if __name__ == "__main__":
    raise SystemExit(main())
