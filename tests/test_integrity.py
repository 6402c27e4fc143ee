"""Damaged exports fail loudly: a truncated or corrupted weight, graph or config file is named,
with the fix, before anything is loaded from it."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
from fixtures.export_models import CHUNKED_SHAPE
from helpers import export_params

from optimum_neuron_chunked import InvalidExportError, NeuronModelForCausalLM
from optimum_neuron_chunked.config import CONFIG_NAME


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def damaged_copy(export_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(export_dir, copy)
    return copy


def message(excinfo) -> str:
    return " ".join(str(excinfo.value).split())


@pytest.mark.parametrize("export_dir", export_params(["llama-2x4x32-eager"]), indirect=True)
def test_the_export_records_every_weight_and_graph_file(export_dir):
    records = json.loads((export_dir / CONFIG_NAME).read_text())["files"]
    assert list(records) == ["model.safetensors"]  # eager: weights only
    assert records["model.safetensors"]["size"] == (export_dir / "model.safetensors").stat().st_size


@pytest.mark.parametrize("export_dir", export_params(["llama-2x4x32-eager"]), indirect=True)
def test_damaged_weights_are_named(export_dir, tmp_path):
    copy = damaged_copy(export_dir, tmp_path)
    flip_a_byte(copy / "model.safetensors")
    NeuronModelForCausalLM.from_pretrained(copy)  # same size: loads unless asked to verify
    with pytest.raises(InvalidExportError) as e:
        NeuronModelForCausalLM.from_pretrained(copy, verify_weights=True)
    assert f"{copy}/model.safetensors is damaged: its SHA-256 differs" in message(e)
    truncate(copy / "model.safetensors")
    with pytest.raises(InvalidExportError) as e:
        NeuronModelForCausalLM.from_pretrained(copy)
    assert "model.safetensors is damaged" in message(e) and "truncated or incomplete copy" in message(e)
    assert "Copy it again from the original export, or export again." in message(e)


@pytest.mark.parametrize("export_dir", export_params(["llama-2x4x32-eager"]), indirect=True)
def test_a_damaged_neuron_config_is_named(export_dir, tmp_path):
    copy = damaged_copy(export_dir, tmp_path)
    truncate(copy / CONFIG_NAME)
    with pytest.raises(InvalidExportError) as e:
        NeuronModelForCausalLM.from_pretrained(copy)
    assert f"{copy}/{CONFIG_NAME} is damaged (not JSON" in message(e)


@pytest.mark.slow
@pytest.mark.parametrize("export_dir", export_params([f"llama-{CHUNKED_SHAPE}-cpu"]), indirect=True)
@pytest.mark.parametrize("damage", [truncate, flip_a_byte])
def test_damaged_graphs_are_named_at_every_load(export_dir, tmp_path, damage):
    copy = damaged_copy(export_dir, tmp_path)
    damage(copy / "graphs/tg_w64.pt2")
    with pytest.raises(InvalidExportError) as e:
        NeuronModelForCausalLM.from_pretrained(copy)
    assert f"{copy}/graphs/tg_w64.pt2 is damaged" in message(e)


def counted_hashing(monkeypatch, seconds_later: float) -> list[Path]:
    """Paths `integrity` reads to hash them; its clock `seconds_later` ahead (0: the real clock)."""
    from optimum_neuron_chunked import integrity

    read: list[Path] = []
    hash_file = integrity.sha256_of

    def counting(path: Path) -> str:
        read.append(path)
        return hash_file(path)

    monkeypatch.setattr(integrity, "sha256_of", counting)
    monkeypatch.setattr(integrity, "_now_ns", lambda: time.time_ns() + int(seconds_later * 1e9))
    monkeypatch.setattr(integrity, "_DIGESTS", {})
    return read


def one_file_export(tmp_path: Path) -> tuple[Path, dict]:
    from optimum_neuron_chunked.integrity import record_files

    (tmp_path / "graph.bin").write_bytes(bytes(range(256)) * 64)
    return tmp_path, record_files(tmp_path, ["graph.bin"])


def test_a_process_hashes_an_unchanged_file_once(tmp_path, monkeypatch):
    from optimum_neuron_chunked.integrity import verify_files

    folder, records = one_file_export(tmp_path)
    read = counted_hashing(monkeypatch, seconds_later=10)  # an export written a while ago
    for _ in range(3):  # front end, engine core, load_model
        verify_files(folder, records, {"graph.bin"})
    assert read == [folder / "graph.bin"]


def test_a_file_changed_after_its_check_is_hashed_again(tmp_path, monkeypatch):
    from optimum_neuron_chunked.integrity import verify_files

    folder, records = one_file_export(tmp_path)
    read = counted_hashing(monkeypatch, seconds_later=10)
    verify_files(folder, records, {"graph.bin"})
    time.sleep(0.05)  # past the filesystem clock's tick: the rewrite moves mtime/ctime
    flip_a_byte(folder / "graph.bin")  # same size
    with pytest.raises(InvalidExportError) as e:
        verify_files(folder, records, {"graph.bin"})
    assert "graph.bin is damaged: its SHA-256 differs" in message(e)
    assert len(read) == 2


def test_a_file_written_just_before_its_check_is_not_trusted_from_the_cache(tmp_path, monkeypatch):
    from optimum_neuron_chunked.integrity import verify_files

    folder, records = one_file_export(tmp_path)
    read = counted_hashing(monkeypatch, seconds_later=0)  # a same-size rewrite may keep its stat
    verify_files(folder, records, {"graph.bin"})
    verify_files(folder, records, {"graph.bin"})
    assert len(read) == 2


@pytest.mark.parametrize("export_dir", export_params(["llama-2x4x32-eager"]), indirect=True)
def test_checking_an_export_twice_hashes_it_once(export_dir, monkeypatch):
    from optimum_neuron_chunked.export_folder import check_export

    read = counted_hashing(monkeypatch, seconds_later=10)
    check_export(export_dir, verify_weights=True)
    first = list(read)
    check_export(export_dir, verify_weights=True)
    assert first == [export_dir / "model.safetensors"] and read == first
