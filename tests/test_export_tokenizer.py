"""The export carries its source's tokenizer so that every transformers release that serves it
reads it: a checkpoint saved by transformers 5 exports under 4.57 (the Neuron SDK's) too, and
a source with no tokenizer is refused before any compile. Runs in both environments."""

from __future__ import annotations

import json
import shutil

import pytest
from fixtures.export_models import checkpoint_path
from helpers import saved_by_transformers_5
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from optimum_neuron_chunked.export.pipeline import ExportError, export
from optimum_neuron_chunked.export.tokenizer import record_portable_class

SHAPE = dict(batch_size=1, sequence_length=64, backend="eager")
TEXTS = ["once upon a time", "hello, world!  two  spaces\nand a line", "<s> special </s> tokens"]


def test_a_transformers_5_tokenizer_exports_and_encodes_as_its_source(tmp_path):
    source = saved_by_transformers_5(checkpoint_path("llama"), tmp_path / "source")
    out = export(str(source), tmp_path / "out", **SHAPE)
    assert (
        json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"]
        == "PreTrainedTokenizerFast"
    )
    tokenizer, reference = (
        AutoTokenizer.from_pretrained(out),
        Tokenizer.from_file(str(source / "tokenizer.json")),
    )
    for text in TEXTS:
        assert tokenizer(text).input_ids == reference.encode(text).ids
    assert tokenizer.eos_token == "</s>" and tokenizer.pad_token == "<pad>"
    assert (out / "chat_template.jinja").read_text() == (source / "chat_template.jinja").read_text()
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)


def test_a_source_without_a_tokenizer_is_refused_before_compiling(tmp_path):
    source = tmp_path / "source"
    shutil.copytree(checkpoint_path("llama"), source)
    for path in source.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            path.unlink()
    with pytest.raises(ExportError, match=r"no tokenizer files .*\.save_pretrained\(MODEL_FOLDER\)"):
        export(str(source), tmp_path / "out", **SHAPE)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))


def test_the_config_is_rewritten_only_where_a_release_cannot_read_it(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    for name, recorded in [
        ("LlamaTokenizer", "LlamaTokenizer"),
        ("TokenizersBackend", "PreTrainedTokenizerFast"),
    ]:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": name}))
        assert record_portable_class(tmp_path) == recorded
    config = {"tokenizer_class": "TokenizersBackend", "extra_special_tokens": ["<x>", "<y>"]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    record_portable_class(tmp_path)  # 5.x's list: 4.57 takes a dict there
    written = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert "extra_special_tokens" not in written and written["additional_special_tokens"] == ["<x>", "<y>"]
    (tmp_path / "tokenizer.json").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TokenizersBackend"}))
    assert (
        record_portable_class(tmp_path) == "TokenizersBackend"
    )  # nothing PreTrainedTokenizerFast could read
