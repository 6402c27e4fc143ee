"""Peak resident memory of exports (benchmark/export_report.py --memory): a ~1B-parameter bf16
random Llama checkpoint exported once per backend and weight path, each export in a fresh
process (export_report.py --child) whose peak resident set is compared to the checkpoint's bytes.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
from rich.console import Console

from optimum_neuron_chunked.export.pipeline import export
from optimum_neuron_chunked.testing.checkpoints import build_tokenizer

REPORT = Path(__file__).with_name("export_report.py")

# ~0.98 B parameters: Llama-3.2-1B's widths with a 32k vocabulary, 14 layers
MEMORY_MODEL = dict(
    model_type="llama",
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=14,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=32000,
    tie_word_embeddings=False,
    max_position_embeddings=4096,
)


def build_random_checkpoint(path: Path, config: dict) -> Path:
    """A random bf16 checkpoint written tensor by tensor (the benchmark itself stays small)."""
    from transformers import AutoConfig

    from optimum_neuron_chunked.checkpoint_stream import hf_skeleton
    from optimum_neuron_chunked.safetensors_io import SafetensorsWriter

    if (path / "config.json").is_file():
        return path
    cfg = dict(config)
    hf_config = AutoConfig.for_model(cfg.pop("model_type"), **cfg, bos_token_id=1, eos_token_id=2)
    hf_config.dtype = "bfloat16"  # transformers 5 (4.57: torch_dtype)
    hf_config.torch_dtype = "bfloat16"
    state = hf_skeleton(hf_config, torch.bfloat16).state_dict()
    staging = path.with_name(path.name + ".partial")
    staging.mkdir(parents=True, exist_ok=True)
    entries = {n: (torch.bfloat16, tuple(t.shape)) for n, t in state.items()}
    writer = SafetensorsWriter(staging / "model.safetensors", entries, metadata={"format": "pt"})
    generator = torch.Generator().manual_seed(0)
    for name in writer.order:
        shape = entries[name][1]
        tensor = torch.randn(shape, generator=generator) * (0.3 if "norm" in name else 0.02)
        writer.write(name, (tensor + (1.0 if "norm" in name else 0.0)).to(torch.bfloat16))
    writer.close()
    hf_config.save_pretrained(staging)
    build_tokenizer(400).save_pretrained(staging)
    staging.rename(path)
    return path


def peak_rss() -> int:
    """This process's peak resident set in bytes: VmHWM, the high-water mark of its own address
    space (Linux, proc(5)). Not ru_maxrss: Linux carries it across fork and exec, so a child
    would report its parent's peak whenever that was higher."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def neuron_weights(args, tp: int) -> None:
    """The neuron backend's export up to its compile, which needs the Neuron SDK: the per-rank
    weight files, written as the exporter writes them (its own function)."""
    from optimum_neuron_chunked.backends.neuron import NeuronBackend
    from optimum_neuron_chunked.config import NeuronConfig
    from optimum_neuron_chunked.export.pipeline import _export_weights, _load_hf_config

    hf_config = _load_hf_config(args.checkpoint)
    config = NeuronConfig(
        batch_size=args.batch_size,
        sequence_length=args.sequence_length,
        prefill_chunk_size=args.chunk,
        tp_degree=tp,
        dtype="bfloat16",
        backend="neuron",
        instance_type="trn1",
        model_type=hf_config.model_type,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    console = Console(stderr=True, quiet=True)
    _export_weights(args.checkpoint, hf_config, config, NeuronBackend(), out, args.weights[0], console)


def child_export(args) -> int:
    """One export in this process; prints its peak resident set. Backend `neuron-weights-tpN`:
    only the neuron backend's weight files at tp N (neuron_weights)."""
    imported = peak_rss()
    started = time.perf_counter()
    if args.backend.startswith("neuron-weights-tp"):
        neuron_weights(args, int(args.backend.removeprefix("neuron-weights-tp")))
    else:
        export_once(args)
    peak = peak_rss()
    print(json.dumps(dict(export_s=time.perf_counter() - started, peak_rss=peak, imports_rss=imported)))
    return 0


def export_once(args) -> None:
    export(
        args.checkpoint,
        args.out,
        batch_size=args.batch_size,
        sequence_length=args.sequence_length,
        prefill_chunk_size=args.chunk,
        backend=args.backend,
        dtype="bfloat16",
        context_buckets=(args.sequence_length,),
        weights=args.weights[0],
        overwrite=True,
        console=Console(stderr=True, quiet=True),
    )


def memory_report(args) -> tuple[dict, list[dict], list[str]] | None:
    """Rows of peak resident memory per backend and weight path (None: an export failed)."""
    console = Console()
    work = Path(args.work)
    checkpoint = build_random_checkpoint(work / "llama-1b-bf16", MEMORY_MODEL)
    ckpt_bytes = sum(p.stat().st_size for p in checkpoint.glob("*.safetensors"))
    rows = []
    for backend in args.backends:
        for weights in args.weights:
            command = [sys.executable, str(REPORT), "--child", "--checkpoint", str(checkpoint)]
            command += ["--out", str(work / f"export-{backend}-{weights}"), "--backend", backend]
            command += ["--weights", weights, "--batch-size", str(args.batch_size)]
            command += ["--sequence-length", str(args.sequence_length), "--chunk", str(args.chunk)]
            done = subprocess.run(command, capture_output=True, text=True, env=os.environ)
            if done.returncode:
                console.print(done.stderr[-3000:])
                return None
            child = json.loads(done.stdout.strip().splitlines()[-1])
            rows.append(
                dict(
                    backend=backend,
                    weights=weights,
                    export_s=round(child["export_s"], 1),
                    peak_rss_gb=round(child["peak_rss"] / 1e9, 3),
                    imports_rss_gb=round(child["imports_rss"] / 1e9, 3),
                    ratio=round(child["peak_rss"] / ckpt_bytes, 3),
                )
            )
            console.print(rows[-1])
    meta = dict(
        model=MEMORY_MODEL,
        checkpoint_gb=round(ckpt_bytes / 1e9, 3),
        batch_size=args.batch_size,
        sequence_length=args.sequence_length,
        chunk=args.chunk,
        dtype="bfloat16",
        torch=torch.__version__,
    )
    lines = [
        "| backend | weights | export s | peak RSS GB | RSS after imports GB | peak / checkpoint |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['backend']} | {r['weights']} | {r['export_s']} | {r['peak_rss_gb']} | "
        f"{r['imports_rss_gb']} | {r['ratio']} |"
        for r in rows
    ]
    console.print("\n".join(lines))
    return meta, rows, lines
