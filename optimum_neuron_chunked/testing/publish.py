"""Cached test artefacts written whole or not at all, by any number of writers at once: the main
suite and the SDK environment's sessions run side by side (Makefile `test`) on one cache."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

STALE_S = 24 * 3600  # a staging folder this old was left by a killed writer


@contextmanager
def published(out: Path, complete: str) -> Iterator[Path]:
    """A fresh folder beside `out` to write into, renamed to `out` when the block ends without an
    error. Each writer stages under its own name; the first rename wins and a later writer's copy
    is dropped (the same key, the same content). A folder at `out` without its `complete` file
    (left by an interrupted writer of the in-place kind) is replaced. A failed block leaves
    nothing; a killed one leaves a hidden `.partial` folder, swept after STALE_S."""
    out.parent.mkdir(parents=True, exist_ok=True)
    for old in out.parent.glob(f".{out.name}.*.partial"):
        if time.time() - old.stat().st_mtime > STALE_S:
            shutil.rmtree(old, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".partial"))
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)  # as a plain mkdir would: mkdtemp makes it 0700
    try:
        yield staging
        if out.is_dir() and not (out / complete).exists():
            shutil.rmtree(out, ignore_errors=True)
        try:
            staging.rename(out)  # atomic; fails only onto a non-empty folder
        except OSError:
            if not (out / complete).exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
