"""Export time, artifact size and HF parity of std vs chunked exports, for every family; with
--memory, the peak resident memory of exporting a ~1B-parameter bf16 checkpoint.

Checkpoints here use shapes the tests do not (other head dims, GQA ratios, vocab sizes).
Writes benchmark/results/export-<date>-<host>.{json,md}.

    python benchmark/export_report.py [--batch-size 4 --sequence-length 1024 --chunk 128]
    python benchmark/export_report.py --memory --backends eager cpu [--weights stream transformers]
    python benchmark/export_report.py --memory --backends neuron-weights-tp1 neuron-weights-tp2

--memory builds a random Llama checkpoint (MEMORY_MODEL, bf16, ~2 GB; cached under --work, not
shipped) and exports it once per backend and weight path, each in a fresh process: its peak
resident set (VmHWM) is given beside the checkpoint's bytes (the ratio issue 37 bounds) and
the peak of the process once its imports are done.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from export_memory import child_export, memory_report  # noqa: E402  (beside this file)

from optimum_neuron_chunked import NeuronModelForCausalLM  # noqa: E402
from optimum_neuron_chunked.export.pipeline import export  # noqa: E402
from optimum_neuron_chunked.testing.checkpoints import COMMON, build_checkpoint  # noqa: E402

UNSEEN = {
    "llama": dict(
        model_type="llama",
        hidden_size=128,
        intermediate_size=320,
        num_hidden_layers=3,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=1000,
    ),
    "mistral": dict(
        model_type="mistral",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        vocab_size=700,
        sliding_window=300,
    ),
    "qwen2": dict(
        model_type="qwen2",
        hidden_size=120,
        intermediate_size=200,
        num_hidden_layers=2,
        num_attention_heads=5,
        num_key_value_heads=5,
        vocab_size=900,
        tie_word_embeddings=True,
    ),
    "qwen3": dict(
        model_type="qwen3",
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=3,
        head_dim=48,
        vocab_size=777,
        tie_word_embeddings=False,
    ),
    "granite": dict(
        model_type="granite",
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        vocab_size=600,
        embedding_multiplier=3.0,
        residual_multiplier=0.3,
        attention_multiplier=0.05,
        logits_scaling=2.0,
    ),
    "smollm3": dict(
        model_type="smollm3",
        hidden_size=112,
        intermediate_size=224,
        num_hidden_layers=4,
        num_attention_heads=7,
        num_key_value_heads=7,
        vocab_size=820,
        tie_word_embeddings=False,
    ),  # default no_rope_layer_interval 4: the last layer has no rotary embedding
    "phi3": dict(
        model_type="phi3",
        hidden_size=128,
        intermediate_size=272,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=650,
        tie_word_embeddings=False,
        sliding_window=200,
    ),
    "gemma3_text": dict(
        model_type="gemma3_text",
        hidden_size=96,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=40,
        vocab_size=720,
        tie_word_embeddings=True,
        query_pre_attn_scalar=48,
        sliding_window=160,  # default sliding_window_pattern 6: layers 0-3 all local
        rope_theta=1000000.0,
        rope_local_base_freq=10000.0,
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        hidden_size=96,
        intermediate_size=160,
        moe_intermediate_size=64,
        num_experts=16,
        num_experts_per_tok=4,
        norm_topk_prob=False,
        decoder_sparse_step=2,  # layers 1 and 3 sparse, 0 and 2 dense
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=800,
        tie_word_embeddings=False,
    ),
    "mixtral": dict(
        model_type="mixtral",
        hidden_size=128,
        intermediate_size=96,
        num_local_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        vocab_size=500,
        tie_word_embeddings=False,
        sliding_window=256,
    ),
    "gpt_oss": dict(
        model_type="gpt_oss",
        hidden_size=96,
        intermediate_size=80,
        num_local_experts=12,
        num_experts_per_tok=3,
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=32,
        vocab_size=640,
        tie_word_embeddings=False,
        sliding_window=128,
    ),
}


def write_results(stamp: str, tag: str, meta: dict, rows: list, table: list[str]) -> None:
    stamp += f"-{tag}" if tag else ""
    results = REPO / "benchmark" / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{stamp}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=2, default=str))
    (results / f"{stamp}.md").write_text(
        "\n".join([f"# {stamp}", "", f"`{json.dumps(meta)}`", "", *table]) + "\n"
    )


def size_mb(path: Path, pattern: str = "*") -> float:
    return sum(p.stat().st_size for p in path.rglob(pattern) if p.is_file()) / 2**20


def parity(model, hf, lengths: list[int], new_tokens: int) -> dict:
    matches = {}
    for n in lengths:
        ids = torch.randint(4, 380, (1, n), generator=torch.Generator().manual_seed(n))
        got = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
        want = hf.generate(ids, max_new_tokens=new_tokens, do_sample=False)
        matches[n] = got.tolist() == want.tolist()
    return matches


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--sequence-length", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--families", nargs="*", default=list(UNSEEN))
    parser.add_argument("--tag", default="", help="appended to the result file names")
    parser.add_argument("--memory", action="store_true", help="peak resident memory of a ~1B export")
    parser.add_argument("--backends", nargs="*", default=["eager", "cpu"], help="--memory: backends")
    parser.add_argument("--weights", nargs="*", default=["transformers", "stream"], help="--memory: paths")
    parser.add_argument("--work", default="/tmp/onc-export-memory", help="--memory: checkpoint, exports")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child_export(args)
    if args.memory:
        report = memory_report(args)
        if report is None:
            return 1
        stamp = f"export-memory-{datetime.date.today()}-{platform.node()}"
        write_results(stamp, args.tag, *report)
        return 0
    from transformers import AutoModelForCausalLM

    console = Console()
    s, c = args.sequence_length, args.chunk
    lengths = [1, c - 1, c, c + 1, 3 * c + 5, s - 24]
    rows = []
    work = Path(tempfile.mkdtemp(prefix="export-report-"))
    for family in args.families:
        checkpoint = build_checkpoint(
            family, work / f"ckpt-{family}", seed=7, config={**COMMON, **UNSEEN[family]}
        )
        hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
        for chunk in (0, c):
            out = work / f"{family}-{chunk}"
            started = time.perf_counter()
            export(
                str(checkpoint),
                out,
                batch_size=args.batch_size,
                sequence_length=s,
                prefill_chunk_size=chunk,
                backend=args.backend,
                console=console,
            )
            export_s = time.perf_counter() - started
            model = NeuronModelForCausalLM.from_pretrained(out)
            matches = parity(model, hf, lengths, new_tokens=16)
            rows.append(
                dict(
                    family=family,
                    kind="chunked" if chunk else "std",
                    chunk=chunk,
                    export_s=round(export_s, 1),
                    graphs_mb=round(size_mb(out / "graphs"), 1),
                    weights_mb=round(size_mb(out, "*.safetensors"), 2),
                    total_mb=round(size_mb(out), 1),
                    greedy_equal_hf=all(matches.values()),
                    per_length=matches,
                )
            )
            console.print(rows[-1])
    table = Table("family", "kind", "export s", "graphs MiB", "weights MiB", "greedy == HF")
    for r in rows:
        table.add_row(
            r["family"],
            r["kind"],
            str(r["export_s"]),
            str(r["graphs_mb"]),
            str(r["weights_mb"]),
            str(r["greedy_equal_hf"]),
        )
    console.print(table)
    meta = dict(
        batch_size=args.batch_size, sequence_length=s, chunk=c, backend=args.backend, prompt_lengths=lengths
    )
    lines = [
        "| family | kind | export s | graphs MiB | weights MiB | greedy == HF |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['family']} | {r['kind']} | {r['export_s']} | {r['graphs_mb']} | {r['weights_mb']} | "
        f"{r['greedy_equal_hf']} |"
        for r in rows
    ]
    write_results(f"export-{datetime.date.today()}-{platform.node()}", args.tag, meta, rows, lines)
    return 0 if all(r["greedy_equal_hf"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
