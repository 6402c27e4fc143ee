"""The host side of EAGLE3 drafts (modeling/eagle3.py): the rows a draft call repeats from the
CP or VF call before it, a verify row shifted, and the draft graph that holds the call."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .config import NeuronConfig
from .graphs import GraphSpec, draft_spec
from .modeling.eagle3 import chain_top


class CalledRows(NamedTuple):
    """A CP or VF call as an EAGLE3 draft call after it takes it (graph_runner.GraphRunner.verify,
    `last_chunk`): the aux states it left are in the graph's row order and padding, so the draft
    call repeats its rows' lengths, starts and blocks."""

    spec: GraphSpec
    token_rows: list[torch.Tensor]
    starts: list[int]
    blocks: list
    adapters: list[int] | None
    unsort: torch.Tensor  # the graph's rows back to the caller's order
    call: int  # GraphRunner's count of graph calls when it ran


def shifted(tokens: torch.Tensor, next_token: int) -> torch.Tensor:
    """THE shift rule: a call's tokens as the head drafts from them - shifted left by one, the
    token that follows them last (the head's pass at position p reads the token at p + 1)."""
    return torch.cat([tokens[1:], tokens.new_tensor([int(next_token)])])


def shifted_rows(token_rows: list[torch.Tensor], next_tokens, accepted) -> list[torch.Tensor]:
    """Verify rows shifted, each row's next token (the bonus or correction) also at its last
    accepted index (vLLM's padded drafter batch: the entries past the accepted ones are
    rejected drafts, whose head K/V later passes rewrite)."""
    rows = []
    for tokens, token, last_index in zip(token_rows, next_tokens, accepted, strict=True):
        row = shifted(tokens, token)
        row[int(last_index)] = int(token)
        rows.append(row)
    return rows


def draft_graph(
    config: NeuronConfig, called: CalledRows, rows: list[torch.Tensor], last_index: list[int]
) -> tuple[GraphSpec, torch.Tensor]:
    """(The DC / DV graph after `called`, each row's last position it writes): the rows' own
    positions, then the chain from each row's `last_index` (modeling/eagle3.chain_top). Its
    bucket holds them all; its rows and width are `called`'s."""
    k, length = config.speculation_length, config.sequence_length
    tops = torch.tensor(
        [
            max(s + len(r) - 1, chain_top(s + i, k, length))
            for s, r, i in zip(called.starts, rows, last_index, strict=True)
        ]
    )
    return draft_spec(called.spec, config.bucket_for(int(tops.max()) + 1)), tops
