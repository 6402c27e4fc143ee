"""Before/after of graph code on the same shapes: CP or TG calls of two exports, interleaved in one
process (this machine's speed drifts by 20-30 % between runs minutes apart, so separate runs
cannot show a 5-10 % change). An export keeps the graphs it was compiled with, so the
"before" folder is one exported by the older code (benchmark exports are keyed by it).

    python benchmark/ab_exports.py BEFORE_DIR AFTER_DIR [--calls 16] [--tokens T] [--end P] [--tag NAME]
    python benchmark/ab_exports.py BEFORE_DIR AFTER_DIR --decode 1900,300,... [--calls 16] [--tag NAME]
    python benchmark/ab_exports.py BEFORE_DIR AFTER_DIR --mixed 1900,300,... [--end P] [--tag NAME]

--tokens: the chunk's real tokens (default the chunk size); --end: the position after its last
token (default the sequence length: the largest bucket, read whole). --decode: a TG step
instead, one row per listed context length (slots 0, 1, ...: a row decodes at position
length - 1, its context written first), the rest of the batch padding. --mixed: a mixed step, the decode rows of --decode
with a full chunk ending at --end in the next slot: BEFORE runs TG then CP (two calls), AFTER
one MX call (a --mixed-step export; the same folder may be both).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from metrics import interleaved_ms, save_results, spread_cell  # noqa: E402

from optimum_neuron_chunked import NeuronModelForCausalLM  # noqa: E402


def seq_id(model: NeuronModelForCausalLM, row: int) -> int | list[int]:
    """Row `row`'s KV: its slot, or on a paged export a slot's worth of pool blocks (1, 2, ...:
    block 0 is the null block), so that a paged export is timed on the slot export's layout."""
    config = model.neuron_config
    if not config.kv_cache_blocks:
        return row
    per_row = config.sequence_length // config.kv_block_size
    if (row + 1) * per_row > config.kv_cache_blocks:
        raise SystemExit(f"the pool of {config.kv_cache_blocks} blocks holds fewer than {row + 1} rows")
    return list(range(1 + row * per_row, 1 + (row + 1) * per_row))


def seq_ids(model: NeuronModelForCausalLM, rows: int) -> torch.Tensor:
    """The slots [N] or block tables [N, M] of rows 0 .. rows - 1."""
    return torch.tensor([seq_id(model, row) for row in range(rows)])


def interleaved_prefill_ms(
    folders: dict[str, Path], calls: int, tokens: int | None = None, end: int | None = None
) -> dict[str, list[float]]:
    """One chunk of `tokens` ending before position `end`, each export in turn, each call on
    the next slot; the first round is untimed (lazy init)."""
    models = {name: NeuronModelForCausalLM.from_pretrained(f) for name, f in folders.items()}
    configs = (
        {m.neuron_config.prefill_chunk_size for m in models.values()},
        {m.neuron_config.sequence_length for m in models.values()},
    )
    if any(len(c) != 1 for c in configs):
        raise SystemExit(f"the exports differ in shape (chunk sizes, lengths): {configs}")
    width, seq = (c.pop() for c in configs)
    batch = min(m.neuron_config.batch_size for m in models.values())
    tokens, end = tokens or width, end or seq
    ids = torch.randint(4, 1000, (tokens,), generator=torch.Generator().manual_seed(0))
    rows = {name: [seq_id(model, row) for row in range(batch)] for name, model in models.items()}
    prefill = {
        name: lambda i, m=model, r=rows[name]: m.runner.prefill(ids, end - tokens, r[i % batch])
        for name, model in models.items()
    }
    return interleaved_ms(prefill, calls)


def write_contexts(model: NeuronModelForCausalLM, contexts: list[int]) -> None:
    """Prefill slot i with contexts[i] - 1 tokens, chunk by chunk: a decode step then attends
    over a real prompt's K/V, as in serving, not over the zeros of a fresh cache."""
    width = model.neuron_config.prefill_chunk_size or model.neuron_config.sequence_length
    for slot, length in enumerate(contexts):
        ids = torch.randint(4, 1000, (length - 1,), generator=torch.Generator().manual_seed(slot))
        for start in range(0, length - 1, width):
            model.runner.prefill(ids[start : start + width], start, seq_id(model, slot))


def interleaved_decode_ms(
    folders: dict[str, Path], calls: int, contexts: list[int]
) -> dict[str, list[float]]:
    """One TG step of rows at `contexts` (one per slot, written first), each export in turn;
    first round untimed."""
    models = {name: NeuronModelForCausalLM.from_pretrained(f) for name, f in folders.items()}
    for model in models.values():
        write_contexts(model, contexts)
    rows = len(contexts)
    ids = torch.randint(4, 1000, (rows,), generator=torch.Generator().manual_seed(0))
    positions = torch.tensor(contexts) - 1
    params, rand = torch.tensor([[1.0, 1.0, 1.0]] * rows), torch.zeros(rows)  # greedy (top-k 1)
    tables = {name: seq_ids(model, rows) for name, model in models.items()}  # built once, not timed
    decode = {
        name: lambda _i, m=model, t=tables[name]: m.runner.decode(
            ids, positions, t, params, rand, need_logits=False
        )
        for name, model in models.items()
    }
    return interleaved_ms(decode, calls)


def interleaved_mixed_ms(
    folders: dict[str, Path], calls: int, contexts: list[int], end: int | None
) -> dict[str, list[float]]:
    """A mixed step, each export in turn: "before" as TG + CP calls, "after" as one MX call."""
    models = {name: NeuronModelForCausalLM.from_pretrained(f) for name, f in folders.items()}
    for model in models.values():
        write_contexts(model, contexts)
    rows, width = len(contexts), models["after"].neuron_config.prefill_chunk_size
    end = end or models["after"].neuron_config.sequence_length
    ids = torch.randint(4, 1000, (rows,), generator=torch.Generator().manual_seed(0))
    chunk = torch.randint(4, 1000, (width,), generator=torch.Generator().manual_seed(1))
    positions = torch.tensor(contexts) - 1
    params, rand = torch.tensor([[1.0, 1.0, 1.0]] * rows), torch.zeros(rows)  # greedy (top-k 1)
    before, after = models["before"].runner, models["after"].runner
    # the decode rows' tables and the chunk's row, built once (not inside the timed calls)
    tables = {name: seq_ids(model, rows) for name, model in models.items()}
    chunk_row = {name: seq_id(model, rows) for name, model in models.items()}

    def separate(_i):
        before.decode(ids, positions, tables["before"], params, rand, need_logits=False)
        return before.prefill(chunk, end - width, chunk_row["before"])

    def fused(_i):
        return after.decode_with_chunk(
            ids, positions, tables["after"], params, rand, chunk, end - width, chunk_row["after"], False
        )

    return interleaved_ms({"before": separate, "after": fused}, calls)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("before", type=Path)
    p.add_argument("after", type=Path)
    p.add_argument("--calls", type=int, default=16)
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--end", type=int, default=None)
    p.add_argument("--decode", help="TG rows' context lengths, comma-separated (one row per slot)")
    p.add_argument("--mixed", help="as --decode, with a full chunk ending at --end in one MX call (after)")
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    folders = {"before": args.before, "after": args.after}
    if args.mixed:
        contexts = [int(n) for n in args.mixed.split(",")]
        times = interleaved_mixed_ms(folders, args.calls, contexts, args.end)
        what = (
            f"mixed steps: {len(contexts)} decode rows at contexts {contexts} and a full chunk ending at "
            f"{args.end or 'S'}; before TG + CP calls, after one MX call"
        )
    elif args.decode:
        contexts = [int(n) for n in args.decode.split(",")]
        times = interleaved_decode_ms(folders, args.calls, contexts)
        what = f"TG calls: a decode step of {len(contexts)} rows at contexts {contexts}"
    else:
        times = interleaved_prefill_ms(folders, args.calls, args.tokens, args.end)
        what = f"CP calls: a chunk of {args.tokens or 'C'} tokens ending at position {args.end or 'S'}"
    date = datetime.date.today().isoformat()
    lines = [f"# Two exports interleaved ({date}, {platform.node()})", "",
             f"before: `{args.before.name}`", f"after: `{args.after.name}`", "",
             f"{what}; median [min-max] of {args.calls} calls each.", "", "| export | ms per call |",
             "|---|---|"]  # fmt: skip
    for name, t in times.items():
        lines.append(f"| {name} | {spread_cell(t)} |")
    ratio = statistics.median(times["after"]) / statistics.median(times["before"])
    lines += ["", f"after / before: {ratio:.3f}"]
    out = HERE / "results" / f"ab-{date}-vm{'-' + args.tag if args.tag else ''}"
    save_results(out, {"folders": [str(args.before), str(args.after)], "ms": times}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
