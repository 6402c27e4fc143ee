"""vLLM (the `LLM` engine) on chunked exports of the families with their own layer code (Gemma3's
local layers, MoE experts): concurrent requests answer with transformers' greedy tokens. The
HTTP server around the engine is test_vllm_service's."""

from __future__ import annotations

import pytest
from fixtures.export_models import CHUNK, EXPORTS
from helpers import export_params, generate, greedy, prompt

from optimum_neuron_chunked.testing.reference import hf_greedy

# eager, and the sliding-window family on xla (the SDK-mirror environment; llama: test_vllm_xla)
SERVED = ["gemma3_text-2x4x32-eager", "qwen3_moe-2x4x32-eager", "gemma3_text-2x4x32-xla"]


@pytest.mark.parametrize("export_dir", export_params(SERVED), indirect=True)
def test_chunked_family_answers_with_transformers_tokens(export_dir, llm, hf_reference):
    hf = hf_reference(EXPORTS[export_dir.name.rsplit("-", 1)[0]].family)
    # across chunk edges and past the sliding windows (36 for gemma3)
    prompts = [prompt(n, seed=40 + i) for i, n in enumerate((1, CHUNK + 1, 3 * CHUNK + 5, 70))]
    expected = [hf_greedy(hf, p, 8) for p in prompts]
    # 4 requests on 2 blocks: chunks mixed with decodes
    assert [list(o.token_ids) for o in generate(llm, prompts, greedy(8))] == expected
