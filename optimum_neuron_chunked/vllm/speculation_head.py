"""`--speculative-config '{"method": "eagle3", "model": HEAD, ...}'` on an export: HEAD must be
the head the export was compiled with (--speculation-head). An export keeps the head's
config.json in eagle3_head/ (head_checkpoint.py), the folder to pass as `model`: vLLM builds
the head's ModelConfig from it at argument time and never loads its weights on this platform.

HEAD is the export's head when it is:
  - the export's own eagle3_head/ folder (or a copy: the same config.json, no weights);
  - a folder with weights (head_checkpoint.weight_files) whose digest (head_checkpoint.head_digest:
    config.json and weights) is the one the export recorded; weights without config.json: refused;
  - the Hub id the export was made from (its weights are not downloaded to check them).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..config import NeuronConfig
from ..head_checkpoint import HEAD_CONFIG, HEAD_DIR, head_digest, weight_files
from .limits import ServingConfigError


def check_head(export_dir: Path, config: NeuronConfig, head: str | None) -> None:
    """Refuse, naming both, a `head` (speculative_config model) that is not the export's."""
    if not config.speculation_head or head is None:
        return  # no head: limits.check_speculation; no model: vLLM refuses eagle3 itself
    kept = Path(export_dir) / HEAD_DIR
    if _same_head(Path(head), kept, config, head):
        return
    raise ServingConfigError(
        f"--speculative-config model {head} is not the EAGLE3 head this export was compiled with "
        f"({config.speculation_head}, digest {config.speculation_head_digest[:12]}): pass "
        f'"model": "{kept}" (the head\'s config the export keeps), or serve the source checkpoint '
        "to export it with this head."
    )


def _same_head(folder: Path, kept: Path, config: NeuronConfig, head: str) -> bool:
    if not folder.is_dir():
        return head == config.speculation_head  # a Hub id
    if folder.resolve() == kept.resolve():
        return True
    if weight_files(folder):
        if not (folder / "config.json").is_file():  # head_digest hashes it with the weights
            raise ServingConfigError(
                f"--speculative-config model {head} holds EAGLE3 head weights but no config.json: put the "
                f'head\'s config.json beside them, or pass "model": "{kept}" (the head\'s config the '
                "export keeps)."
            )
        return head_digest(folder) == config.speculation_head_digest
    theirs = folder / "config.json"
    kept_config = json.loads((kept.parent / HEAD_CONFIG).read_text())
    return theirs.is_file() and json.loads(theirs.read_text()) == kept_config
