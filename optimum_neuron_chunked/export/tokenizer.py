"""The export's tokenizer: the source's tokenizer files, copied as they are, so that every
transformers release that serves the export reads them.

Copying (not `AutoTokenizer.from_pretrained(...).save_pretrained(...)`) keeps a tokenizer the
exporting transformers cannot instantiate: transformers 5 saves its generic tokenizers-backed
class as `"tokenizer_class": "TokenizersBackend"` (tokenization_utils_tokenizers.py, 5.x),
which transformers 4.57 - the Neuron SDK's - does not know (`tokenizer_class_from_name` gives
None, models/auto/tokenization_auto.py). Where a `tokenizer.json` exists, the class both
releases read for it is `PreTrainedTokenizerFast` (an alias of TokenizersBackend in 5.x).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from .errors import ExportError

# What transformers' save_pretrained writes for a tokenizer (4.57 and 5.x), and tiktoken files.
TOKENIZER_PATTERNS = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "*.tiktoken",
)
TOKENIZER_CONFIG = "tokenizer_config.json"
PORTABLE_FAST_CLASS = "PreTrainedTokenizerFast"
# Classes of transformers 5 that no 4.x release resolves; each reads a tokenizer.json.
TRANSFORMERS_5_CLASSES = ("TokenizersBackend",)


class NoTokenizerError(ExportError):
    """The source has no tokenizer the export could carry; the message names the fix."""


def copy_tokenizer(model: str, out: Path) -> list[str]:
    """Copy `model`'s tokenizer files (a local folder, or a hub id's snapshot) into `out`,
    recording a tokenizer class every serving release reads; returns the files copied."""
    source = _tokenizer_folder(model)
    copied = []
    for pattern in TOKENIZER_PATTERNS:
        for path in sorted(source.glob(pattern)):
            shutil.copyfile(path, out / path.name)
            copied.append(path.name)
    if not copied:
        raise NoTokenizerError(
            f"{model} has no tokenizer files ({', '.join(TOKENIZER_PATTERNS[:3])}, ...): the export "
            "would not serve. Save the model's tokenizer beside its weights - "
            "AutoTokenizer.from_pretrained(TOKENIZER_ID).save_pretrained(MODEL_FOLDER) - and export again."
        )
    record_portable_class(out)
    return copied


def record_portable_class(folder: Path) -> str | None:
    """Make the tokenizer config read the same in transformers 4.57 and 5.x: a class a serving
    release cannot resolve becomes PreTrainedTokenizerFast where a tokenizer.json lets that
    class read the tokenizer whole; 5.x's list of `extra_special_tokens` (4.57 takes a dict
    there and fails on a list, `_set_model_specific_special_tokens`) moves to
    `additional_special_tokens`, which both read. Returns the class now recorded (None: no
    tokenizer_config.json)."""
    config_path = folder / TOKENIZER_CONFIG
    if not config_path.is_file():
        return None
    config = json.loads(config_path.read_text())
    name, before = config.get("tokenizer_class"), dict(config)
    if (folder / "tokenizer.json").is_file() and name is not None and not _resolvable_everywhere(name):
        config["tokenizer_class"] = PORTABLE_FAST_CLASS
    if isinstance(config.get("extra_special_tokens"), list):
        extra = config.pop("extra_special_tokens")
        known = config.get("additional_special_tokens") or []
        config["additional_special_tokens"] = known + [t for t in extra if t not in known]
    if config != before:
        config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return config.get("tokenizer_class")


def _resolvable_everywhere(name: str) -> bool:
    """Whether both transformers 4.57 and 5.x resolve tokenizer class `name`: not one of 5's
    own, and known to the installed release."""
    if name in TRANSFORMERS_5_CLASSES:
        return False
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    return tokenizer_class_from_name(name) is not None


def _tokenizer_folder(model: str) -> Path:
    local = Path(model)
    if local.exists():
        return local
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, allow_patterns=list(TOKENIZER_PATTERNS)))


def check_loads(folder: Path) -> None:
    """The installed transformers reads the copied tokenizer, or the export stops saying why."""
    from transformers import AutoTokenizer

    try:
        AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, TypeError, ImportError) as e:
        raise NoTokenizerError(
            f"the source's tokenizer does not load with transformers here ({e}). Install what it "
            "names, or save a tokenizer.json beside the checkpoint (a fast tokenizer's "
            "save_pretrained writes one), and export again."
        ) from e
