"""The Neuron host's stack end to end: `vllm serve CHECKPOINT` (vLLM 0.16.0 in the SDK-mirror
environment) exporting a plain checkpoint for the xla backend, then serving it, every graph call one execution on torch-xla's device - the
graphs neuronx-cc would receive. One server answers concurrent requests across chunk edges on
more requests than blocks, a prefix-cache hit, structured output beside free requests, prompt
logprobs and clients that disconnect mid-prefill, each equal to transformers. The xla backend
refuses any graph that falls back to the host or lowers to dynamic or non-static HLO
(XlaLoweringError), so a clean run is also a lowering check of every graph the server ran.

Step tables, the sampling paths and the other families run on xla exports in test_vllm_steps,
test_vllm_prefix_cache, test_vllm_sampling_fields and test_vllm_serve_families.
"""

from __future__ import annotations

import asyncio
import re

import pytest
import torch
from fixtures.export_models import BUCKETS, checkpoint_path
from helpers import prompt, saved_by_transformers_5

from optimum_neuron_chunked.testing.reference import hf_greedy
from optimum_neuron_chunked.testing.server import Server, concurrent_greedy_tokens, disconnect_mid_prefill

pytestmark = pytest.mark.xla
CHUNK = 32


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`vllm serve CHECKPOINT`: the platform exports the plain checkpoint for the xla backend
    from vLLM's flags (into a fresh export cache), then serves the export."""
    import json

    # Saved by transformers 5 and exported here under 4.57, as a Neuron user meets a new checkpoint.
    source = saved_by_transformers_5(checkpoint_path("llama"), tmp_path_factory.mktemp("source") / "llama")
    export_keys = {"prefill_chunk_size": CHUNK, "backend": "xla", "context_buckets": list(BUCKETS),
                   "prompt_logprobs": True}  # fmt: skip
    cache = {"ONC_EXPORT_CACHE": str(tmp_path_factory.mktemp("exports"))}
    srv = Server(source, tmp_path_factory.mktemp("serve") / "serve.log", "--max-model-len", "128",
                 "--max-num-seqs", "2", "--additional-config", json.dumps(export_keys), env=cache).wait_ready()  # fmt: skip
    yield srv
    assert srv.stop() == [], "processes left behind after SIGTERM"
    assert "XlaLoweringError" not in srv.output()
    assert "no export of llama yet: exporting it" in srv.output()


@pytest.fixture(scope="module")
def model(server) -> str:
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="none").models.list().data[0].id


def completions(server, model: str, requests: list[dict]) -> list:
    """Every request sent at once; the choices in request order."""
    from openai import AsyncOpenAI

    async def all_at_once():
        client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        calls = [client.completions.create(model=model, temperature=0, **r) for r in requests]
        return [r.choices[0] for r in await asyncio.gather(*calls)]

    return asyncio.run(all_at_once())


def test_the_tokenizer_of_a_transformers_5_checkpoint_encodes_as_its_source(server, model):
    import json
    import urllib.request

    from tokenizers import Tokenizer

    reference = Tokenizer.from_file(str(checkpoint_path("llama") / "tokenizer.json"))
    for text in ("once upon a time", "hello, world!  two  spaces\nand a line"):
        request = urllib.request.Request(
            f"{server.url}/tokenize",
            data=json.dumps({"model": model, "prompt": text}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as answer:
            assert json.load(answer)["tokens"] == reference.encode(text).ids


def test_concurrent_requests_on_two_slots_equal_transformers(server, model, hf_reference):
    hf = hf_reference("llama")
    prompts = [prompt(n, seed=90 + i) for i, n in enumerate((1, CHUNK - 1, CHUNK + 1, 3 * CHUNK + 5, 70))]
    got = concurrent_greedy_tokens(server.url, model, [p.tolist() for p in prompts], 8)
    assert got == [hf_greedy(hf, p, 8) for p in prompts]


def test_a_shared_prefix_is_copied_and_gives_transformers_tokens(server, model, hf_reference):
    hf = hf_reference("llama")
    system = prompt(3 * CHUNK, seed=95)
    first, second = (torch.cat([system, prompt(n, seed=96 + n)]) for n in (10, 20))
    hits = server.metrics().get("vllm:external_prefix_cache_hits_total", 0.0)
    tokens = [concurrent_greedy_tokens(server.url, model, [p.tolist()], 6)[0] for p in (first, second)]
    assert tokens == [hf_greedy(hf, first, 6), hf_greedy(hf, second, 6)]
    assert server.metrics()["vllm:external_prefix_cache_hits_total"] >= hits + len(system)


def test_structured_output_beside_free_requests(server, model, hf_reference):
    hf = hf_reference("llama")
    free = prompt(40, seed=97)
    choices = ["red", "green", "blue"]
    # test_vllm_service's constrained prompts: with random weights and the test tokenizer, some
    # prompts answer with byte tokens the grammar lets through before the constrained text
    answers = completions(
        server,
        model,
        [
            {"prompt": free.tolist(), "max_tokens": 8, "extra_body": {"return_token_ids": True, "ignore_eos": True}},
            {"prompt": prompt(9, seed=63).tolist(), "max_tokens": 20, "extra_body": {"structured_outputs": {"choice": choices}}},
            {"prompt": prompt(9, seed=62).tolist(), "max_tokens": 20, "extra_body": {"structured_outputs": {"regex": "(yes|no)-[0-9]{2}"}}},
        ],
    )  # fmt: skip
    assert list(answers[0].token_ids) == hf_greedy(hf, free, 8)
    assert answers[1].text in choices, answers[1].text
    assert re.fullmatch("(yes|no)-[0-9]{2}", answers[2].text), answers[2].text


def test_prompt_logprobs_equal_transformers(server, model, hf_reference):
    scored = prompt(2 * CHUNK + 7, seed=100)
    (answer,) = completions(
        server, model, [{"prompt": scored.tolist(), "max_tokens": 1, "extra_body": {"prompt_logprobs": 1}}]
    )
    with torch.no_grad():
        want = torch.log_softmax(hf_reference("llama")(scored[None]).logits[0].float(), dim=-1)
    got = answer.model_extra["prompt_logprobs"]
    assert len(got) == len(scored) and got[0] is None
    for i in range(1, len(scored)):
        token = int(scored[i])
        assert abs(got[i][str(token)]["logprob"] - float(want[i - 1, token])) < 1e-4, i


def test_clients_that_disconnect_mid_prefill_leak_no_block(server, model, hf_reference):
    disconnect_mid_prefill(server.url, model, prompt(120, seed=101).tolist(), 4)
    after = prompt(90, seed=102)
    assert concurrent_greedy_tokens(server.url, model, [after.tolist()], 6) == [
        hf_greedy(hf_reference("llama"), after, 6)
    ]
    metrics = server.metrics()
    assert metrics["vllm:num_requests_running"] == 0 and metrics["vllm:kv_cache_usage_perc"] == 0
