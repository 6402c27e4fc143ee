"""Helpers shared by the tests: prompts, transformers references, vLLM request shorthands."""

from __future__ import annotations

import torch

from optimum_neuron_chunked.config import NeuronConfig

NEW_TOKENS = 10


def prompt(n: int, seed: int = 0) -> torch.Tensor:
    # ids 4.. skip the special tokens (eos would end generation early)
    return torch.randint(4, 380, (n,), generator=torch.Generator().manual_seed(1000 * seed + n))


def greedy(n: int = NEW_TOKENS, **kwargs):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kwargs)


def hf_greedy(
    hf, ids: torch.Tensor, n: int = NEW_TOKENS, repetition_penalty: float | None = None
) -> list[int]:
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


def generate(llm, prompts: list[torch.Tensor], params) -> list:
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p.tolist()} for p in prompts], params)]


class RecordingGraphs(dict):
    """The loaded graphs, recording which ran."""

    def __init__(self, graphs):
        super().__init__(graphs)
        self.ran = []

    def __getitem__(self, name):
        self.ran.append(name)
        return super().__getitem__(name)


def small_neuron_config(tp: int = 1, **fields) -> NeuronConfig:
    """A chunked neuron export of the tiny shapes the NxD checks trace (trn1, C=16, S=64)."""
    shapes = dict(
        batch_size=2,
        sequence_length=64,
        prefill_chunk_size=16,
        context_buckets=(32, 64),
        backend="neuron",
        instance_type="trn1",
        tp_degree=tp,
    )
    return NeuronConfig(**(shapes | fields))


def every_graph_kind(tp: int = 1) -> dict[str, NeuronConfig]:
    """Configs whose graph sets hold every kind of graph and every input count: CP (narrow
    and full), CE, TG (narrow and full, with and without sampling), MX (with and without
    sampling), copy, prompt logits. tests/nxd_source_check.py traces them with NxD."""
    return {
        "chunked": small_neuron_config(
            tp, prefill_widths=(4, 16), decode_widths=(1, 2), mixed_step=True, prompt_logits=True
        ),
        "chunked-host-sampling": small_neuron_config(tp, mixed_step=True, on_device_sampling=False),
        "standard": small_neuron_config(tp, prefill_chunk_size=0, decode_widths=(1, 2)),
    }
