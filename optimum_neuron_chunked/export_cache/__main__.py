"""python -m optimum_neuron_chunked.export_cache list | rm ENTRY... | rm --all"""

from __future__ import annotations

import argparse
import sys

from .store import cache_root, entries, entry_digest, remove


def _size(folder) -> str:
    total = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    return f"{total / 2**30:.2f} GiB" if total >= 2**29 else f"{total / 2**20:.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m optimum_neuron_chunked.export_cache", description=__doc__
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the cached exports")
    rm = sub.add_parser("rm", help="remove cached exports")
    rm.add_argument("entries", nargs="*", help="entry names (or their key) as `list` shows them")
    rm.add_argument("--all", action="store_true", help="remove every entry")
    args = parser.parse_args(argv)
    found = entries()
    if args.command == "list":
        print(f"{cache_root()}: {len(found)} entries")
        for folder, record in found:
            source, options = record.get("source", {}), record.get("options", {})
            where = source.get("commit", "")[:12] or "local"
            shape = f"B={options.get('batch_size')} S={options.get('sequence_length')} C={options.get('prefill_chunk_size', 0)}"
            print(f"{folder.name}  {where}  {options.get('backend')} {options.get('dtype')} {shape}  "
                  f"{_size(folder)}  {record.get('created', '?')}")  # fmt: skip
        return 0
    if not args.entries and not args.all:
        parser.error("rm: name entries, or pass --all")
    names = [f.name for f, _ in found] if args.all else args.entries
    removed = remove(names)
    for folder in removed:
        print(f"removed {folder}")
    unknown = set(args.entries) - {f.name for f in removed} - {entry_digest(f) for f in removed}
    if unknown:
        print(f"no such entries: {', '.join(sorted(unknown))}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
