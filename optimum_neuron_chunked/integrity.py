"""What an export's weight and graph files were when written: the size and SHA-256 of each,
recorded in neuron_config.json, so a truncated or corrupted copy (an interrupted transfer to
another host) is named instead of loaded.

Sizes are checked at every load. Graph files are hashed at every load too: they are native
code or compiled programs that may crash the process if damaged, and small beside the
weights. Weights are hashed on request (`from_pretrained(..., verify_weights=True)`): a
damaged weight file loads and computes wrong tokens, and hashing tens of GB costs seconds.

A `vllm serve` start checks the export in the front end's process and twice in the engine
core's (its config hook, then `load_model`): a process hashes a file once and reuses the digest
while the file's identity and stat are unchanged (`_digest_of`).
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from .config import CONFIG_NAME, InvalidExportError

FILES_KEY = "files"  # in neuron_config.json: {relative path: {"size": int, "sha256": str}}


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


# (resolved path, device, inode, size, mtime_ns, ctime_ns) -> SHA-256 hex digest.
_DIGESTS: dict[tuple, str] = {}
# A file modified less than this before its hashing started is not cached: file timestamps come
# from a coarse clock (one tick, up to 10 ms on Linux; seconds on some filesystems), so a same-size
# rewrite within one tick would leave the stat unchanged ("racily clean" files, as git calls
# them). Older files cannot change without mtime or ctime moving (utime sets ctime to now).
_SETTLED_NS = 2_000_000_000
_now_ns = time.time_ns


def _stat_key(path: Path) -> tuple:
    st = path.stat()
    return (str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _digest_of(path: Path) -> str:
    """`sha256_of(path)`, computed once per process while the file is unchanged."""
    key = _stat_key(path)
    if key in _DIGESTS:
        return _DIGESTS[key]
    settled = _now_ns() - max(key[4], key[5]) >= _SETTLED_NS
    digest = sha256_of(path)
    if settled and _stat_key(path) == key:  # unchanged while it was read
        _DIGESTS[key] = digest
    return digest


def record_files(folder: Path, names: list[str]) -> dict[str, dict]:
    return {
        name: {"size": (folder / name).stat().st_size, "sha256": sha256_of(folder / name)} for name in names
    }


def recorded_files(folder: Path) -> dict[str, dict]:
    """The records of an export (empty for one written before records existed)."""
    return json.loads((folder / CONFIG_NAME).read_text()).get(FILES_KEY, {})


def verify_files(folder: Path, records: dict[str, dict], hashed: set[str]) -> None:
    """Every recorded file has its recorded size; those in `hashed` their recorded SHA-256."""
    for name, record in records.items():
        path = folder / name
        size = path.stat().st_size if path.is_file() else None
        if size != record["size"]:
            found = "missing" if size is None else f"{size} bytes"
            raise _damaged(
                folder, name, f"{found}, {record['size']} when exported (truncated or incomplete copy?)"
            )
        if name in hashed and _digest_of(path) != record["sha256"]:
            raise _damaged(
                folder, name, "its SHA-256 differs from the one recorded at export (corrupted copy?)"
            )


def _damaged(folder: Path, name: str, what: str) -> InvalidExportError:
    return InvalidExportError(
        f"{folder / name} is damaged: {what}. Copy it again from the original export, or export again."
    )
