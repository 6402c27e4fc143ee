"""Export time, artifact size and HF parity of std vs chunked exports, for every family.

Checkpoints here use shapes the tests do not (other head dims, GQA ratios, vocab sizes).

    python benchmark/export_report.py [--batch-size 4 --sequence-length 1024 --chunk 128] [--families llama ...]
    python benchmark/export_report.py --quick    # one family, eager, S=256: a smoke run
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

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from host import results_folder, save  # noqa: E402

from optimum_neuron_chunked import NeuronModelForCausalLM  # noqa: E402
from optimum_neuron_chunked.export.pipeline import export  # noqa: E402
from optimum_neuron_chunked.testing.checkpoints import COMMON, build_checkpoint  # noqa: E402

# family: (its values of SHAPE, its other config fields); shapes the tests do not use
SHAPE = "hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads vocab_size"
UNSEEN = {
    "llama": ((128, 320, 3, 16, 4, 1000), dict()),
    "mistral": ((128, 256, 2, 2, 1, 700), dict(head_dim=64, sliding_window=300)),
    "qwen2": ((120, 200, 2, 5, 5, 900), dict(tie_word_embeddings=True)),
    "qwen3": ((96, 192, 2, 3, 3, 777), dict(head_dim=48, tie_word_embeddings=False)),
    "granite": ((96, 160, 2, 4, 2, 600), dict(head_dim=24, embedding_multiplier=3.0, residual_multiplier=0.3,
                                              attention_multiplier=0.05, logits_scaling=2.0)),
    # the default no_rope_layer_interval 4: the last layer has no rotary embedding
    "smollm3": ((112, 224, 4, 7, 7, 820), dict(tie_word_embeddings=False)),
    "phi3": ((128, 272, 2, 8, 4, 650), dict(tie_word_embeddings=False, sliding_window=200)),
    # the default sliding_window_pattern 6: layers 0-3 all local
    "gemma3_text": ((96, 256, 4, 3, 1, 720), dict(head_dim=40, tie_word_embeddings=True, query_pre_attn_scalar=48,
                    sliding_window=160, rope_theta=1000000.0, rope_local_base_freq=10000.0)),
    # decoder_sparse_step 2: layers 1 and 3 sparse, 0 and 2 dense
    "qwen3_moe": ((96, 160, 4, 6, 2, 800), dict(moe_intermediate_size=64, num_experts=16, num_experts_per_tok=4,
                  norm_topk_prob=False, decoder_sparse_step=2, head_dim=32, tie_word_embeddings=False)),
    "mixtral": ((128, 96, 2, 4, 1, 500), dict(num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False,
                sliding_window=256)),
    "gpt_oss": ((96, 80, 4, 6, 3, 640), dict(num_local_experts=12, num_experts_per_tok=3, head_dim=32,
                tie_word_embeddings=False, sliding_window=128)),
}  # fmt: skip


def config(family: str) -> dict:
    shape, other = UNSEEN[family]
    return dict(model_type=family, **dict(zip(SHAPE.split(), shape, strict=True)), **other)


# --quick's settings (flags given still win); gemma3_text: sliding layers with rings and global ones
QUICK = dict(
    batch_size=2, sequence_length=256, chunk=32, backend="eager", families=["gemma3_text"], new_tokens=4
)
FULL = dict(
    batch_size=4, sequence_length=1024, chunk=128, backend="cpu", families=list(UNSEEN), new_tokens=16
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


def family_rows(family: str, args: argparse.Namespace, lengths: list[int], work: Path, console) -> list[dict]:
    """A std and a chunked export of `family`'s checkpoint: export time, sizes, greedy parity with HF."""
    from transformers import AutoModelForCausalLM

    checkpoint = build_checkpoint(
        family, work / f"ckpt-{family}", seed=7, config={**COMMON, **config(family)}
    )
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    rows = []
    for chunk in (0, args.chunk):
        out = work / f"{family}-{chunk}"
        started = time.perf_counter()
        export(str(checkpoint), out, batch_size=args.batch_size, sequence_length=args.sequence_length,
               prefill_chunk_size=chunk, backend=args.backend, console=console)  # fmt: skip
        export_s = time.perf_counter() - started
        model = NeuronModelForCausalLM.from_pretrained(out)
        matches = parity(model, hf, lengths, new_tokens=args.new_tokens)
        rows.append(dict(family=family, kind="chunked" if chunk else "std", chunk=chunk, export_s=round(export_s, 1),
                         graphs_mb=round(size_mb(out / "graphs"), 1), weights_mb=round(size_mb(out, "*.safetensors"), 2),
                         total_mb=round(size_mb(out), 1), greedy_equal_hf=all(matches.values()), per_length=matches))  # fmt: skip
        console.print(rows[-1])
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny model and workload (a smoke run)")
    parser.add_argument("--batch-size", type=int, help="default 4 (quick 2)")
    parser.add_argument("--sequence-length", type=int, help="default 1024 (quick 256)")
    parser.add_argument("--chunk", type=int, help="default 128 (quick 32)")
    parser.add_argument("--backend", help="default cpu (quick eager)")
    parser.add_argument("--families", nargs="*", help="default: every family (quick: gemma3_text)")
    parser.add_argument(
        "--new-tokens", type=int, help="greedy tokens per parity prompt, default 16 (quick 4)"
    )
    parser.add_argument("--results", type=Path, help="default benchmark/results (quick: a temporary folder)")
    parser.add_argument("--tag", default="", help="appended to the result file names")
    args = parser.parse_args(argv)
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.results = results_folder(args.results, smoke=args.quick)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console()
    s, c = args.sequence_length, args.chunk
    lengths = [1, c - 1, c, c + 1, 3 * c + 5, s - 24]
    with tempfile.TemporaryDirectory(prefix="export-report-") as work:
        rows = [row for f in args.families for row in family_rows(f, args, lengths, Path(work), console)]
    headers = ("family", "kind", "export s", "graphs MiB", "weights MiB", "greedy == HF")
    cells = [[str(r[k]) for k in ("family", "kind", "export_s", "graphs_mb", "weights_mb", "greedy_equal_hf")]
             for r in rows]  # fmt: skip
    table = Table(*headers)
    for row in cells:
        table.add_row(*row)
    console.print(table)
    meta = dict(batch_size=args.batch_size, sequence_length=s, chunk=c, backend=args.backend,
                prompt_lengths=lengths, new_tokens=args.new_tokens)  # fmt: skip
    lines = ["| " + " | ".join(headers) + " |", "|---" * len(headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    stamp = f"export-{datetime.date.today()}-{platform.node()}{'-quick' if args.quick else ''}"
    stamp += f"-{args.tag}" if args.tag else ""
    save(
        args.results,
        stamp,
        dict(meta=meta, rows=rows),
        [f"# {stamp}", "", f"`{json.dumps(meta)}`", "", *lines],
        echo=False,
    )
    return 0 if all(r["greedy_equal_hf"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
