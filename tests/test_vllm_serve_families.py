"""`vllm serve` of chunked exports of the families with their own layer code (Gemma3's local
layers, MoE experts): concurrent requests answer with transformers' greedy tokens."""

from __future__ import annotations

import pytest
from fixtures.export_models import CHUNK, EXPORTS
from helpers import export_params, prompt

from optimum_neuron_chunked.testing.reference import hf_greedy
from optimum_neuron_chunked.testing.server import served_greedy_tokens

# eager, and the sliding-window family on xla (the SDK-mirror environment; llama: test_vllm_xla)
SERVED = ["gemma3_text-2x4x32-eager", "qwen3_moe-2x4x32-eager", "gemma3_text-2x4x32-xla"]


@pytest.mark.parametrize("export_dir", export_params(SERVED), indirect=True)
def test_served_chunked_family_answers_with_transformers_tokens(export_dir, hf_reference, tmp_path):
    hf = hf_reference(EXPORTS[export_dir.name.rsplit("-", 1)[0]].family)
    # across chunk edges and past the sliding windows (36 for gemma3)
    prompts = [prompt(n, seed=40 + i) for i, n in enumerate((1, CHUNK + 1, 3 * CHUNK + 5, 70))]
    expected = [hf_greedy(hf, p, 8) for p in prompts]
    # 4 requests on 2 blocks: chunks mixed with decodes
    assert (
        served_greedy_tokens(export_dir, tmp_path / "serve.log", [p.tolist() for p in prompts], 8) == expected
    )
