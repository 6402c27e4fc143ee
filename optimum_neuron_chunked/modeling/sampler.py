"""Sampling as a static-shape graph: greedy, top-k, top-p and temperature.

The random numbers come from the host (one uniform per row), so a seeded host generator
makes sampling reproducible on any backend. Candidates are limited to the `max_topk`
highest logits: a request asking for more (or top_k <= 0 = whole vocabulary) samples from
those max_topk, as on-device samplers do.
"""

from __future__ import annotations

import torch

from ..config import ceil_div
from .layers import MASK_VALUE

# sampling_params columns
TOP_K, TOP_P, TEMPERATURE = 0, 1, 2


def sampling_params(top_k: int = 0, top_p: float = 1.0, temperature: float = 1.0) -> list[float]:
    """One row of the [N, 3] sampling_params input; temperature 0 means greedy."""
    return [float(top_k), float(top_p), float(temperature)]


def sample(logits: torch.Tensor, params: torch.Tensor, rand: torch.Tensor, max_topk: int) -> torch.Tensor:
    """logits [N, V] float, params [N, 3], rand [N] uniform in [0, 1) -> tokens [N] int64."""
    greedy = torch.argmax(logits, dim=-1)
    k = min(max_topk, logits.shape[-1])
    top_logits, top_ids = staged_topk(logits, k)  # sorted, descending
    top_k = params[:, TOP_K : TOP_K + 1]
    top_k = torch.where((top_k <= 0) | (top_k > k), torch.full_like(top_k, k), top_k)
    temperature = params[:, TEMPERATURE : TEMPERATURE + 1]
    ranks = torch.arange(k, device=logits.device)[None, :]
    scaled = top_logits / temperature.clamp(min=1e-6)
    scaled = torch.where(ranks < top_k, scaled, MASK_VALUE)
    probs = torch.softmax(scaled, dim=-1)
    cumulative = torch.cumsum(probs, dim=-1)
    # top-p keeps the smallest prefix whose mass reaches top_p (always at least the first)
    keep = (cumulative - probs) < params[:, TOP_P : TOP_P + 1]
    probs = torch.where(keep, probs, 0.0)
    cumulative = torch.cumsum(probs, dim=-1)
    threshold = rand[:, None] * cumulative[:, -1:]
    index = (cumulative <= threshold).sum(dim=-1, keepdim=True).clamp(max=k - 1)
    sampled = torch.gather(top_ids, 1, index)[:, 0]
    is_greedy = (temperature[:, 0] <= 0) | (top_k[:, 0] == 1)
    return torch.where(is_greedy, greedy, sampled)


def staged_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(x, k) over the last dim of [N, V], without sorting all V entries at once.

    On XLA, top-k lowers to a sort of the whole row (a 128k-entry sort per decode step for a
    large vocabulary). Instead: the top k of each of G groups of the vocabulary, then the
    top k of those G*k candidates - the two-level scheme neuronx-distributed's
    operators/topk.py (Release 2.29) runs across tensor-parallel vocabulary shards. G is
    chosen so both sorts are about sqrt(V * k) wide. Same values and ids as torch.topk.
    """
    n, v = x.shape
    groups = stage_groups(v, k)
    if groups == 1:
        return torch.topk(x, k, dim=-1)
    width = ceil_div(v, groups)
    padded = (
        torch.cat([x, x.new_full((n, groups * width - v), MASK_VALUE)], dim=-1) if groups * width > v else x
    )
    values, ids = torch.topk(padded.view(n, groups, width), k, dim=-1)  # [N, G, k]
    ids = ids + torch.arange(0, groups * width, width, device=x.device)[None, :, None]
    values, picked = torch.topk(values.reshape(n, groups * k), k, dim=-1)
    return values, torch.gather(ids.reshape(n, groups * k), 1, picked)


def stage_groups(vocab: int, k: int) -> int:
    """Groups of the first top-k stage: 1 (a plain top-k) unless splitting shortens the sort."""
    groups = int(round((vocab / k) ** 0.5))
    return groups if groups >= 2 and ceil_div(vocab, groups) >= k else 1
