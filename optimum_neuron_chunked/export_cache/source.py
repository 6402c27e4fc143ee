"""The identity of a checkpoint an export is built from, for the export cache's key.

A Hub repo: the commit its revision resolves to (huggingface_hub keeps every file of a commit at
snapshots/<commit>/; offline, the cache's refs/<revision> resolve it). A local folder: every
file's relative path and size, the SHA-256 of each small file (configs, tokenizer) and of the
first and last MiB of each large one (weights) - a change to any file changes the key, and a
start reads a few MiB, never gigabytes of weights; copies on other hosts share it.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from ..hub import hub_snapshot, is_repo_id

WHOLE_FILE_BYTES = 16 * 2**20  # files up to this size are hashed whole
EDGE_BYTES = 2**20  # larger ones: their first and last MiB
COMMIT = re.compile(r"^[0-9a-f]{40}$")
# What a streamed export reads of a Hub checkpoint (checkpoint_stream, export/tokenizer.py).
SOURCE_FILES = [
    "*.json",
    "model*.safetensors",
    "tokenizer*",
    "*.model",
    "*.tiktoken",
    "*.jinja",
    "chat_template*",
]


def source_identity(model: str, revision: str | None = None) -> dict[str, str]:
    """{"repo", "commit"} of a Hub checkpoint, or {"folder", "files"} of a local one."""
    if is_repo_id(model):
        return {"repo": model, "commit": hub_commit(model, revision)}
    snapshot = hub_snapshot(model)  # vLLM passes a cached snapshot in place of an offline repo id
    if snapshot is not None:
        return {"repo": snapshot[0], "commit": snapshot[1]}
    folder = Path(model).resolve()
    return {"folder": folder.name, "files": folder_digest(folder)}


def hub_commit(repo_id: str, revision: str | None) -> str:
    """The commit `revision` (default main) of `repo_id` resolves to, online or from the cache."""
    if revision and COMMIT.match(revision):
        return revision
    from huggingface_hub import hf_hub_download

    return Path(hf_hub_download(repo_id, "config.json", revision=revision)).parent.name


def local_source(model: str, revision: str | None) -> str:
    """A folder holding what the export reads: a local model as it is, a Hub repo's snapshot at
    `revision` (downloaded where missing: configs, tokenizer, safetensors weights)."""
    if not is_repo_id(model):
        return model
    from huggingface_hub import snapshot_download

    return snapshot_download(model, revision=revision, allow_patterns=SOURCE_FILES)


def folder_digest(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        relative = path.relative_to(folder)
        if any(part.startswith(".") for part in relative.parts):
            continue
        size = path.stat().st_size
        digest.update(json.dumps([str(relative), size, file_digest(path, size)]).encode())
    return digest.hexdigest()


def file_digest(path: Path, size: int) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        if size <= WHOLE_FILE_BYTES:
            digest.update(f.read())
        else:
            digest.update(f.read(EDGE_BYTES))
            f.seek(size - EDGE_BYTES)
            digest.update(f.read(EDGE_BYTES))
    return digest.hexdigest()


def weight_bytes(folder: str | Path) -> int:
    """Bytes of a checkpoint's weight files (the free-space estimate of an export)."""
    return sum(p.stat().st_size for p in Path(folder).glob("*.safetensors")) or sum(
        p.stat().st_size for p in Path(folder).glob("*.bin")
    )
