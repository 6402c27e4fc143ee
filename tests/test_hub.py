"""Exports by Hugging Face Hub id, from a local cache laid out as huggingface_hub lays it out,
with HF_HUB_OFFLINE=1 (no network): the loader and `vllm serve` answer as for the folder; an
export whose files run code (cpu: shared libraries) loads only with trust_remote_code."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from fixtures.export_models import CHUNKED_SHAPE, EXPORTS, checkpoint_path, export_model
from fixtures.hub_cache import add_to_hub_cache
from helpers import prompt, refusal_at_start

from optimum_neuron_chunked.export.pipeline import export
from optimum_neuron_chunked.hub import hub_snapshot, is_repo_id
from optimum_neuron_chunked.testing.server import Server

REPO = "org/llama-chunked"
CODE_REPO = "org/llama-cpu"  # a cpu export: AOTInductor shared libraries
PROMPT = list(range(4, 4 + 40))  # crosses two chunks of 16


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """(offline env, local export folder): the eager export cached as REPO, a cpu export as
    CODE_REPO, only the neuron_config.json of a cpu export as org/config-only, a plain checkpoint
    as org/plain."""
    work = tmp_path_factory.mktemp("hub")
    out = export(str(checkpoint_path("llama")), work / "out", batch_size=2, sequence_length=64,
                 prefill_chunk_size=16, backend="eager")  # fmt: skip
    add_to_hub_cache(work / "cache", REPO, out)
    code = export_model(EXPORTS[f"llama-{CHUNKED_SHAPE}-cpu"])
    add_to_hub_cache(work / "cache", CODE_REPO, code)
    (work / "config-only").mkdir()
    (work / "config-only" / "neuron_config.json").write_bytes((code / "neuron_config.json").read_bytes())
    add_to_hub_cache(work / "cache", "org/config-only", work / "config-only")
    add_to_hub_cache(work / "cache", "org/plain", checkpoint_path("llama"))
    env = {**os.environ, "HF_HUB_CACHE": str(work / "cache"), "HF_HUB_OFFLINE": "1"}
    return env, out


def load_and_generate(
    env: dict, model: str, revision: str | None = None, trust_remote_code: bool = False
) -> subprocess.CompletedProcess:
    script = (
        "import sys, json, torch\n"
        "from optimum_neuron_chunked import NeuronModelForCausalLM\n"
        "m = NeuronModelForCausalLM.from_pretrained(sys.argv[1], revision=sys.argv[2] or None,"
        " trust_remote_code=sys.argv[3] == 'trust')\n"
        f"print(json.dumps(m.generate(torch.tensor([{PROMPT}]), max_new_tokens=6, do_sample=False)[0].tolist()))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", script, model, revision or "", "trust" if trust_remote_code else ""],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


@functools.cache
def generated_here(folder: str) -> list[int]:
    """The loader's greedy tokens for PROMPT from a local export folder, in this process: a
    user's own folder needs no flag, whatever its files run."""
    from optimum_neuron_chunked import NeuronModelForCausalLM

    model = NeuronModelForCausalLM.from_pretrained(folder)
    return model.generate(torch.tensor([PROMPT]), max_new_tokens=6, do_sample=False)[0].tolist()


def test_repo_ids_and_local_paths_are_told_apart(tmp_path):
    assert is_repo_id("org/name") and is_repo_id("gpt2") and is_repo_id("org/name-v1.5")
    assert not is_repo_id("./out") and not is_repo_id("/abs/out") and not is_repo_id("a/b/c")
    assert not is_repo_id(tmp_path)  # exists
    assert hub_snapshot("/c/models--org--name/snapshots/abc") == ("org/name", "abc")
    assert hub_snapshot(tmp_path) is None


def test_from_pretrained_takes_a_repo_id_from_the_offline_cache(hub):
    env, folder = hub
    by_id = load_and_generate(env, REPO)
    assert by_id.returncode == 0, by_id.stderr[-3000:]
    assert json.loads(by_id.stdout.splitlines()[-1]) == generated_here(str(folder))


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


def commit_of(repo_id: str) -> str:
    return hashlib.sha1(f"{repo_id}@main".encode()).hexdigest()  # as add_to_hub_cache names it


def refused_for_code(stderr: str, repo_id: str, flag: str) -> bool:
    """The refusal names the repository, its commit, what would run and the flag (`vllm serve`
    under HF_HUB_OFFLINE passes the snapshot folder: no revision name)."""
    said = " ".join(stderr.split())
    return (
        f"{repo_id} " in said
        and f"at commit {commit_of(repo_id)} is a cpu export: loading it runs AOTInductor packages" in said
        and f"pass {flag}" in said
    )


def test_a_hub_export_that_runs_code_loads_only_with_consent(hub):
    env, _ = hub
    local = generated_here(str(export_model(EXPORTS[f"llama-{CHUNKED_SHAPE}-cpu"])))
    refused = load_and_generate(env, CODE_REPO)
    assert refused.returncode != 0 and refused_for_code(refused.stderr, CODE_REPO, "trust_remote_code=True")
    # Refused on neuron_config.json alone: nothing else of the repository was needed.
    config_only = load_and_generate(env, "org/config-only")
    assert refused_for_code(config_only.stderr, "org/config-only", "trust_remote_code=True")
    trusted = load_and_generate(env, CODE_REPO, trust_remote_code=True)
    assert trusted.returncode == 0, trusted.stderr[-3000:]
    assert f"from commit {commit_of(CODE_REPO)} (trust_remote_code)" in trusted.stderr
    assert json.loads(trusted.stdout.splitlines()[-1]) == local


def test_the_export_carries_a_model_card(hub):
    _, folder = hub
    card = (folder / "README.md").read_text()
    assert "library_name: optimum-neuron-chunked" in card
    assert "| backend | eager |" in card and "| prefill | chunks of 16 tokens |" in card


def test_vllm_serve_refuses_a_code_bearing_repo_id_without_its_flag(hub, monkeypatch):
    """vLLM's config path under HF_HUB_OFFLINE, in this process: vLLM hands the platform the
    repo's snapshot folder, and the platform refuses it without --trust-remote-code."""
    env, _ = hub
    for name, value in (("HF_HUB_OFFLINE", "1"), ("HF_HUB_CACHE", env["HF_HUB_CACHE"])):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", env["HF_HUB_CACHE"])
    said = refusal_at_start(CODE_REPO)
    assert refused_for_code(said, CODE_REPO, "--trust-remote-code"), said


@pytest.mark.slow
def test_vllm_serves_a_repo_id_from_the_offline_cache(hub, tmp_path):
    """A weights-only export by repo id, then a code-bearing one with --trust-remote-code."""
    from openai import OpenAI

    env, folder = hub
    hub_env = {k: env[k] for k in ("HF_HUB_CACHE", "HF_HUB_OFFLINE")}
    for repo, source, args in [
        (REPO, folder, ()),
        (CODE_REPO, export_model(EXPORTS[f"llama-{CHUNKED_SHAPE}-cpu"]), ("--trust-remote-code",)),
    ]:
        want = generated_here(str(source))[len(PROMPT) :]
        srv = Server(repo, tmp_path / "serve.log", *args, env=hub_env)
        try:
            srv.wait_ready()
            client = OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
            choice = client.completions.create(
                model=repo, prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"return_token_ids": True}
            ).choices[0]
            assert list(choice.token_ids) == want, repo
        finally:
            assert srv.stop() == []


def finished_per_engine(server: Server) -> dict[str, float]:
    counts: dict[str, float] = {}
    for line in server.metrics_text().splitlines():
        if line.startswith("vllm:request_success_total{"):
            engine = re.search(r'engine="(\d+)"', line).group(1)
            counts[engine] = counts.get(engine, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


@pytest.mark.slow
def test_a_plain_repo_id_is_exported_once_and_its_data_parallel_ranks_share_the_requests(
    hub, tmp_path, hf_reference
):
    """`vllm serve org/plain --data-parallel-size 2` (a plain checkpoint in the offline cache):
    exported once into the export cache for both engine cores, each with its own graphs, weights
    and KV blocks; vLLM's load balancing spreads the requests; every answer equals transformers';
    an abandoned stream and the shutdown leave nothing behind."""
    import asyncio

    from openai import AsyncOpenAI

    from optimum_neuron_chunked.export_cache import entries
    from optimum_neuron_chunked.testing.reference import hf_greedy

    env, _ = hub
    serve_env = {k: env[k] for k in ("HF_HUB_CACHE", "HF_HUB_OFFLINE")} | {
        "ONC_EXPORT_CACHE": str(tmp_path / "exports")
    }
    export_keys = {"prefill_chunk_size": 32, "backend": "eager", "context_buckets": [64, 128]}
    args = ("--data-parallel-size", "2", "--max-model-len", "128", "--max-num-seqs", "2",
            "--additional-config", json.dumps(export_keys))  # fmt: skip
    hf = hf_reference("llama")
    prompts = [prompt(n, seed=70 + i) for i, n in enumerate((3, 40, 70, 9, 33, 100, 5, 64))]
    expected = [hf_greedy(hf, p, 6) for p in prompts]

    async def all_at_once(url: str) -> list[list[int]]:
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        extra = {"return_token_ids": True, "ignore_eos": True}
        abandoned = asyncio.create_task(  # a client that goes away mid-stream
            client.completions.create(
                model="org/plain", prompt=prompts[5].tolist(), max_tokens=20, stream=True
            )
        )
        calls = [
            client.completions.create(
                model="org/plain", prompt=p.tolist(), max_tokens=6, temperature=0, extra_body=extra
            )
            for p in prompts
        ]
        stream = await abandoned
        async for _ in stream:
            break
        await stream.close()
        return [list(r.choices[0].token_ids) for r in await asyncio.gather(*calls)]

    srv = Server("org/plain", tmp_path / "serve.log", *args, env=serve_env)
    try:
        srv.wait_ready(timeout=600)
        assert asyncio.run(all_at_once(srv.url)) == expected
        counts = finished_per_engine(srv)
        assert set(counts) == {"0", "1"} and all(n > 0 for n in counts.values()), counts
        assert sum(counts.values()) >= len(prompts), counts
    finally:
        assert srv.stop() == [], "processes left behind"
    assert srv.output().count("no export of org/plain yet: exporting it") == 1, srv.output()[-3000:]
    ((entry, record),) = entries(tmp_path / "exports")
    assert record["source"] == {"repo": "org/plain", "commit": commit_of("org/plain")}
