"""Prompt-lookup drafts (n-gram speculation) for the loader's generate(), without vLLM: the
tokens that followed the latest earlier occurrence of the sequence's last n tokens, the
longest n from `max_n` down to `min_n` that occurred before (transformers' prompt lookup
decoding, `prompt_lookup_num_tokens`; vLLM's n-gram proposer serves the same under vLLM)."""

from __future__ import annotations


def propose(tokens: list[int], k: int, min_n: int = 1, max_n: int = 3) -> list[int]:
    """Up to `k` drafts continuing `tokens` (none where no suffix n-gram occurred before)."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def accept_greedy(drafts: list[int], argmax: list[int]) -> list[int]:
    """Drafts accepted while they equal the target's argmax, then the argmax after them (vLLM's
    greedy rejection rule, v1/sample/rejection_sampler.py): 1 to len(drafts) + 1 tokens."""
    n = 0
    while n < len(drafts) and drafts[n] == argmax[n]:
        n += 1
    return drafts[:n] + [argmax[n]]
