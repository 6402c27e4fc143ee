"""HF transformers references for the exports' generations."""

from __future__ import annotations

from pathlib import Path

import torch

from ..quantized_checkpoint import source_quantization


def hf_greedy(hf, ids: torch.Tensor, n: int, repetition_penalty: float | None = None) -> list[int]:
    """HF's greedy continuation that, like vLLM's ignore_eos, neither stops at nor avoids eos."""
    from transformers import RepetitionPenaltyLogitsProcessor

    penalty = RepetitionPenaltyLogitsProcessor(repetition_penalty) if repetition_penalty else None
    seq, past, step_ids = ids[None], None, ids[None]
    with torch.no_grad():
        for _ in range(n):
            out = hf(step_ids, past_key_values=past, use_cache=True)
            logits, past = out.logits[:, -1].float(), out.past_key_values
            if penalty is not None:
                logits = penalty(seq, logits)
            step_ids = logits.argmax(-1, keepdim=True)
            seq = torch.cat([seq, step_ids], dim=1)
    return seq[0, ids.shape[0] :].tolist()


def transformers_weight_only(model: str | Path, dtype: torch.dtype = torch.float32):
    """transformers running a checkpoint as the export computes it -> (model, what it is): an
    FP8 checkpoint through transformers' own weight-only dequantization (FineGrainedFP8Config /
    CompressedTensorsConfig(dequantize=True), compressed-tensors' activation and KV fake
    quantization off: compressed_tensors.quantization.disable_quantization), others as they are."""
    from transformers import AutoConfig, AutoModelForCausalLM

    source = source_quantization(AutoConfig.from_pretrained(model))
    if source is None or not source.fp8:
        return AutoModelForCausalLM.from_pretrained(model, dtype=dtype).eval(), "transformers"
    if source.method == "fp8":
        from transformers import FineGrainedFP8Config as Dequantized
    else:
        from transformers import CompressedTensorsConfig as Dequantized
    hf = AutoModelForCausalLM.from_pretrained(
        model, dtype=dtype, quantization_config=Dequantized(dequantize=True)
    )
    if source.method == "compressed-tensors":
        from compressed_tensors.quantization import disable_quantization

        hf.apply(disable_quantization)
    return hf.eval(), "transformers, FP8 weights dequantized (weight-only)"
