"""An export of a plain checkpoint through the cache: key it, find it or build it."""

from __future__ import annotations

import logging
from pathlib import Path

from rich.console import Console

from ..backends import default_backend, get_backend
from ..config import EXPORT_OPTIONS, NeuronConfig
from ..head_checkpoint import head_digest
from ..hub import is_repo_id
from .source import local_source, source_identity
from .store import EntryKey, check_free_space, find_or_build

logger = logging.getLogger(__name__)


def host_choices(options: dict) -> dict:
    """The export options this host decides: the backend, and its host fields (instance type,
    cpu ISA)."""
    backend = options.get("backend") or default_backend()[0]
    return {"backend": backend} | get_backend(backend).host_fields(options.get("instance_type"))


def resolved_config(options: dict, host: dict | None = None) -> tuple[NeuronConfig, dict]:
    """(NeuronConfig, every export option): defaults filled and the host's choices made
    (`host`: host_choices(options)), so that the key names what is compiled however the
    options were spelled; validated by NeuronConfig (its errors name the flag)."""
    host = host_choices(options) if host is None else host
    given = {k: v for k, v in options.items() if v is not None}
    config = NeuronConfig(**given | host)
    full = {o.name: getattr(config, o.name) for o in EXPORT_OPTIONS} | host
    for o in EXPORT_OPTIONS:  # decided by the export itself (an FP8 checkpoint's quantization)
        if o.metadata["resolved"] and o.name not in (*given, *host):
            full[o.name] = None
    return config, full


def resolved_options(options: dict) -> dict:
    """Every export option, resolved (resolved_config)."""
    return resolved_config(options)[1]


def cached_export(
    model: str,
    options: dict,
    revision: str | None = None,
    console: Console | None = None,
    log: logging.Logger = logger,
) -> Path:
    """The cache entry of `model` (a local folder or a Hub repo id at `revision`) exported with
    `options` (export()'s keywords), built here if no process built it yet; `log`: where the
    cache says what it did (vLLM's logger under `vllm serve`)."""
    from ..export.pipeline import export

    options = resolved_options(options)
    backend = get_backend(options["backend"])
    key = EntryKey(sources(model, revision, options), _jsonable(options), backend.toolchain())
    instance = options.pop("instance_type", None)
    options.pop("cpu_isa", None)  # decided again by the exporting host: the same one

    def build(out: Path) -> None:
        # a Hub checkpoint's files only to build, at the commit the key names
        source = local_source(model, key.source.get("commit", revision))
        check_free_space(source, options)
        export(source, out, console=console, instance_type=instance, **options)

    return find_or_build(key, build, log)


def sources(model: str, revision: str | None, options: dict) -> dict:
    """The identity of what the export reads: the checkpoint, and an EAGLE3 head
    (--speculation-head) - a Hub id by its commit, a folder by the digest the export records
    (head_checkpoint.head_digest) - its path alone would keep a stale entry when the head changes."""
    source = source_identity(model, revision)
    head = options.get("speculation_head")
    if not head:
        return source
    if is_repo_id(head):  # its commit names its content, nothing downloaded
        return source | {"speculation_head": source_identity(head)}
    return source | {"speculation_head": {"digest": head_digest(Path(head))}}


def _jsonable(options: dict) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in sorted(options.items())}
