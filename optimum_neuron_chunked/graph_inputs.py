"""A graph call's row inputs, built once: GraphRunner feeds it real rows, graphs.example_inputs
example rows (the shapes a graph is traced with).

A row is token ids [T_i] at positions starts[i].. and its KV blocks in position order; rows
become [rows, width] token ids and positions and [rows, ceil(W / P)] block tables (block_table),
padded by the one rule (pad_repeat_last), integers INDEX_DTYPE. LoRA exports add each row's
adapter slot as one more column of its table (modeling/lora.with_adapter_column)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .modeling.lora import with_adapter_column

# Every backend's integer inputs: the Neuron runtime takes int32 (graphs.py)
INDEX_DTYPE = torch.int32


def pad_repeat_last(x: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """The padding rule, the only one: repeat the last entry along `dim` up to `length`.

    Applied to a chunk's tokens and positions, padded copies are exact duplicates of the last
    real token (see modeling/kv_cache.py); applied to decode rows, padded rows repeat the
    last real row and so rewrite exactly what it writes.
    """
    missing = length - x.shape[dim]
    if missing < 0:
        raise ValueError(f"{x.shape[dim]} entries do not fit a graph dimension of {length}")
    if missing == 0:
        return x
    last = x.narrow(dim, x.shape[dim] - 1, 1)
    return torch.cat([x, last.expand(*[missing if d == dim else -1 for d in range(x.dim())])], dim=dim)


def block_table(rows: Sequence[Sequence[int]], columns: int) -> torch.Tensor:
    """THE block-table builder: [N, columns] int32 block ids of N requests, each row its blocks
    in position order cut to `columns`, or padded by the one rule (its last block repeated:
    modeling/kv_cache.py) - once, at the width of the graph that reads it."""
    return torch.stack(
        [pad_repeat_last(torch.tensor(r[:columns], dtype=INDEX_DTYPE)[None], columns, dim=1)[0] for r in rows]
    )


def row_inputs(
    rows: int,
    width: int,
    columns: int,
    token_rows: Sequence[torch.Tensor],
    starts: Sequence[int],
    blocks: Sequence[Sequence[int]],
    slots: Sequence[int] | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Rows (module docstring), longest context first, padded to `rows` of `width` tokens with
    `columns` blocks; `slots`: each row's adapter slot (None: no adapter column, lora.row_slots)
    -> ([token ids, positions, block tables or tables_and_slot], that order of the rows)."""
    ends = torch.tensor([s + len(t) for s, t in zip(starts, token_rows, strict=True)])
    order = torch.argsort(ends, descending=True, stable=True)
    ids, pos = [], []
    for i in order.tolist():
        span = torch.arange(starts[i], int(ends[i]), dtype=INDEX_DTYPE)
        ids.append(pad_repeat_last(token_rows[i].to(INDEX_DTYPE)[None], width, dim=1)[0])
        pos.append(pad_repeat_last(span[None], width, dim=1)[0])
    tables = block_table([blocks[i] for i in order.tolist()], columns)
    slot_column = None if slots is None else torch.tensor(slots, dtype=INDEX_DTYPE)[order]
    table_input = tables if slot_column is None else with_adapter_column(tables, slot_column)
    return [pad_repeat_last(x, rows, dim=0) for x in (torch.stack(ids), torch.stack(pos), table_input)], order


def last_index_input(last_index: Sequence[int], order: torch.Tensor, rows: int) -> torch.Tensor:
    """A draft call's (DC / DV) last input: each row's index drafted from (modeling/eagle3.propose),
    in row_inputs' `order` of the rows, padded to `rows` by the one rule."""
    return pad_repeat_last(torch.tensor(last_index, dtype=INDEX_DTYPE)[order], rows, dim=0)
