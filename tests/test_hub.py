"""Exports by Hugging Face Hub id, from a local cache laid out as huggingface_hub lays it out,
with HF_HUB_OFFLINE=1 (no network): the loader and `vllm serve` answer as for the folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from fixtures.export_models import checkpoint_path
from fixtures.hub_cache import add_to_hub_cache

from optimum_neuron_chunked.export.pipeline import export
from optimum_neuron_chunked.hub import is_repo_id
from optimum_neuron_chunked.testing.server import Server

REPO = "org/llama-chunked"
PROMPT = list(range(4, 4 + 40))  # crosses two chunks of 16


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """(offline env, local export folder): the export cached as REPO, a plain checkpoint as org/plain."""
    work = tmp_path_factory.mktemp("hub")
    out = export(str(checkpoint_path("llama")), work / "out", batch_size=2, sequence_length=64,
                 prefill_chunk_size=16, backend="eager")  # fmt: skip
    add_to_hub_cache(work / "cache", REPO, out)
    add_to_hub_cache(work / "cache", "org/plain", checkpoint_path("llama"))
    env = {**os.environ, "HF_HUB_CACHE": str(work / "cache"), "HF_HUB_OFFLINE": "1"}
    return env, out


def load_and_generate(env: dict, model: str, revision: str | None = None) -> subprocess.CompletedProcess:
    script = (
        "import sys, json, torch\n"
        "from optimum_neuron_chunked import NeuronModelForCausalLM\n"
        "m = NeuronModelForCausalLM.from_pretrained(sys.argv[1], revision=sys.argv[2] or None)\n"
        f"print(json.dumps(m.generate(torch.tensor([{PROMPT}]), max_new_tokens=6, do_sample=False)[0].tolist()))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", script, model, revision or ""],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_repo_ids_and_local_paths_are_told_apart(tmp_path):
    assert is_repo_id("org/name") and is_repo_id("gpt2") and is_repo_id("org/name-v1.5")
    assert not is_repo_id("./out") and not is_repo_id("/abs/out") and not is_repo_id("a/b/c")
    assert not is_repo_id(tmp_path)  # exists


def test_from_pretrained_takes_a_repo_id_from_the_offline_cache(hub):
    env, folder = hub
    by_id, by_folder = load_and_generate(env, REPO), load_and_generate(env, str(folder))
    assert by_id.returncode == 0, by_id.stderr[-3000:]
    assert json.loads(by_id.stdout.splitlines()[-1]) == json.loads(by_folder.stdout.splitlines()[-1])


@pytest.mark.parametrize(
    "model, revision, message",
    [
        ("org/plain", None, "org/plain (revision main) has no neuron_config.json: it is not an export"),
        (REPO, "v2", "(revision v2) is not in the local Hugging Face cache"),
        ("org/missing", None, "org/missing (revision main) is not in the local Hugging Face cache"),
    ],
)
def test_a_repo_id_that_is_no_cached_export_gets_a_clear_error(hub, model, revision, message):
    env, _ = hub
    done = load_and_generate(env, model, revision)
    assert done.returncode != 0 and message in " ".join(done.stderr.split()), done.stderr[-3000:]


def test_the_export_carries_a_model_card(hub):
    _, folder = hub
    card = (folder / "README.md").read_text()
    assert "library_name: optimum-neuron-chunked" in card
    assert "| backend | eager |" in card and "| prefill | chunks of 16 tokens |" in card


@pytest.mark.slow
def test_vllm_serves_a_repo_id_from_the_offline_cache(hub, tmp_path):
    from openai import OpenAI

    env, folder = hub
    want = json.loads(load_and_generate(env, str(folder)).stdout.splitlines()[-1])[len(PROMPT) :]
    srv = Server(REPO, tmp_path / "serve.log", env={k: env[k] for k in ("HF_HUB_CACHE", "HF_HUB_OFFLINE")})
    try:
        srv.wait_ready()
        client = OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
        choice = client.completions.create(
            model=REPO, prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"return_token_ids": True}
        ).choices[0]
        assert list(choice.token_ids) == want
    finally:
        assert srv.stop() == []
