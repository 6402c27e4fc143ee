"""Soak: 200 requests of random lengths at twice the block count, a tenth dropped mid-prefill,
half of them opening with one of three shared prefixes (prefix caching copies them).

Every finished request must equal HF transformers' greedy tokens, no block may leak, and the
server must still serve afterwards.
"""

from __future__ import annotations

import asyncio
import random

import pytest
from fixtures.export_models import CHUNK
from helpers import export_params, prompt

from optimum_neuron_chunked.testing.reference import hf_greedy
from optimum_neuron_chunked.testing.server import Server

EXPORT = "llama-2x4x32-eager"  # 2 blocks, S=128, C=32
SEQUENCE_LENGTH, BLOCKS = 128, 2
NUM_REQUESTS, CONCURRENCY = 200, 2 * BLOCKS


SHARED = [prompt(n, seed=90 + n) for n in (20, CHUNK, 2 * CHUNK + 7)]  # mid-chunk, one, two+


def workload(seed: int = 0) -> list[dict]:
    import torch

    rng = random.Random(seed)
    requests = []
    for i in range(NUM_REQUESTS):
        new_tokens = rng.randint(1, 12)
        long = rng.random() < 0.3  # more than 3 chunks
        length = (
            rng.randint(3 * CHUNK + 1, SEQUENCE_LENGTH - new_tokens) if long else rng.randint(1, 3 * CHUNK)
        )
        ids = prompt(length, seed=100 + i)
        if i % 2:  # a shared prefix, then the request's own tokens
            shared = SHARED[rng.randrange(len(SHARED))][: max(0, length - 1)]
            ids = torch.cat([shared, ids[len(shared) :]])
        requests.append({"id": i, "ids": ids, "new_tokens": new_tokens, "drop": i % 10 == 3})
    return requests


@pytest.mark.slow
@pytest.mark.parametrize("export_dir", export_params([EXPORT]), indirect=True)
def test_soak(export_dir, tmp_path, hf_reference):
    import httpx

    hf = hf_reference("llama")
    requests = workload()
    expected = {r["id"]: hf_greedy(hf, r["ids"], r["new_tokens"]) for r in requests if not r["drop"]}
    assert sum(r["ids"].shape[0] > 3 * CHUNK for r in requests) > 40

    server = Server(export_dir, tmp_path / "serve.log").wait_ready()
    try:
        model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]

        async def one(http: httpx.AsyncClient, gate: asyncio.Semaphore, r: dict):
            body = {
                "model": model,
                "prompt": r["ids"].tolist(),
                "max_tokens": r["new_tokens"],
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            }
            async with gate:
                if r["drop"]:  # the client goes away once the request is accepted: mid-prefill
                    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
                        assert resp.status_code == 200
                    return r["id"], None
                resp = await http.post("/v1/completions", json=body)
                assert resp.status_code == 200, resp.text
                return r["id"], resp.json()["choices"][0]["token_ids"]

        async def run_all():
            gate = asyncio.Semaphore(CONCURRENCY)
            async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
                return dict(await asyncio.gather(*(one(http, gate, r) for r in requests)))

        results = asyncio.run(run_all())
        mismatched = [i for i, tokens in expected.items() if results[i] != tokens]
        assert mismatched == [], f"{len(mismatched)} requests differ from HF, e.g. {mismatched[:5]}"

        metrics = server.metrics()
        assert metrics["vllm:num_requests_running"] == 0 and metrics["vllm:num_requests_waiting"] == 0
        assert metrics["vllm:kv_cache_usage_perc"] == 0  # every block is free again
        assert metrics["vllm:external_prefix_cache_hits_total"] > 0  # the shared prefixes were reused
        after = requests[0]
        body = {"model": model, "prompt": after["ids"].tolist(), "max_tokens": 5, "temperature": 0}
        body |= {"ignore_eos": True, "return_token_ids": True}
        resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert resp.json()["choices"][0]["token_ids"] == hf_greedy(hf, after["ids"], 5)
    finally:
        assert server.stop() == []
