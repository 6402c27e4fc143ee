"""`vllm serve` of chunked exports of the families with their own layer code (Gemma3's local
layers, MoE experts): concurrent requests answer with transformers' greedy tokens."""

from __future__ import annotations

import asyncio

import pytest
from conftest import export_params
from fixtures.export_models import CHUNK, EXPORTS
from test_parity import prompt
from test_vllm_engine import hf_greedy
from vllm_server import Server

SERVED = ["gemma3_text-2x4x32-eager", "qwen3_moe-2x4x32-eager"]


@pytest.mark.parametrize("export_dir", export_params(SERVED), indirect=True)
def test_served_chunked_family_answers_with_transformers_tokens(export_dir, hf_reference, tmp_path):
    from openai import AsyncOpenAI

    hf = hf_reference(EXPORTS[export_dir.name.rsplit("-", 1)[0]].family)
    # across chunk edges and past the sliding windows (36 for gemma3)
    prompts = [prompt(n, seed=40 + i) for i, n in enumerate((1, CHUNK + 1, 3 * CHUNK + 5, 70))]
    expected = [hf_greedy(hf, p, 8) for p in prompts]
    server = Server(export_dir, tmp_path / "serve.log").wait_ready()
    try:

        async def all_at_once():  # 4 requests on 2 slots: chunks mixed with decodes
            client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
            model = (await client.models.list()).data[0].id
            calls = [
                client.completions.create(
                    model=model,
                    prompt=p.tolist(),
                    max_tokens=8,
                    temperature=0,
                    extra_body={"return_token_ids": True, "ignore_eos": True},
                )
                for p in prompts
            ]
            return [list(r.choices[0].token_ids) for r in await asyncio.gather(*calls)]

        assert asyncio.run(all_at_once()) == expected
    finally:
        assert server.stop() == []
