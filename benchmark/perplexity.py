"""Perplexity of an export on your own text, next to transformers on the source checkpoint: judge
a quantized export (--quantization int8|fp8) on text you care about. The export (made with
--prompt-logprobs: every position's logits) prefills windows of `--window` tokens chunk by
chunk and scores every token after a window's first; transformers scores the same in fp32, an
FP8 checkpoint through its own weight-only dequantization (what the export computes; a plain
from_pretrained of a W8A8 checkpoint also rounds activations). The line names the reference.

    python benchmark/perplexity.py EXPORT --text FILE [--model SOURCE] [--window 1024] [--max-tokens 16384]
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from host import results_folder, save  # noqa: E402

from optimum_neuron_chunked import NeuronModelForCausalLM  # noqa: E402
from optimum_neuron_chunked.config import prefill_slices  # noqa: E402
from optimum_neuron_chunked.testing.reference import transformers_weight_only  # noqa: E402


def windows(ids: list[int], size: int) -> list[torch.Tensor]:
    """Consecutive windows of `size` tokens (the last may be shorter; a 1-token tail scores nothing)."""
    return [torch.tensor(ids[i : i + size]) for i in range(0, len(ids), size) if len(ids[i : i + size]) > 1]


def scored(logits: torch.Tensor, window: torch.Tensor) -> float:
    """Negative log-likelihood summed over the window's tokens after its first."""
    logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)
    return -logprobs.gather(1, window[1:, None]).sum().item()


def export_nll(model: NeuronModelForCausalLM, window: torch.Tensor) -> float:
    runner, config = model.runner, model.neuron_config
    blocks = model.kv_pool.acquire(len(window))
    try:
        slices = prefill_slices(len(window), config.prefill_chunk_size)
        parts = [runner.prefill(window[s], s.start, blocks, every_position=True) for s in slices]
    finally:
        model.kv_pool.release(blocks)
    return scored(torch.cat(parts), window)


def reference_nll(hf, window: torch.Tensor) -> float:
    with torch.no_grad():
        return scored(hf(window[None]).logits[0], window)


def perplexities(export: Path, model: str | None, text: str, window: int, max_tokens: int) -> dict:
    neuron = NeuronModelForCausalLM.from_pretrained(export)
    if not neuron.neuron_config.prompt_logprobs:
        raise SystemExit(f"{export} returns last-position logits only: export it with --prompt-logprobs")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(export)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]
    size = min(window, neuron.neuron_config.sequence_length)
    parts = windows(ids, size)
    if not parts:
        raise SystemExit("the text holds fewer than 2 tokens: nothing to score")
    scored_tokens = sum(len(w) - 1 for w in parts)
    started = time.perf_counter()
    result = {"export": str(export), "tokens": scored_tokens, "windows": len(parts), "window": size}
    result["export_ppl"] = math.exp(sum(export_nll(neuron, w) for w in parts) / scored_tokens)
    result["export_s"] = time.perf_counter() - started
    if model:
        hf, reference = transformers_weight_only(model)
        result |= {
            "model": model,
            "reference": reference,
            "reference_ppl": math.exp(sum(reference_nll(hf, w) for w in parts) / scored_tokens),
        }
        result["ratio"] = result["export_ppl"] / result["reference_ppl"]
    result["quantization"] = neuron.neuron_config.quantization or neuron.neuron_config.dtype
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("export", type=Path, help="an export folder made with --prompt-logprobs")
    p.add_argument("--text", type=Path, required=True, help="a UTF-8 text file")
    p.add_argument("--model", help="the source checkpoint (folder or hub id) for transformers' perplexity")
    p.add_argument("--window", type=int, default=1024, help="tokens per scored sequence (<= the export's)")
    p.add_argument("--max-tokens", type=int, default=16384, help="score the text's first N tokens")
    p.add_argument("--results", type=Path, help="folder of the results files (default benchmark/results)")
    args = p.parse_args(argv)
    r = perplexities(args.export, args.model, args.text.read_text(), args.window, args.max_tokens)
    line = f"perplexity of {r['export']} ({r['quantization']}): {r['export_ppl']:.4f}"
    if "reference_ppl" in r:
        line += f"; {r['reference']} on {r['model']}: {r['reference_ppl']:.4f} (ratio {r['ratio']:.4f})"
    line += f" over {r['tokens']} tokens in {r['windows']} windows of {r['window']}"
    save(
        results_folder(args.results, smoke=False),
        f"perplexity-{datetime.date.today()}",
        r,
        ["# Perplexity", "", line],
        False,
    )
    print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
