"""Exports on the Hugging Face Hub: a repo id resolves to a local snapshot of the export.

Only what the export needs is downloaded: its configs and tokenizer, neuron_config.json and
the weight and graph files of the backend it was compiled for. huggingface_hub's own
conventions apply as they are: HF_TOKEN, HF_HUB_OFFLINE, HF_HUB_CACHE, `revision`.

An export whose backend runs code from its files (Backend.runs_code_from_export: the cpu
backend's shared libraries, the neuron backend's TorchScript bundle) is someone else's code:
as transformers' `trust_remote_code` and vLLM's `--trust-remote-code`, it loads only with the
user's consent, asked before anything but neuron_config.json is downloaded. Local folders are
the user's own files and need none.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from .config import CONFIG_NAME, InvalidExportError

# Besides neuron_config.json and the backend's files (backends.export_files).
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


logger = logging.getLogger(__name__)


class ExportNotFoundError(InvalidExportError):
    """A repo id that cannot be resolved to an export; the message says why and what to do."""


class UntrustedExportError(InvalidExportError):
    """An export from the Hub that runs code when loaded, without the user's consent."""


def is_repo_id(model: str | Path) -> bool:
    """A Hub repo id ("org/name", "name"), as opposed to a local path (existing or not)."""
    text = str(model)
    return not Path(text).exists() and not text.startswith((".", "/", "~")) and bool(REPO_ID.match(text))


def resolve_export(
    model: str | Path,
    revision: str | None = None,
    trust_remote_code: bool = False,
    consent_flag: str = "trust_remote_code=True",
) -> Path:
    """A local folder as it is; a Hub repo id downloaded (or found in the cache) as a folder.

    An export from the Hub that runs code when loaded is refused (UntrustedExportError, naming
    `consent_flag`, the caller's spelling of the consent) unless `trust_remote_code`. A folder
    that is a snapshot in a Hugging Face cache is from the Hub too: vLLM passes one in place of
    the repo id under HF_HUB_OFFLINE (vllm/engine/arg_utils.py, 0.16.0 and 0.32)."""
    if not is_repo_id(model):
        snapshot = hub_snapshot(model)
        if snapshot is not None:
            from .config import NeuronConfig

            repo_id, commit = snapshot
            _check_consent(NeuronConfig.load(Path(model)), repo_id, commit, trust_remote_code, consent_flag)
        return Path(model)
    from huggingface_hub import snapshot_download

    from .backends import export_files

    repo_id, where = str(model), f"{model} (revision {revision or 'main'})"
    config, commit = _neuron_config(repo_id, revision, where)
    _check_consent(config, where, commit, trust_remote_code, consent_flag)
    patterns = [CONFIG_NAME, *HUB_FILES, *export_files(config)]
    return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))


def is_export(model: str | Path, revision: str | None = None) -> bool:
    """Whether `model` (a folder, or a Hub repo at `revision`) holds an export rather than a
    plain checkpoint. A Hub repo that cannot be reached counts as an export: resolve_export
    then says why it cannot be had."""
    if not is_repo_id(model):
        return (Path(model) / CONFIG_NAME).is_file() or not (Path(model) / "config.json").is_file()
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    try:
        hf_hub_download(str(model), CONFIG_NAME, revision=revision)
    except (EntryNotFoundError, LocalEntryNotFoundError):
        return not _has_model_config(str(model), revision)
    except Exception:  # no such repository, no access: resolve_export words it
        return True
    return True


def hub_snapshot(folder: str | Path) -> tuple[str, str] | None:
    """(repo id, commit) of a folder laid out as huggingface_hub caches a repository
    (.../models--org--name/snapshots/<commit>), else None."""
    path = Path(folder).absolute()
    repo = path.parent.parent.name
    if path.parent.name != "snapshots" or not repo.startswith("models--"):
        return None
    return repo.removeprefix("models--").replace("--", "/"), path.name


def _check_consent(config, where: str, commit: str, trust_remote_code: bool, consent_flag: str) -> None:
    from .backends import get_backend

    runs = get_backend(config.backend).runs_code_from_export
    if runs and not trust_remote_code:
        raise UntrustedExportError(
            f"{where} at commit {commit} is a {config.backend} export: loading it runs {runs} "
            f"from that repository in this process. If you trust its author, pass {consent_flag}, "
            "best with the revision pinned to that commit; or export the source checkpoint "
            "yourself (optimum-cli export neuron)."
        )
    if runs:
        logger.warning("%s: loading %s from commit %s (trust_remote_code)", where, runs, commit)


def _neuron_config(repo_id: str, revision: str | None, where: str):
    """(NeuronConfig, the commit `revision` resolved to): huggingface_hub keeps a file of a
    commit at snapshots/<commit>/<file>, cached or downloaded."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    from .config import NeuronConfig

    try:
        snapshot = Path(hf_hub_download(repo_id, CONFIG_NAME, revision=revision)).parent
        return NeuronConfig.load(snapshot), snapshot.name
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
        f"{where} has no {CONFIG_NAME}: it is not an export of optimum-neuron-chunked. Export it: "
        f"from_pretrained({repo_id!r}, export=True, batch_size=B, sequence_length=S), `vllm serve "
        f"{repo_id}`, or optimum-cli export neuron --model {repo_id} --batch_size B --sequence_length S OUT"
    )
