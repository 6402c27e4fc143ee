"""KV cache bytes per slot of Gemma3 exports: local layers in rings vs full-length caches.

Cache lengths per layer come from the function DecoderModel allocates its buffers with
(kv_cache.cache_lengths); tests/test_masking.py checks the buffers have those lengths. Dimensions
are those of google/gemma-3-{4b,12b,27b}-it's text config (5 local layers per global one,
sliding_window 1024). Writes benchmark/results/gemma3-cache-<date>.{json,md}.

    python benchmark/gemma3_cache.py
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from optimum_neuron_chunked.modeling import family_spec  # noqa: E402
from optimum_neuron_chunked.modeling.kv_cache import cache_lengths  # noqa: E402

MODELS = {
    "gemma-3-4b": dict(
        hidden_size=2560, num_hidden_layers=34, num_attention_heads=8, num_key_value_heads=4, head_dim=256
    ),
    "gemma-3-12b": dict(
        hidden_size=3840, num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8, head_dim=256
    ),
    "gemma-3-27b": dict(
        hidden_size=5376, num_hidden_layers=62, num_attention_heads=32, num_key_value_heads=16, head_dim=128
    ),
}
SEQUENCES = (8192, 32768)
CHUNKS = (0, 256, 512)  # 0: standard export (no rings: its CE graph writes a whole prompt)


def cache_bytes(hf_config, sequence_length: int, chunk: int) -> int:
    """K and V of every layer for one slot, at the lengths DecoderModel allocates."""
    spec = family_spec(hf_config)
    per_position = 2 * spec.num_kv_heads * spec.head_dim * 2  # K and V, bf16
    return sum(n * per_position for n in cache_lengths(spec.sliding_windows, sequence_length, chunk or None))


def main() -> int:
    from transformers import Gemma3TextConfig

    rows = []
    for name, dims in MODELS.items():
        hf_config = Gemma3TextConfig(**dims, intermediate_size=64, vocab_size=256, sliding_window=1024)
        for s in SEQUENCES:
            full = cache_bytes(hf_config, s, 0)
            for c in CHUNKS:
                got = cache_bytes(hf_config, s, c)
                rows.append(dict(model=name, sequence_length=s, chunk=c, mib=got / 2**20, vs_full=got / full))
                print(rows[-1], flush=True)
    lines = [
        "# Gemma3 KV cache per slot (bf16, tp 1): local layers in rings of window + chunk",
        "",
        "| model | S | chunk | KV MiB per slot | vs full-length |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['model']} | {r['sequence_length']} | {r['chunk'] or 'std'} | {r['mib']:.0f} | {r['vs_full']:.3f} |"
        for r in rows
    ]
    stamp = f"gemma3-cache-{datetime.date.today()}"
    out = REPO / "benchmark" / "results"
    (out / f"{stamp}.json").write_text(json.dumps(rows, indent=2))
    (out / f"{stamp}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
