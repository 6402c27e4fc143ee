"""An EAGLE3 head checkpoint (--speculation-head HEAD): its folder, config.json, tensors and
digest, and what an export keeps of it. The export's `eagle3_head/config.json` is the head's
own: the folder a vLLM user names as speculative_config `model`, and what shapes the head at
load, as the target's config.json shapes the target (modeling/eagle3.py holds the rule)."""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import NeuronConfig
from .hub import is_repo_id
from .integrity import sha256_of
from .modeling.eagle3 import DRAFT, Eagle3FitError, Eagle3Spec, d2t_error, head_state, shared_weights
from .modeling.family import FamilySpec
from .safetensors_io import CheckpointFiles

HEAD_DIR = "eagle3_head"
HEAD_CONFIG = f"{HEAD_DIR}/config.json"
# yuhuili ships pytorch_model.bin (EAGLE's traineagle3), speculators safetensors
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model.bin")


@dataclass(frozen=True)
class HeadCheckpoint:
    folder: Path
    config: dict  # its config.json
    tensors: dict[str, torch.Tensor]  # as the checkpoint names them


def head_folder(head: str) -> Path:
    """The local folder of `head` (a Hub id: its snapshot of config.json and weights)."""
    if Path(head).is_dir():
        return Path(head)
    if not is_repo_id(head):
        raise Eagle3FitError(f"--speculation-head {head}: no such folder, nor a Hub repo id")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(head, allow_patterns=["*.json", *WEIGHT_PATTERNS]))


def weight_files(folder: Path) -> list[Path]:
    """The head weights in `folder` (THE "has weights" rule): its safetensors, else its
    pytorch_model.bin; [] for none."""
    return sorted(folder.glob(WEIGHT_PATTERNS[0])) or sorted(folder.glob(WEIGHT_PATTERNS[1]))


def head_files(folder: Path) -> list[Path]:
    """The head in `folder`: its config.json, then its weight files; Eagle3FitError without both."""
    weights = weight_files(folder)
    if not weights or not (folder / "config.json").is_file():
        raise Eagle3FitError(
            f"{folder} holds no EAGLE3 head: config.json and {' or '.join(WEIGHT_PATTERNS)} wanted"
        )
    return [folder / "config.json", *weights]


def load_head(head: str) -> HeadCheckpoint:
    from safetensors.torch import load_file

    folder = head_folder(head)
    config_file, *weights = head_files(folder)
    tensors = {}
    for path in weights:
        loaded = load_file(path) if path.suffix == ".safetensors" else torch.load(path, weights_only=True)
        tensors |= loaded
    return HeadCheckpoint(folder, json.loads(config_file.read_text()), tensors)


def head_digest(folder: Path) -> str:
    """SHA-256 over the head's config.json and weight files, each file's name and SHA-256
    (integrity.sha256_of: streamed, never a whole file in memory); the export records it."""
    digest = hashlib.sha256()
    for path in head_files(folder):
        digest.update(path.name.encode())
        digest.update(sha256_of(path).encode())
    return digest.hexdigest()


def head_fields(head: HeadCheckpoint, target_dir: Path | None) -> dict:
    """The NeuronConfig fields an export records of its head; `target_dir`: the target
    checkpoint's safetensors folder, where a head's own embed_tokens may turn out to be the target's."""
    embed = None
    if target_dir is not None and any(n.endswith("embed_tokens.weight") for n in head.tensors):
        files = CheckpointFiles(target_dir)
        name = next((n for n in ("model.embed_tokens.weight", "embed_tokens.weight") if n in files), None)
        embed = files.read(name) if name else None
    return {
        "speculation_head_digest": head_digest(head.folder),
        "speculation_head_shares": shared_weights(head.tensors, embed),
    }


def fitting_spec(head_config: dict, config: NeuronConfig, target: FamilySpec) -> Eagle3Spec:
    """The head's Eagle3Spec for export `config` of `target`, or Eagle3FitError naming the misfit."""
    spec = Eagle3Spec.of(head_config, target, config.speculation_head_shares)
    error = spec.fit_error(target)
    if error:
        raise Eagle3FitError(
            f"--speculation-head {config.speculation_head} does not fit the target: {error}; pass a head "
            "trained for this target (its config names the verifier), or export without --speculation-head"
        )
    return spec


def export_head_spec(export_dir: Path, config: NeuronConfig, target: FamilySpec) -> Eagle3Spec | None:
    """The head of an export (its eagle3_head/config.json), None without one."""
    if not config.speculation_head:
        return None
    return fitting_spec(json.loads((Path(export_dir) / HEAD_CONFIG).read_text()), config, target)


def save_head(head: HeadCheckpoint, out: Path) -> None:
    (out / HEAD_DIR).mkdir(parents=True, exist_ok=True)
    shutil.copyfile(head.folder / "config.json", out / HEAD_CONFIG)


def head_weights(head: HeadCheckpoint, spec: Eagle3Spec) -> dict[str, torch.Tensor]:
    """The head's `draft.*` weights (eagle3.head_state), shape-checked against the spec, d2t
    range-checked against the target's vocabulary (eagle3.d2t_error)."""
    state = head_state(spec, head.tensors)
    error = d2t_error(spec, state[f"{DRAFT}.d2t"])
    if error:
        raise Eagle3FitError(
            f"--speculation-head {head.folder}: {error}; pass a head trained for this target's "
            "tokenizer (its d2t maps the draft vocabulary into the target's)"
        )
    fc = state.get(f"{DRAFT}.fc.weight")
    if fc is None or tuple(fc.shape) != (spec.hidden_size, spec.aux_width):
        shape = None if fc is None else tuple(fc.shape)
        raise Eagle3FitError(
            f"the head's fc.weight is {shape}, not [{spec.hidden_size}, {spec.aux_width}]: "
            f"{len(spec.aux_layer_ids)} aux layers {list(spec.aux_layer_ids)} of {spec.target_hidden_size}"
        )
    return state
