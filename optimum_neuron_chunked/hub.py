"""Exports on the Hugging Face Hub: a repo id resolves to a local snapshot of the export.

Only what the export needs is downloaded: its configs and tokenizer, neuron_config.json and
the weight and graph files of the backend it was compiled for. huggingface_hub's own
conventions apply as they are: HF_TOKEN, HF_HUB_OFFLINE, HF_HUB_CACHE, `revision`.
"""

from __future__ import annotations

import re
from pathlib import Path

from .config import CONFIG_NAME, InvalidExportError

# Besides neuron_config.json and the backend's files (loader.export_files).
HUB_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "chat_template.*",
    "*.tiktoken",
    "README.md",
]
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


class ExportNotFoundError(InvalidExportError):
    """A repo id that cannot be resolved to an export; the message says why and what to do."""


def is_repo_id(model: str | Path) -> bool:
    """A Hub repo id ("org/name", "name"), as opposed to a local path (existing or not)."""
    text = str(model)
    return not Path(text).exists() and not text.startswith((".", "/", "~")) and bool(REPO_ID.match(text))


def resolve_export(model: str | Path, revision: str | None = None) -> Path:
    """A local folder as it is; a Hub repo id downloaded (or found in the cache) as a folder."""
    if not is_repo_id(model):
        return Path(model)
    from huggingface_hub import snapshot_download

    from .backends import export_files

    repo_id, where = str(model), f"{model} (revision {revision or 'main'})"
    config = _neuron_config(repo_id, revision, where)
    patterns = [CONFIG_NAME, *HUB_FILES, *export_files(config)]
    return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))


def _neuron_config(repo_id: str, revision: str | None, where: str):
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    from .config import NeuronConfig

    try:
        return NeuronConfig.load(Path(hf_hub_download(repo_id, CONFIG_NAME, revision=revision)).parent)
    except RepositoryNotFoundError as e:
        raise ExportNotFoundError(
            f"{where}: no such repository on the Hugging Face Hub, or no access to it (set HF_TOKEN "
            "for a private or gated one); a local export folder must exist."
        ) from e
    except RevisionNotFoundError as e:
        raise ExportNotFoundError(f"{where}: no such revision on the Hugging Face Hub.") from e
    except LocalEntryNotFoundError as e:
        if _has_model_config(repo_id, revision):
            raise _not_an_export(repo_id, where) from e
        raise ExportNotFoundError(
            f"{where} is not in the local Hugging Face cache and the Hub was not asked (HF_HUB_OFFLINE "
            "or no network): download it once online, or pass a local export folder."
        ) from e
    except EntryNotFoundError as e:
        raise _not_an_export(repo_id, where) from e


def _has_model_config(repo_id: str, revision: str | None) -> bool:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        hf_hub_download(repo_id, "config.json", revision=revision)
    except (EntryNotFoundError, OSError):
        return False
    return True


def _not_an_export(repo_id: str, where: str) -> ExportNotFoundError:
    return ExportNotFoundError(
        f"{where} has no {CONFIG_NAME}: it is not an export of optimum-neuron-chunked. Export it "
        f"first: optimum-cli export neuron --model {repo_id} --batch_size B --sequence_length S OUT"
    )
