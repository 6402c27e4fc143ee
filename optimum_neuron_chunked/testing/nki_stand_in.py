"""A stand-in for AWS's NKI attention kernel where no Neuron SDK is: `nki` (jit, the grid
subscript) and nkilib's attention_cte module in sys.modules, the kernel computing
`cte_semantics` - attention_cte's documented semantics (aws-neuron/nki-library 2.29_release,
src/nkilib_src/nkilib/core/attention/attention_cte.py), written down here independently of
backends/neuron/nki_kernels.py, which calls it:

- batch rows are heads: query row i reads K/V row i // (B / B_kv);
- layouts: q [B, Sq, d] (tp_q) or [B, d, Sq]; k and k_prior [B_kv, S, d] (tp_k) or
  [B_kv, d, S]; v and v_prior [B_kv, S, d]; the result [B, Sq, d], or [B, d, Sq] (tp_out);
- the prior's first prior_used_len[0] positions are visible (no prior: none) to every query, the active keys
  causally by index (position 0 at the chunk's start), a sliding window masks keys at
  distance >= window, a sink (B, 1) is one more logit of each row's softmax;
- float32 math, the result in q's dtype.
tests/nkilib_source_check.py runs AWS's own torch reference in its place.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

KERNEL_MODULE = "nkilib.core.attention.attention_cte"


def cte_semantics(q, k, v, scale=1.0, causal_mask=True, k_prior=None, v_prior=None, prior_used_len=None,
                  sink=None, sliding_window=None, tp_q=True, tp_k=False, tp_out=False, **_):  # fmt: skip
    query = (q if tp_q else q.transpose(1, 2)).float()
    k = k if tp_k else k.transpose(1, 2)
    if k_prior is None:  # no prior: the active keys alone
        k_prior, v_prior, prior_used_len = k[:, :0], v[:, :0], torch.zeros(1, dtype=torch.int32)
    elif not tp_k:
        k_prior = k_prior.transpose(1, 2)
    p = int(prior_used_len[0])
    keys = torch.cat([k_prior[:, :p], k], 1).float()
    values = torch.cat([v_prior[:, :p], v], 1).float()
    groups = query.shape[0] // keys.shape[0]
    keys, values = keys.repeat_interleave(groups, 0), values.repeat_interleave(groups, 0)
    scores = query @ keys.transpose(1, 2) * scale  # [B, Sq, p + S]
    distance = (torch.arange(keys.shape[1]) - p)[None] - torch.arange(query.shape[1])[:, None]
    masked = distance > 0 if causal_mask else torch.zeros_like(distance, dtype=torch.bool)
    if sliding_window:
        masked = masked | (distance <= -sliding_window)
    scores = scores.masked_fill(masked, float("-inf"))
    if sink is not None:
        scores = torch.cat([scores, sink.float()[:, None, :].expand(-1, query.shape[1], 1)], -1)
    out = scores.softmax(-1)[..., : keys.shape[1]] @ values
    return (out.transpose(1, 2) if tp_out else out).to(q.dtype)


class StandInKernel:
    """nki.jit(kernel): called as it is, or with a grid (`kernel[2](...)`); records its calls."""

    def __init__(self, fn: Callable):
        self.fn, self.calls = fn, []

    def __getitem__(self, grid) -> StandInKernel:
        return self

    def __call__(self, *args, **kwargs):
        self.calls.append(kwargs)
        return self.fn(*args, **kwargs)


@contextmanager
def installed(kernel: Callable = cte_semantics) -> Iterator[StandInKernel]:
    """sys.modules holds the stand-in `nki` and attention_cte module while inside; yields the
    jitted kernel NkiKernels will call."""
    from ..backends.neuron.nki_kernels import attention_cte

    nki, module = types.ModuleType("nki"), types.ModuleType(KERNEL_MODULE)
    jitted = StandInKernel(kernel)
    jitted.module = module  # a test may give it the kernel's limit constants (_MAX_BS, ...)
    nki.jit, module.attention_cte = (lambda fn: jitted), kernel
    saved = {name: sys.modules.get(name) for name in ("nki", KERNEL_MODULE)}
    sys.modules.update({"nki": nki, KERNEL_MODULE: module})
    attention_cte.cache_clear()
    try:
        yield jitted
    finally:
        for name, value in saved.items():
            if value is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = value
        attention_cte.cache_clear()
