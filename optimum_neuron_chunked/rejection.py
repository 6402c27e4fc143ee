"""Rejection sampling of model-free drafts (n-gram, suffix), with vLLM's semantics, on the host.

vLLM's own `rejection_sample` (v1/sample/rejection_sampler.py) launches Triton kernels; 0.32
runs them on CPU only through C++ overrides that vLLM's CPU platform registers
(CpuPlatform.register_triton_kernel_overrides, utils/cpu_triton_utils.py), and 0.16.0 has no
CPU path at all. This is the same algorithm in torch ops, drawing its random numbers in
vLLM's order, so a seeded request gets vLLM's tokens (tests/test_rejection.py checks it
against 0.32's CPU path on identical inputs):

- uniforms: one float64 `rand` over every draft token, then each seeded request's own slice
  redrawn from its generator (requests without drafts draw nothing);
- rows are random (greedy rows accept drafts on the device's argmax: prompt_lookup.accept_greedy);
  with draft probability 1: the proposer is deterministic) accept draft d while
  p_target(d) >= u (u compared in float32, as 0.32's CPU kernel does); a rejection emits the
  recovered token argmax_v(p_target(v) / q_v) over the vocabulary less d, with q ~ Exp(1) drawn
  once per request (float32; seeded requests redraw theirs);
- a row whose every draft was accepted appends its bonus token (sampled from the position
  after the last draft by the ordinary sampler).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PLACEHOLDER = -1  # vLLM's PLACEHOLDER_TOKEN_ID: positions past a row's emitted tokens


@dataclass(frozen=True)
class Drafts:
    """The step's drafts, flattened as vLLM's SpecDecodeMetadata holds them."""

    token_ids: torch.Tensor  # [T] int64, every row's drafts back to back
    counts: tuple[int, ...]  # drafts per row (0: a row that only decodes)

    @classmethod
    def of(cls, per_row: list[list[int]]) -> Drafts:
        flat = [t for row in per_row for t in row]
        return cls(torch.tensor(flat, dtype=torch.int64), tuple(len(row) for row in per_row))

    def slices(self) -> list[slice]:
        out, start = [], 0
        for n in self.counts:
            out.append(slice(start, start + n))
            start += n
        return out


def draw_uniforms(drafts: Drafts, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """[T] float64 uniforms in vLLM's order (generate_uniform_probs)."""
    uniforms = torch.rand(len(drafts.token_ids), dtype=torch.float64)
    for row, rows in enumerate(drafts.slices()):
        if drafts.counts[row] and row in generators:
            uniforms[rows].uniform_(generator=generators[row])
    return uniforms


def draw_inverse_exponentials(
    drafts: Drafts, vocab: int, generators: dict[int, torch.Generator]
) -> torch.Tensor:
    """[rows, V] float32 1 / q, q ~ Exp(1), in vLLM's order (sample_recovered_tokens)."""
    q = torch.empty((len(drafts.counts), vocab), dtype=torch.float32).exponential_()
    for row, generator in generators.items():
        if drafts.counts[row]:
            q[row].exponential_(generator=generator)
    return q.reciprocal()


def rejection_sample(
    drafts: Drafts,
    target_logits: torch.Tensor,  # [T, V]: the target's logits at each draft, processed
    bonus: torch.Tensor,  # [rows]: the token sampled after each row's last draft
    generators: dict[int, torch.Generator],
) -> torch.Tensor:
    """[rows, max drafts + 1] int64 of random rows: each row's accepted drafts, then its
    recovered or bonus token, then PLACEHOLDER."""
    rows, width = len(drafts.counts), max(drafts.counts, default=0) + 1
    out = torch.full((rows, width), PLACEHOLDER, dtype=torch.int64)
    uniforms = draw_uniforms(drafts, generators)
    probs = target_logits.to(torch.float32).softmax(dim=-1)
    recovered = _recovered(drafts, probs, draw_inverse_exponentials(drafts, probs.shape[-1], generators))
    target = probs.gather(1, drafts.token_ids.clamp(min=0)[:, None])[:, 0]
    accepted_by = (drafts.token_ids >= 0) & (target >= uniforms.to(torch.float32))
    for row, span in enumerate(drafts.slices()):
        _write_row(out[row], drafts.token_ids[span], accepted_by[span], recovered[span], bonus[row])
    return out


def _recovered(drafts: Drafts, probs: torch.Tensor, inv_q: torch.Tensor) -> torch.Tensor:
    """[T] argmax over the vocabulary less the draft of p_target * (1 / q) of the row."""
    row_of = torch.repeat_interleave(torch.arange(len(drafts.counts)), torch.tensor(drafts.counts))
    weighted = probs.scatter(1, drafts.token_ids.clamp(min=0)[:, None], 0.0) * inv_q[row_of]
    return weighted.argmax(dim=-1)


def _write_row(
    out: torch.Tensor, ids: torch.Tensor, accepted: torch.Tensor, emitted: torch.Tensor, bonus
) -> None:
    n = len(ids)
    first_rejected = int(torch.nonzero(~accepted)[0]) if not bool(accepted.all()) else n
    out[:first_rejected] = ids[:first_rejected]
    out[first_rejected] = emitted[first_rejected] if first_rejected < n else bonus


def accepted_tokens(out: torch.Tensor) -> list[list[int]]:
    """Each row's emitted tokens (vLLM's RejectionSampler.parse_output, without the vocab check)."""
    return [[t for t in row if t != PLACEHOLDER] for row in out.tolist()]
