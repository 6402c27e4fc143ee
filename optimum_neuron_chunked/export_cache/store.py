"""The export cache: finished exports of plain checkpoints, found again by key.

Layout under the root (ONC_EXPORT_CACHE, default $HF_HOME/optimum-neuron-chunked/exports):
  <name>-<key>/          a finished export (what vLLM serves), with cache_entry.json
  .staging/<key>-<pid>/  an export being built: never mistaken for an entry, removed by the
                         next build of its key if its builder died
  <key>.lock             flock'ed while an entry is looked up and built
A build runs under the key's lock (the kernel frees it if the holder dies, on local disks and
on shared filesystems with working flock: EFS, NFSv4, FSx), so concurrent starts build one
export and the others wait, then reuse it. The entry is published by one rename. An entry that
fails check_export is removed and built again.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..export_folder import InvalidExportError, check_export
from ..version import __version__
from .source import weight_bytes

ENV = "ONC_EXPORT_CACHE"
ENTRY_FILE = "cache_entry.json"
STAGING = ".staging"
logger = logging.getLogger(__name__)


class ExportCacheError(RuntimeError):
    """The cache cannot hold a new export; the message says what to free or change."""


def cache_root() -> Path:
    if os.environ.get(ENV):
        return Path(os.environ[ENV]).expanduser()
    from huggingface_hub.constants import HF_HOME

    return Path(HF_HOME) / "optimum-neuron-chunked" / "exports"


@dataclass(frozen=True)
class EntryKey:
    """Everything that shapes an export: the source's identity, every export option (host
    fields resolved), the export format and the toolchain that compiles the graphs."""

    source: dict
    options: dict
    toolchain: dict

    def fields(self) -> dict:
        return {"source": self.source, "options": self.options, "toolchain": self.toolchain,
                "format": __version__}  # fmt: skip

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.fields(), sort_keys=True).encode()).hexdigest()[:20]

    @property
    def name(self) -> str:
        return f"{re.sub(r'[^A-Za-z0-9._-]+', '--', source_label(self.source))}-{self.digest}"


def source_label(source: dict) -> str:
    """A source's name in entry names and log lines: its Hub repo id, else its folder."""
    return source.get("repo") or source.get("folder", "model")


def entry_digest(folder: Path) -> str:
    """The key digest an entry's folder name ends with (EntryKey.name)."""
    return folder.name.rsplit("-", 1)[-1]


def find_or_build(key: EntryKey, build: Callable[[Path], None], log: logging.Logger = logger) -> Path:
    """The entry of `key`, built by `build(out)` (an export into the folder `out`) if missing;
    `log`: where to say what happened (vLLM's logger under `vllm serve`)."""
    root = cache_root()
    entry = root / key.name
    if _valid(entry, log):  # the cheap path of every start after the first
        return entry
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f"{key.digest}.lock", log):
        if _valid(entry, log):  # built while this process waited
            log.info("export cache: %s was built by another process", entry)
            return entry
        if entry.exists():
            log.warning("export cache: %s is damaged or incomplete: building it again", entry)
            shutil.rmtree(entry)
        _log_why_new(root, key, log)
        staging = root / STAGING / f"{key.digest}-{os.getpid()}"
        for stale in (root / STAGING).glob(f"{key.digest}-*"):  # a builder killed mid-export
            shutil.rmtree(stale, ignore_errors=True)
        staging.mkdir(parents=True)
        try:
            build(staging / "export")
            record = key.fields() | {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            (staging / "export" / ENTRY_FILE).write_text(json.dumps(record, indent=2) + "\n")
            (staging / "export").rename(entry)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return entry


def _valid(entry: Path, log: logging.Logger = logger) -> bool:
    if not (entry / ENTRY_FILE).is_file():
        return False
    try:
        check_export(entry)
    except InvalidExportError as e:
        log.warning("export cache: %s fails its check (%s)", entry, e)
        return False
    return True


@contextmanager
def _locked(path: Path, log: logging.Logger = logger):
    with path.open("a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            log.warning("export cache: waiting for %s, which is building this export", holder)
            fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {os.uname().nodename}")
        f.flush()
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def entries(root: Path | None = None) -> list[tuple[Path, dict]]:
    """(folder, its cache_entry.json) of every finished entry, oldest first."""
    root = root or cache_root()
    found = []
    for path in sorted(root.glob(f"*/{ENTRY_FILE}")) if root.is_dir() else []:
        try:
            found.append((path.parent, json.loads(path.read_text())))
        except (OSError, json.JSONDecodeError):
            found.append((path.parent, {}))
    return sorted(found, key=lambda e: e[1].get("created", ""))


def _log_why_new(root: Path, key: EntryKey, log: logging.Logger) -> None:
    """Say what differs from the entries of the same source (a new commit, another option)."""
    label = source_label(key.source)
    same = [r for _, r in entries(root) if source_label(r.get("source", {})) == label]
    if not same:
        log.warning("export cache: no export of %s yet: exporting it", label)
        return
    closest = min(same, key=lambda r: len(_differences(r, key.fields())))
    said = "; ".join(_differences(closest, key.fields()))
    log.warning("export cache: exporting %s again: %s", label, said)


def _differences(old: dict, new: dict) -> list[str]:
    out = []
    for section in ("source", "options", "toolchain"):
        before, after = old.get(section, {}), new.get(section, {})
        out += [
            f"{name} {before.get(name)!r} -> {after.get(name)!r}"
            for name in sorted(set(before) | set(after))
            if before.get(name) != after.get(name)
        ]
    if old.get("format") != new.get("format"):
        out.append(f"export format {old.get('format')} -> {new.get('format')}")
    return out


def check_free_space(source_folder: str | Path, options: dict) -> None:
    """Refuse a build the disk cannot hold: a 16-bit checkpoint's weights stored at the
    export's width, plus a tenth (graphs, tokenizer)."""
    width = 1 if options.get("quantization") else 4 if options.get("dtype") == "float32" else 2
    need = int(weight_bytes(source_folder) * width / 2 * 1.1)
    root = cache_root()
    free = shutil.disk_usage(root).free
    if need > free:
        raise ExportCacheError(
            f"the export needs about {need / 2**30:.1f} GiB and {root} has {free / 2**30:.1f} GiB free: "
            f"free space (python -m optimum_neuron_chunked.export_cache rm ...) or point {ENV} elsewhere."
        )


def remove(names: list[str], root: Path | None = None) -> list[Path]:
    """Delete the named entries (folder names or key digests); returns what was deleted."""
    root = root or cache_root()
    removed = []
    for folder, _ in entries(root):
        if folder.name in names or entry_digest(folder) in names:
            with _locked(root / f"{entry_digest(folder)}.lock"):
                shutil.rmtree(folder)
            removed.append(folder)
    return removed
