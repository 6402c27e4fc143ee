"""`vllm serve EXPORT --data-parallel-size 2`: two engine cores, each with its own graphs,
weights and KV blocks; vLLM's own load balancing spreads the requests; every answer equals
transformers'; an abort and the shutdown leave nothing behind."""

from __future__ import annotations

import asyncio
import re
import urllib.request

import pytest
from helpers import export_params, prompt

from optimum_neuron_chunked.testing.reference import hf_greedy
from optimum_neuron_chunked.testing.server import Server


def finished_per_engine(server: Server) -> dict[str, float]:
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=5) as r:
        text = r.read().decode()
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:request_success_total{"):
            engine = re.search(r'engine="(\d+)"', line).group(1)
            counts[engine] = counts.get(engine, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("export_dir", export_params(["llama-2x4x32-eager"]), indirect=True)
def test_two_data_parallel_ranks_share_the_requests(export_dir, tmp_path, hf_reference):
    from openai import AsyncOpenAI

    hf = hf_reference("llama")
    prompts = [prompt(n, seed=70 + i) for i, n in enumerate((3, 40, 70, 9, 33, 100, 5, 64))]
    expected = [hf_greedy(hf, p, 6) for p in prompts]
    srv = Server(export_dir, tmp_path / "serve.log", "--data-parallel-size", "2")
    try:
        srv.wait_ready(timeout=400)
        model = str(export_dir)

        async def all_at_once():
            client = AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
            extra = {"return_token_ids": True, "ignore_eos": True}
            abandoned = asyncio.create_task(  # a client that goes away mid-stream
                client.completions.create(
                    model=model, prompt=prompts[5].tolist(), max_tokens=100, stream=True
                )
            )
            calls = [
                client.completions.create(
                    model=model, prompt=p.tolist(), max_tokens=6, temperature=0, extra_body=extra
                )
                for p in prompts
            ]
            stream = await abandoned
            async for _ in stream:
                break
            await stream.close()
            return [list(r.choices[0].token_ids) for r in await asyncio.gather(*calls)]

        assert asyncio.run(all_at_once()) == expected
        counts = finished_per_engine(srv)
        print("finished requests per data-parallel rank:", counts)
        assert set(counts) == {"0", "1"} and all(n > 0 for n in counts.values()), counts
        assert sum(counts.values()) >= len(prompts)
    finally:
        left = srv.stop()
    assert left == [], f"processes left behind: {left}"
