"""HF transformers references for the exports' generations."""

from __future__ import annotations

import torch


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
