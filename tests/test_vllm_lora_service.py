"""`vllm serve EXPORT --enable-lora --lora-modules ...`: adapters by name over HTTP, loaded at run
time, refused with their reason while the server serves on; LoRA flags refused at start."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from fixtures.export_models import cache_root, checkpoint_path, export_with
from helpers import prompt, refusal_at_start

from optimum_neuron_chunked.testing.lora_adapters import peft_greedy, peft_reference, write_adapter
from optimum_neuron_chunked.testing.server import Server

LORA_EXPORT = dict(batch_size=2, sequence_length=128, prefill_chunk_size=32, context_buckets=(64, 128),
                   max_loras=2, max_lora_rank=8)  # fmt: skip
NEW_TOKENS = 6


def adapter(name: str, **options):
    seeds = {"a": 1, "b": 2, "dora": 9}
    folder = cache_root() / "adapters" / f"service-{name}"  # this file's own: others write other options
    return write_adapter(checkpoint_path("llama"), folder, seed=seeds[name], **options)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    export = export_with("llama", "eager", **LORA_EXPORT)
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    srv = Server(
        export, log, "--enable-lora", "--lora-modules", f"a={adapter('a', rank=8)}", env=env
    ).wait_ready()
    yield srv
    assert srv.stop() == [], "processes left behind after SIGTERM"


def complete(server, model: str, ids: list[int]) -> list[int]:
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    choice = client.completions.create(
        model=model, prompt=ids, max_tokens=NEW_TOKENS, temperature=0, extra_body={"return_token_ids": True}
    ).choices[0]
    return list(choice.token_ids)


def load(server, name: str, path) -> tuple[int, str]:
    body = json.dumps({"lora_name": name, "lora_path": str(path)}).encode()
    request = urllib.request.Request(
        f"{server.url}/v1/load_lora_adapter", body, {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_adapters_by_name_match_peft_and_refusals_leave_the_server_serving(server):
    peft = peft_reference(checkpoint_path("llama"), {"a": adapter("a", rank=8), "b": adapter("b", rank=4)})
    ids = prompt(40, seed=11).tolist()
    base_name = json.load(urllib.request.urlopen(f"{server.url}/v1/models"))["data"][0]["id"]
    assert complete(server, "a", ids) == peft_greedy(peft, ids, "a", NEW_TOKENS)
    status, said = load(server, "dora", adapter("dora", rank=4, use_dora=True))
    assert status >= 400 and "DoRA" in said, (status, said)
    status, said = load(server, "big", adapter("b", rank=4).parent / "missing")
    assert status >= 400 and "adapter_config.json" in said, (status, said)
    assert load(server, "b", adapter("b", rank=4))[0] == 200
    assert complete(server, "b", ids) == peft_greedy(peft, ids, "b", NEW_TOKENS)
    assert complete(server, base_name, ids) == peft_greedy(peft, ids, "__base__", NEW_TOKENS)


@pytest.mark.parametrize(
    "args, expected",
    [
        ({"max_loras": 4}, "--max-loras 4 exceeds the export's 2 adapter slots"),
        ({"lora_target_modules": ["embed_tokens"]}, "not a projection adapters can target"),
    ],
)
def test_lora_flags_beyond_the_export_are_refused_at_start(args, expected):
    export = export_with("llama", "eager", **LORA_EXPORT)
    assert expected in refusal_at_start(export, enable_lora=True, **args)
