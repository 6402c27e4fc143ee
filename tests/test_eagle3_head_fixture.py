"""The trained EAGLE3 pair (testing/eagle3_heads.py) is built once and cached: a second call finds
the folder its first call wrote, every file as the manifest recorded it."""

from __future__ import annotations

import json

from fixtures.export_models import cache_root

from optimum_neuron_chunked.testing.eagle3_heads import digests, trained_pair


def test_trained_pair_is_cached():
    target, head = trained_pair(cache_root())
    manifest = target.parent / "manifest.json"
    written = manifest.stat().st_mtime_ns
    assert trained_pair(cache_root()) == (target, head)
    assert manifest.stat().st_mtime_ns == written  # found, not built again
    assert digests(target.parent) == json.loads(manifest.read_text())["files"]
    config = json.loads((head / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] < config["vocab_size"]
