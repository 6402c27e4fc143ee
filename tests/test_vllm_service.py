"""`vllm serve EXPORT` driven by the openai client: parity, streaming, chat, bad input, aborts,
start-up refusals, a soak of 200 requests and a shutdown that leaves no process behind."""

from __future__ import annotations

import asyncio
import random
import shutil

import pytest
import torch
from fixtures.export_models import CHUNK, checkpoint_path
from helpers import export_params, prompt, refusal_at_start

from optimum_neuron_chunked.testing.reference import hf_greedy
from optimum_neuron_chunked.testing.server import Server, concurrent_greedy_tokens, disconnect_mid_prefill

EXPORT = "llama-2x4x32-eager"  # 2 blocks, S=128, C=32
SEQUENCE_LENGTH = 128


@pytest.fixture(scope="module")
def server(export_dir, tmp_path_factory):
    srv = Server(export_dir, tmp_path_factory.mktemp("serve") / "serve.log").wait_ready()
    yield srv
    left = srv.stop()
    assert left == [], f"processes left behind after SIGTERM: {left}"


@pytest.fixture
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def complete(client, model, ids: list[int], n: int = 8, **kw):
    return client.completions.create(
        model=model, prompt=ids, max_tokens=n, temperature=0, extra_body={"return_token_ids": True, **kw}
    ).choices[0]


def served_model(client) -> str:
    return client.models.list().data[0].id


pytestmark = pytest.mark.parametrize("export_dir", export_params([EXPORT]), indirect=True)


def test_completions_match_transformers_alone_and_concurrently(server, client, hf_reference):
    hf, model = hf_reference("llama"), served_model(client)
    prompts = [prompt(n, seed=20 + i) for i, n in enumerate((1, CHUNK + 1, 3 * CHUNK + 5, 50, 7, 120))]
    expected = [hf_greedy(hf, p, 8) for p in prompts]
    assert list(complete(client, model, prompts[2].tolist(), ignore_eos=True).token_ids) == expected[2]
    # 6 requests on 2 blocks: queued, not refused
    assert concurrent_greedy_tokens(server.url, model, [p.tolist() for p in prompts], 8) == expected


def test_streaming_gives_the_same_text_in_pieces(client):
    model = served_model(client)
    ids = prompt(2 * CHUNK + 3, seed=30).tolist()
    whole = complete(client, model, ids, 12, ignore_eos=True).text
    stream = client.completions.create(
        model=model, prompt=ids, max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    pieces = [event.choices[0].text for event in stream if event.choices]
    assert len(pieces) > 1 and "".join(pieces) == whole


def test_chat_uses_the_chat_template(client, hf_reference, export_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(export_dir)
    messages = [{"role": "user", "content": "the quick brown fox"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = torch.tensor(tokenizer(text, add_special_tokens=False).input_ids)
    reply = client.chat.completions.create(
        model=served_model(client),
        messages=messages,
        max_tokens=6,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    assert list(reply.choices[0].token_ids) == hf_greedy(hf_reference("llama"), ids, 6)


@pytest.mark.parametrize(
    "kw",
    [
        dict(prompt=list(range(4, 4 + SEQUENCE_LENGTH + 1))),  # longer than the compiled length
        dict(prompt=""),
        dict(prompt=[5, 6], max_tokens=-1),
        dict(prompt=[5, 6], temperature=-1.0),
        dict(prompt=[5, 6], top_p=1.5),
        dict(prompt=[5, 6], extra_body={"prompt_logprobs": 2}),
    ],
    ids=["too-long", "empty", "negative-max-tokens", "temperature", "top-p", "prompt-logprobs"],
)
def test_bad_input_gets_a_4xx_and_disturbs_nothing(client, server, kw):
    import openai

    model = served_model(client)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, **{"max_tokens": 4, **kw})
    assert e.value.status_code == 400 and e.value.message
    ok = complete(client, model, [5, 6, 7], 4)
    assert len(ok.token_ids) == 4
    assert server.metrics().get("vllm:num_requests_running", 0) == 0


def test_max_tokens_beyond_the_context_follows_vllm(client):
    """vLLM's own rule: 0.32 stops a completion at max_model_len (finish_reason "length"); 0.16.0
    refuses the request (vllm/renderers/params.py)."""
    import openai
    import vllm

    ids = list(range(4, 100))
    if vllm.__version__ == "0.16.0":
        with pytest.raises(openai.BadRequestError, match="context length is only 128 tokens"):
            complete(client, served_model(client), ids, SEQUENCE_LENGTH, ignore_eos=True)
        return
    choice = complete(client, served_model(client), ids, SEQUENCE_LENGTH, ignore_eos=True)
    assert len(choice.token_ids) == SEQUENCE_LENGTH - 96 and choice.finish_reason == "length"


def test_clients_that_disconnect_mid_prefill_free_their_blocks(server, client, hf_reference):
    model = served_model(client)
    disconnect_mid_prefill(server.url, model, prompt(120, seed=40).tolist(), 6)
    hf = hf_reference("llama")
    prompts = [prompt(n, seed=41 + n) for n in (90, 10)]
    outs = [complete(client, model, p.tolist(), 6, ignore_eos=True).token_ids for p in prompts]
    assert [list(o) for o in outs] == [hf_greedy(hf, p, 6) for p in prompts]
    metrics = server.metrics()
    assert metrics["vllm:num_requests_running"] == 0 and metrics["vllm:kv_cache_usage_perc"] == 0


def test_metrics_are_served(server):
    metrics = server.metrics()
    assert "vllm:num_requests_running" in metrics and "vllm:kv_cache_usage_perc" in metrics


def test_a_start_up_refusal_reaches_the_user_and_leaves_nothing(export_dir, tmp_path):
    srv = Server(export_dir, tmp_path / "serve.log", "--max-model-len", "4096")
    assert srv.wait_exit() != 0
    output = srv.output()
    assert "--max-model-len 4096" in output and "sequence_length 128" in output, output[-3000:]
    assert srv.stop() == []


@pytest.mark.parametrize(
    "case, expected",
    [
        ("max-num-seqs", ["--max-num-seqs 8", "batch_size 2"]),
        ("checkpoint", ["--additional-config 'prefil_chunk_size' (did you mean 'prefill_chunk_size'?)"]),
        ("incomplete", ["incomplete export", "model.safetensors"]),
        ("damaged", ["model.safetensors is damaged", "Copy it again from the original export"]),
    ],
)
def test_start_up_refusals_name_the_fix(export_dir, tmp_path, case, expected):
    model, args = export_dir, {}
    if case == "max-num-seqs":
        args = {"max_num_seqs": 8}
    elif case == "checkpoint":  # a plain checkpoint is exported from the flags: a wrong key is refused first
        model, args = checkpoint_path("llama"), {"additional_config": {"prefil_chunk_size": 8}}
    else:
        model = tmp_path / "partial"
        shutil.copytree(export_dir, model)
        weights = model / "model.safetensors"
        if case == "incomplete":
            weights.unlink()
        else:  # an interrupted copy
            weights.write_bytes(weights.read_bytes()[:1000])
    said = refusal_at_start(model, **args)
    assert all(text in said for text in expected), said


def test_structured_output_beside_unconstrained_requests(server, client, hf_reference):
    """Grammars (vLLM's bitmask, applied by the host sampler) in the same batch as free requests:
    each constrained answer obeys its grammar, the free ones equal transformers'."""
    import json
    import re

    from openai import AsyncOpenAI

    model, hf = served_model(client), hf_reference("llama")
    free = [prompt(40, seed=60), prompt(5, seed=61)]
    # Whitespace between JSON tokens is vLLM's engine-wide choice (structured_outputs_config):
    # with random weights an object may never close, so the schema is an enum of JSON values.
    values = ["small", "large", 7, True, None]
    schema = {"enum": values}
    constrained = [
        {"regex": "(yes|no)-[0-9]{2}"},
        {"choice": ["red", "green", "blue"]},
        {"json": schema},
    ]

    async def all_at_once():
        aclient = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)

        def call(ids, max_tokens, **extra):
            return aclient.completions.create(
                model=model, prompt=ids, max_tokens=max_tokens, temperature=0, extra_body=extra
            )

        calls = [call(p.tolist(), 8, return_token_ids=True, ignore_eos=True) for p in free]
        calls += [
            call(prompt(9, seed=62 + i).tolist(), 40, structured_outputs=c) for i, c in enumerate(constrained)
        ]
        return [r.choices[0] for r in await asyncio.gather(*calls)]

    first, second, regex, choice, as_json = asyncio.run(all_at_once())
    assert [list(first.token_ids), list(second.token_ids)] == [hf_greedy(hf, p, 8) for p in free]
    assert re.fullmatch("(yes|no)-[0-9]{2}", regex.text), regex.text
    assert choice.text in ("red", "green", "blue"), choice.text
    assert json.loads(as_json.text) in values, as_json.text


def test_a_budget_equal_to_a_vllm_default_is_said_and_can_be_forced(export_dir):
    import logging

    from vllm.engine.arg_utils import EngineArgs

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("vllm.optimum_neuron_chunked.vllm.platform")  # the platform's
    logger.addHandler(handler)
    try:
        typed = EngineArgs(model=str(export_dir), max_num_batched_tokens=2048).create_engine_config()
    finally:
        logger.removeHandler(handler)
    said = " ".join(" ".join(r.getMessage() for r in records).split())
    assert "--max-num-batched-tokens 2048 is one of vLLM's defaults, so it is read as not given" in said
    assert "--additional-config '{\"max_num_batched_tokens\": 2048}'" in said
    assert typed.scheduler_config.max_num_batched_tokens == 64
    forced = EngineArgs(
        model=str(export_dir), additional_config={"max_num_batched_tokens": 2048}
    ).create_engine_config()
    assert forced.scheduler_config.max_num_batched_tokens == 2048


SOAK_REQUESTS, CONCURRENCY = 200, 4  # twice the export's 2 blocks


SHARED = [prompt(n, seed=90 + n) for n in (20, CHUNK, 2 * CHUNK + 7)]  # mid-chunk, one, two+


def workload(seed: int = 0) -> list[dict]:
    import torch

    rng = random.Random(seed)
    requests = []
    for i in range(SOAK_REQUESTS):
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
def test_soak(server, hf_reference):
    """200 requests of random lengths at twice the block count, a tenth dropped mid-prefill,
    half of them opening with one of three shared prefixes (prefix caching copies them): every
    finished request equals transformers' greedy tokens, no block leaks, the server serves on."""
    import httpx

    hf = hf_reference("llama")
    requests = workload()
    expected = {r["id"]: hf_greedy(hf, r["ids"], r["new_tokens"]) for r in requests if not r["drop"]}
    assert sum(r["ids"].shape[0] > 3 * CHUNK for r in requests) > 40

    model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    hits_before = server.metrics().get("vllm:external_prefix_cache_hits_total", 0)  # a shared server

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
    assert metrics["vllm:external_prefix_cache_hits_total"] > hits_before  # the shared prefixes reused
    after = requests[0]
    body = {"model": model, "prompt": after["ids"].tolist(), "max_tokens": 5, "temperature": 0}
    body |= {"ignore_eos": True, "return_token_ids": True}
    resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert resp.json()["choices"][0]["token_ids"] == hf_greedy(hf, after["ids"], 5)
