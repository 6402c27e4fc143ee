"""The host side of EAGLE3 drafts (modeling/eagle3.py): the rows a draft call repeats from the
CP or VF call before it, a verify row shifted, and the draft graph that holds the call."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .config import NeuronConfig
from .graphs import GraphKind, GraphSpec, dc_spec, dv_spec


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


def shifted_rows(token_rows: list[torch.Tensor], next_tokens, accepted) -> list[torch.Tensor]:
    """Verify rows' tokens shifted left by one, each row's next token (the bonus or correction)
    at its last accepted index and at its end (vLLM's padded drafter batch: the entries past the
    accepted ones are rejected drafts, whose head K/V later passes rewrite)."""
    rows = []
    for tokens, token, last in zip(token_rows, next_tokens, accepted, strict=True):
        row = torch.cat([tokens[1:], tokens.new_tensor([int(token)])])
        row[int(last)] = int(token)
        rows.append(row)
    return rows


def draft_graph(
    config: NeuronConfig, called: CalledRows, rows: list[torch.Tensor], last: list[int]
) -> tuple[GraphSpec, torch.Tensor]:
    """(The DC / DV graph after `called`, each row's last position it writes): the rows' own
    positions, then K - 1 past each row's `last` - at most S - 1 (modeling/eagle3.propose clamps
    the chain there). Its bucket holds them all; its rows and width are `called`'s."""
    k, end = config.speculation_length, config.sequence_length - 1
    tops = torch.tensor(
        [
            min(max(s + len(r) - 1, s + a + k - 1), end)
            for s, r, a in zip(called.starts, rows, last, strict=True)
        ]
    )
    bucket, spec = config.bucket_for(int(tops.max()) + 1), called.spec
    if spec.kind is GraphKind.VF:
        return dv_spec(config, spec.batch, bucket), tops
    return dc_spec(config, spec.width, bucket), tops
