"""The embedded default job: build a small local checkpoint, export it chunked, generate with
the loader and with vLLM (the platform plugin), and compare with transformers.

python -m optimum_neuron_chunked.demo [--out demo-out] [--backend cpu]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from rich.console import Console


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="demo-out", help="work folder (checkpoint + export)")
    parser.add_argument("--backend", default="cpu", choices=("cpu", "eager"))
    parser.add_argument("--prompt", default="once upon a time there was a small model")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from exporters.neuron import export

    from .checkpoints import build_checkpoint
    from .loader import NeuronModelForCausalLM

    console = Console()
    work = Path(args.out)
    checkpoint = build_checkpoint("demo", work / "checkpoint")
    exported = work / f"export-{args.backend}-4x8x64"
    if not (exported / "neuron_config.json").is_file():
        export(
            str(checkpoint),
            exported,
            batch_size=4,
            sequence_length=512,
            prefill_chunk_size=64,
            backend=args.backend,
            overwrite=True,
        )
    started = time.perf_counter()
    model = NeuronModelForCausalLM.from_pretrained(exported)
    console.print(f"loaded {exported} in {time.perf_counter() - started:.1f}s")

    tokenizer = AutoTokenizer.from_pretrained(exported)
    # A prompt longer than one chunk, so generation really runs chunk by chunk.
    text = " ".join([args.prompt] * 12)
    input_ids = tokenizer(text, return_tensors="pt").input_ids
    started = time.perf_counter()
    output = model.generate(input_ids, max_new_tokens=args.max_new_tokens, do_sample=False)
    elapsed = time.perf_counter() - started
    new = output[0, input_ids.shape[1] :]
    console.print(f"prompt: {input_ids.shape[1]} tokens = {-(-input_ids.shape[1] // 64)} chunks of 64")
    console.print(f"generated {len(new)} tokens in {elapsed:.2f}s: {tokenizer.decode(new)!r}")

    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    expected = reference.generate(input_ids, max_new_tokens=args.max_new_tokens, do_sample=False)
    same = torch.equal(output, expected)
    console.print(f"greedy tokens equal transformers': [{'green' if same else 'red'}]{same}[/]")
    served = serve_with_vllm(exported, text, new.tolist(), args.max_new_tokens, console)
    return 0 if same and served else 1


def serve_with_vllm(exported: Path, text: str, expected: list[int], max_new_tokens: int, console) -> bool:
    """The same export through vLLM (the platform plugin): 6 prompts on 4 slots, chunk by chunk."""
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model=str(exported), seed=0)
    console.print(f"vLLM engine up in {time.perf_counter() - started:.1f}s")
    prompts = [text] + [" ".join(text.split()[: 5 * i + 1]) for i in range(1, 6)]
    started = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(max_tokens=max_new_tokens, temperature=0.0))
    console.print(f"vLLM: {len(prompts)} prompts in {time.perf_counter() - started:.2f}s")
    first = list(outputs[0].outputs[0].token_ids)
    same = first == expected[: len(first)] and len(first) > 0
    console.print(f"vLLM greedy tokens equal transformers': [{'green' if same else 'red'}]{same}[/]")
    llm.llm_engine.engine_core.shutdown()
    return same


if __name__ == "__main__":
    raise SystemExit(main())
