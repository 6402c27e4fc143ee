"""On a Neuron host: export a test checkpoint with the neuron backend, load it, generate and
compare greedy tokens with transformers. One process per run: a Neuron runtime that loaded
a model of one tp degree cannot load another in the same process.

    python tests/neuron_e2e.py --family llama --tp 2 --chunk 32 [--vllm] [--quantization int8|fp8]
    python tests/neuron_e2e.py --attention-kernel   # nkilib attention_cte against the reference
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from fixtures.export_models import checkpoint_path  # noqa: E402
from helpers import fake_quantize  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

BATCH, SEQ = 2, 128


def prompts(chunk: int) -> list[list[int]]:
    lengths = [1, chunk - 1, chunk + 1, 3 * chunk + 5] if chunk else [1, 17, 64, 101]
    return [[4 + (7 * i + n) % 300 for i in range(n)] for n in lengths]


def hf_tokens(family: str, prompt: list[int], new: int, quantization: str = "") -> list[int]:
    """A plain argmax loop: eos does not stop it, as with vLLM's ignore_eos; `quantization`:
    on the weights helpers.quantization_rule gives."""
    hf = AutoModelForCausalLM.from_pretrained(checkpoint_path(family), dtype=torch.float32).eval()
    if quantization:
        fake_quantize(hf, quantization)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(new):
            ids = torch.cat([ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt) :].tolist()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", default="llama")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=32, help="0: standard export")
    parser.add_argument("--vllm", action="store_true", help="generate through vllm.LLM instead")
    parser.add_argument("--quantization", default="", help="int8 / fp8 weights: transformers on the same")
    parser.add_argument(
        "--attention-kernel", action="store_true", help="a kernel-sized bf16 model: nki against reference"
    )
    parser.add_argument(
        "--backend",
        default="neuron",
        help="eager/cpu/xla (tp 1) to check this script off device; xla in the SDK-mirror environment runs the neuron graphs on torch-xla",
    )
    args = parser.parse_args()
    if args.attention_kernel:
        return check_attention_kernel(args.backend)
    from optimum_neuron_chunked.export.pipeline import export

    new = 8
    with tempfile.TemporaryDirectory() as tmp:
        out = export(
            str(checkpoint_path(args.family)),
            Path(tmp) / "out",
            batch_size=BATCH,
            sequence_length=SEQ,
            prefill_chunk_size=args.chunk,
            backend=args.backend,
            tp_degree=args.tp,
            context_buckets=(64, 128),
            quantization=args.quantization,
        )
        if args.vllm:
            from vllm import LLM, SamplingParams

            llm = LLM(model=str(out), max_num_seqs=BATCH, max_model_len=SEQ)
            params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
            results = llm.generate([{"prompt_token_ids": p} for p in prompts(args.chunk)], params)
            got = [r.outputs[0].token_ids for r in results]
        else:
            from optimum_neuron_chunked import NeuronModelForCausalLM

            model = NeuronModelForCausalLM.from_pretrained(out)
            got = [
                model.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False, eos_token_id=[])[
                    0, len(p) :
                ].tolist()
                for p in prompts(args.chunk)
            ]
    failures = 0
    for prompt, tokens in zip(prompts(args.chunk), got, strict=True):
        expected = hf_tokens(args.family, prompt, new, args.quantization)
        ok = list(tokens) == expected
        failures += not ok
        print(f"prompt {len(prompt):4d}: {'ok' if ok else 'MISMATCH'} {list(tokens)} vs HF {expected}")
    return 1 if failures else 0


KERNEL_SIZED = dict(model_type="llama", hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=128, vocab_size=512,
                    initializer_range=0.05, tie_word_embeddings=False)  # fmt: skip


def check_attention_kernel(backend: str) -> int:
    """bf16 exports of a kernel-sized model (head_dim 128, buckets 512 and 1024, chunks of 256)
    with --attention-kernel nki and reference: a 900-token prompt's last logits, each against
    transformers in fp32; the kernel's error within 1.5x the reference's."""
    from optimum_neuron_chunked import NeuronModelForCausalLM
    from optimum_neuron_chunked.export.pipeline import export
    from optimum_neuron_chunked.generation import prefill_prompt
    from optimum_neuron_chunked.testing.checkpoints import build_checkpoint

    ids = torch.randint(4, 500, (900,), generator=torch.Generator().manual_seed(1))
    with tempfile.TemporaryDirectory() as tmp:
        path = build_checkpoint("kernel", Path(tmp) / "ckpt", config=KERNEL_SIZED)
        with torch.no_grad():
            truth = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(ids[None]).logits[0, -1]
        errors = {}
        for kernel in ("nki", "reference"):
            out = export(str(path), Path(tmp) / kernel, batch_size=1, sequence_length=1024, prefill_chunk_size=256,
                         context_buckets=(512, 1024), dtype="bfloat16", backend=backend, attention_kernel=kernel)  # fmt: skip
            logits = prefill_prompt(NeuronModelForCausalLM.from_pretrained(out).runner, ids, (0,)).float()
            errors[kernel] = float((logits - truth).abs().max() / truth.abs().max())
    ok = errors["nki"] <= 1.5 * errors["reference"]
    print(f"{'ok' if ok else 'MISMATCH'}: error against fp32 transformers {errors}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
