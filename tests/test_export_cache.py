"""The export cache behind `vllm serve MODEL` and `from_pretrained(MODEL, export=True)`: one
entry per source and options, found again without a build; concurrent builders build once; a
builder killed mid-export leaves nothing served; a damaged entry is built again; list / rm.
Also generate() with transformers' generation arguments on an export from the cache."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from fixtures.export_models import checkpoint_path
from helpers import prompt
from transformers import AutoModelForCausalLM

from optimum_neuron_chunked import NeuronModelForCausalLM
from optimum_neuron_chunked.export_cache import cached_export, entries
from optimum_neuron_chunked.export_cache.store import EntryKey, find_or_build

OPTIONS = dict(batch_size=2, sequence_length=64, prefill_chunk_size=16, backend="eager")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("ONC_EXPORT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_an_entry_is_found_again_by_its_key(cache, tmp_path, caplog):
    source = tmp_path / "llama"
    shutil.copytree(checkpoint_path("llama"), source)
    first = cached_export(str(source), OPTIONS)
    created = json.loads((first / "cache_entry.json").read_text())["created"]
    assert cached_export(str(source), OPTIONS) == first  # no build: the same entry, untouched
    assert json.loads((first / "cache_entry.json").read_text())["created"] == created
    other = cached_export(str(source), OPTIONS | {"prefill_chunk_size": 32})
    assert other != first and len(entries()) == 2
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps(config | {"rms_norm_eps": 1e-5}))
    with caplog.at_level("WARNING"):
        changed = cached_export(str(source), OPTIONS)
    assert changed not in (first, other) and "exporting llama again: files" in caplog.text
    listed = subprocess.run([sys.executable, "-m", "optimum_neuron_chunked.export_cache", "list"], capture_output=True,
                            text=True, check=True, env=os.environ).stdout  # fmt: skip
    assert "3 entries" in listed and first.name in listed and "eager float32 B=2 S=64 C=16" in listed
    subprocess.run(
        [sys.executable, "-m", "optimum_neuron_chunked.export_cache", "rm", first.name], check=True
    )
    assert not first.exists() and len(entries()) == 2
    assert not list((cache / ".staging").glob("*"))


def build_slowly(root: str, marker: str) -> None:
    """A process that builds the entry of one key, slowly, and records that it built."""
    os.environ["ONC_EXPORT_CACHE"] = root
    key = EntryKey({"folder": "m", "files": "x"}, {"batch_size": 1}, {})

    def build(out: Path) -> None:
        with open(marker, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(3)
        shutil.copytree(cached_export(str(checkpoint_path("llama")), OPTIONS), out)

    find_or_build(key, build)


def test_concurrent_builders_build_once_and_a_killed_one_leaves_nothing(cache, tmp_path, caplog):
    context = multiprocessing.get_context("spawn")
    marker = tmp_path / "built"
    killed = context.Process(target=build_slowly, args=(str(cache), str(marker)))
    killed.start()
    while not marker.exists():
        time.sleep(0.1)
    os.kill(killed.pid, signal.SIGKILL)  # mid-export: its staging folder stays behind
    killed.join()
    assert list((cache / ".staging").glob("*")) and [f.name for f in cache.iterdir() if not f.name.startswith(".")] \
        == [p.name for p in cache.glob("*.lock")]  # fmt: skip
    builders = [context.Process(target=build_slowly, args=(str(cache), str(marker))) for _ in range(2)]
    for p in builders:
        p.start()
    for p in builders:
        p.join(timeout=300)
    assert [p.exitcode for p in builders] == [0, 0]
    assert len(marker.read_text().split()) == 2  # the killed builder, then one of the two
    (entry,) = [e for e, record in entries() if record["options"] == {"batch_size": 1}]
    assert not list((cache / ".staging").glob("*"))
    model = NeuronModelForCausalLM.from_pretrained(entry)
    ids = prompt(20, seed=1)[None]
    hf = AutoModelForCausalLM.from_pretrained(checkpoint_path("llama"), dtype=torch.float32)
    assert (
        model.generate(ids, max_new_tokens=6, do_sample=False).tolist()
        == hf.generate(ids, max_new_tokens=6, do_sample=False).tolist()
    )


def test_a_damaged_entry_is_built_again(cache, caplog):
    entry = cached_export(str(checkpoint_path("llama")), OPTIONS)
    (entry / "model.safetensors").unlink()
    with caplog.at_level("WARNING"):
        again = cached_export(str(checkpoint_path("llama")), OPTIONS)
    assert again == entry and (entry / "model.safetensors").is_file()
    assert "is damaged or incomplete: building it again" in caplog.text


def test_from_pretrained_exports_through_the_cache_and_generate_takes_transformers_arguments(cache):
    from transformers import AutoTokenizer, TextIteratorStreamer

    model = NeuronModelForCausalLM.from_pretrained(checkpoint_path("llama"), export=True, **OPTIONS)
    assert model.model_dir.parent == cache and len(entries()) == 1
    hf = AutoModelForCausalLM.from_pretrained(checkpoint_path("llama"), dtype=torch.float32)
    ids = prompt(20, seed=2)[None]
    eos = int(hf.generate(ids, max_new_tokens=1, do_sample=False)[0, -1])  # the first greedy token
    args = dict(max_new_tokens=8, do_sample=False, min_new_tokens=3, repetition_penalty=1.5, eos_token_id=eos)
    streamer = TextIteratorStreamer(AutoTokenizer.from_pretrained(model.model_dir), skip_prompt=True)
    output = model.generate(ids, streamer=streamer, **args)
    assert output.tolist() == hf.generate(ids, **args).tolist()
    assert "".join(streamer) == streamer.tokenizer.decode(output[0, ids.shape[1] :])
    with pytest.raises(ValueError, match="generate\\(\\) does not support: .*num_beams"):
        model.generate(ids, num_beams=2)
    model.generation_config.cache_implementation = "hybrid"  # a checkpoint's own (gemma3's): left alone
    assert model.generate(ids, max_new_tokens=2, do_sample=False).shape[1] == ids.shape[1] + 2
    with pytest.raises(ValueError, match="does not support: cache_implementation"):
        model.generate(ids, cache_implementation="static")  # asked for: refused
    with pytest.raises(TypeError, match="export options batch_size: they export a plain checkpoint"):
        NeuronModelForCausalLM.from_pretrained(model.model_dir, batch_size=2)


def test_the_test_export_key_follows_what_exporting_imports(tmp_path):
    """testing/export_cache.code_key: a module the export imports (at any depth) or a file of the
    backend's folder changes the key; a module exporting never imports does not."""
    from optimum_neuron_chunked.testing.export_cache import ROOT, code_key

    shutil.copytree(ROOT / "optimum_neuron_chunked", tmp_path / "optimum_neuron_chunked",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip

    def touched(relative: str) -> tuple[str, str]:
        before = code_key("eager", tmp_path), code_key("cpu", tmp_path)
        with open(tmp_path / "optimum_neuron_chunked" / relative, "a") as f:
            f.write("\n// touched\n" if relative.endswith(".cpp") else "\n# touched\n")
        after = code_key("eager", tmp_path), code_key("cpu", tmp_path)
        return tuple("changed" if a != b else "same" for a, b in zip(before, after, strict=True))

    for module in ["lora_targets.py", "quantized_checkpoint.py", "export/tokenizer.py",
                   "export/model_card.py", "hub.py", "integrity.py", "modeling/lora.py"]:  # fmt: skip
        assert touched(module) == ("changed", "changed"), module
    assert touched("backends/cpu/decode_attention.cpp") == ("same", "changed")
    assert touched("backends/eager.py") == ("changed", "same")
    assert touched("vllm/runner.py") == ("same", "same")
