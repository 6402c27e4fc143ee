"""Peak memory of a streamed export, bf16 against --quantization int8 / fp8 (quantized tensor by
tensor while the weights stream: it should cost no more than bf16). A synthetic ~1.1 B-parameter
llama (random bf16 weights) is exported per setting in its own process (peak RSS: its
ru_maxrss), the settings interleaved `--repeats` times; medians and spread.

    python benchmark/export_memory.py [--backend eager] [--repeats 3] [--scratch DIR] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from host import results_folder, save  # noqa: E402

# ~1.14 B parameters: 16 layers of 62.9 M, embeddings and lm_head of 65.5 M each
LARGE = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=16,
             num_key_value_heads=8, vocab_size=32000)  # fmt: skip
QUICK = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512)  # fmt: skip
SETTINGS = ("", "int8", "fp8")


def synthetic_checkpoint(folder: Path, shape: dict) -> tuple[Path, int]:
    """A llama checkpoint of `shape` with random bf16 weights, written one tensor at a time."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from optimum_neuron_chunked.checkpoint_stream import parameters_on_meta
    from optimum_neuron_chunked.safetensors_io import SafetensorsWriter
    from optimum_neuron_chunked.testing.checkpoints import build_tokenizer

    config = LlamaConfig(**shape, max_position_embeddings=4096, tie_word_embeddings=False, dtype="bfloat16",
                         bos_token_id=1, eos_token_id=2, pad_token_id=3)  # fmt: skip
    with parameters_on_meta():
        meta = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    params = dict(meta.named_parameters())
    folder.mkdir(parents=True, exist_ok=True)
    writer = SafetensorsWriter(
        folder / "model.safetensors", {n: (p.dtype, tuple(p.shape)) for n, p in params.items()}
    )
    generator = torch.Generator().manual_seed(0)
    for name, p in params.items():
        values = torch.ones(p.shape) if "norm" in name else torch.randn(p.shape, generator=generator) * 0.02
        writer.write(name, values.to(torch.bfloat16))
    writer.close()
    config.save_pretrained(folder)
    build_tokenizer(400).save_pretrained(folder)
    return folder, sum(p.numel() for p in params.values())


CHILD = """
import resource, sys, time
sys.path.insert(0, {repo!r})
from rich.console import Console
from optimum_neuron_chunked.export.pipeline import export
started = time.perf_counter()
export({model!r}, {out!r}, backend={backend!r}, dtype="bfloat16", batch_size=1, sequence_length=256,
       prefill_chunk_size=64, quantization={quantization!r}, overwrite=True, console=Console(quiet=True))
print(time.perf_counter() - started, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def run_export(model: Path, out: Path, backend: str, quantization: str) -> tuple[float, float]:
    """(seconds, peak RSS in GiB) of one export in a fresh process."""
    code = CHILD.format(repo=str(HERE.parent), model=str(model), out=str(out), backend=backend, quantization=quantization)  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    seconds, maxrss_kib = done.stdout.split()[-2:]
    return float(seconds), int(maxrss_kib) / 2**20


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="eager", help="eager / xla: weights only; cpu compiles too")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--scratch", type=Path, help="folder for the checkpoint and exports (deleted)")
    p.add_argument("--quick", action="store_true", help="a tiny checkpoint, one repeat (smoke run)")
    p.add_argument("--results", type=Path, help="default benchmark/results (quick: a temporary folder)")
    args = p.parse_args(argv)
    args.results = results_folder(args.results, smoke=args.quick)
    scratch = Path(tempfile.mkdtemp(prefix="export-memory-", dir=args.scratch))
    try:
        model, params = synthetic_checkpoint(scratch / "checkpoint", QUICK if args.quick else LARGE)
        runs: dict[str, list[tuple[float, float]]] = {s: [] for s in SETTINGS}
        for _ in range(1 if args.quick else args.repeats):
            for setting in SETTINGS:  # interleaved: this machine drifts
                runs[setting].append(run_export(model, scratch / "out", args.backend, setting))
                shutil.rmtree(scratch / "out", ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    base = statistics.median(rss for _, rss in runs[""])
    rows = [
        dict(setting=s or "bf16", peak_gib=statistics.median(r for _, r in v), spread_gib=max(r for _, r in v) - min(r for _, r in v),
             seconds=statistics.median(t for t, _ in v), vs_bf16=statistics.median(r for _, r in v) / base)
        for s, v in runs.items()
    ]  # fmt: skip
    lines = [
        f"# Export peak memory, {params / 1e9:.2f} B-parameter synthetic llama, {args.backend} backend", "",
        f"Median of {len(runs[''])} interleaved runs each (spread = max - min).", "",
        "| weights | peak RSS GiB (spread) | vs bf16 | export s |", "|---|---|---|---|",
    ] + [f"| {r['setting']} | {r['peak_gib']:.2f} ({r['spread_gib']:.2f}) | {r['vs_bf16']:.3f}x | {r['seconds']:.1f} |" for r in rows]  # fmt: skip
    name = f"export-memory-{datetime.date.today().isoformat()}{'-quick' if args.quick else ''}"
    save(args.results, name, {"params": params, "backend": args.backend, "rows": rows, "runs": runs}, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
