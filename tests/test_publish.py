"""Cached test artefacts are published whole by one rename (testing/publish.py): the main suite
and the SDK environment's sessions write the same cache at once (Makefile `test`)."""

from __future__ import annotations

import os

import pytest

from optimum_neuron_chunked.testing.publish import published


def test_concurrent_writers_of_one_folder_leave_one_whole_copy(tmp_path):
    out = tmp_path / "checkpoint"
    with published(out, "weights") as first:
        (first / "weights").write_text("first")
        with published(out, "weights") as second:  # a second writer, done before the first
            (second / "weights").write_text("second")
        assert (out / "weights").read_text() == "second"
    assert (out / "weights").read_text() == "second"  # the first writer's rename lost: dropped
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint"]  # no staging left
    assert out.stat().st_mode & 0o777 == 0o777 & ~current_umask()


def test_a_folder_an_interrupted_in_place_writer_left_is_replaced(tmp_path):
    out = tmp_path / "checkpoint"
    out.mkdir()
    (out / "half").write_text("no weights file: interrupted")
    with published(out, "weights") as staging:
        (staging / "weights").write_text("whole")
    assert sorted(p.name for p in out.iterdir()) == ["weights"]


def test_a_failed_write_publishes_nothing(tmp_path):
    out = tmp_path / "checkpoint"
    with pytest.raises(RuntimeError), published(out, "weights") as staging:
        (staging / "weights").write_text("half")
        raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []


def current_umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask
