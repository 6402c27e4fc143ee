"""Cached test artefacts written whole or not at all, by any number of writers at once: the main
suite and the SDK environment's sessions run side by side (Makefile `test`) on one cache."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def published(out: Path) -> Iterator[Path]:
    """A fresh folder beside `out` to write into, renamed to `out` when the block ends without
    an error. Each writer stages under its own name; the first rename wins and a later writer's
    copy is dropped (the same key, the same content). A failed block leaves nothing."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".partial"))
    try:
        yield staging
        try:
            staging.rename(out)  # atomic; fails only onto a non-empty folder
        except OSError:
            if not out.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
