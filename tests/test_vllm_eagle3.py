"""EAGLE3 under vLLM: the export's head drafts on the device after each prefill chunk and each
verify call, vLLM's scheduler schedules the drafts, the runner verifies them (greedy rows by the
argmax, seeded rows by vLLM's rejection rule) and vLLM counts them. Refusals by name at start.

Exports: the trained pair's tiny llama with its head (testing/eagle3_heads.py), 2 rows, S=128,
chunk 32, K=3, eager (and xla: vLLM 0.16.0, the graphs neuronx-cc would receive)."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch
from fixtures.export_models import (
    cache_root,
    checkpoint_path,
    export_with,
    trained_head_export,
    trained_prompts,
)
from helpers import RecordingGraphs, refusal_at_start
from vllm_stepper import Engine

from optimum_neuron_chunked.testing.eagle3_heads import trained_pair
from optimum_neuron_chunked.testing.reference import hf_greedy
from optimum_neuron_chunked.testing.vllm_native import native_eagle3
from optimum_neuron_chunked.vllm.compat import LONE_PREFILL_TAKES_BUDGET

K = 3
SHAPE = dict(batch_size=2, sequence_length=128, prefill_chunk_size=32, context_buckets=(64, 128),
             decode_widths=(1, 2), speculation_length=K)  # fmt: skip


def head_export(backend: str = "eager", **options):
    """The trained target with its head in SHAPE and `options` (fixtures/export_models.py keys it)."""
    return trained_head_export(backend, **SHAPE | options)


@pytest.fixture(scope="module")
def pair():
    """(the export, transformers' target, the fixture's prompts: grammar text of 16 tokens)."""
    from transformers import AutoModelForCausalLM

    target, _ = trained_pair(cache_root())
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    return head_export(), hf, trained_prompts()


def eagle3(export_dir, k: int = K, **fields) -> dict:
    return {
        "method": "eagle3",
        "model": str(export_dir / "eagle3_head"),
        "num_speculative_tokens": k,
    } | fields


def engine_for(export_dir, speculative: dict | None = None, **engine_args) -> Engine:
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(export_dir), seed=0, speculative_config=speculative, **engine_args)
    engine = Engine(export_dir, args.create_engine_config())
    runner = engine.worker.runner.graph_runner
    runner.graphs = RecordingGraphs(runner.graphs)
    return engine


def run(engine: Engine) -> list[tuple[str, list[str]]]:
    """Every step: (what it ran, the kinds of the graphs it called)."""
    ran, table = engine.worker.runner.graph_runner.graphs.ran, []
    while engine.scheduler.has_requests():
        start = len(ran)
        table.append((engine.step(), [name.split("_")[0] for name in ran[start:]]))
    return table


def accepted(engine: Engine, req_id: str | None = None) -> int:
    return sum(a for r, _, a in engine.verified if req_id in (None, r))


def test_a_request_drafts_after_each_chunk_and_each_verify(pair):
    from optimum_neuron_chunked.vllm.worker import KV_LAYER

    export_dir, _, prompts = pair
    engine = engine_for(export_dir, eagle3(export_dir))
    kv = engine.worker.runner.capabilities.kv  # vLLM's page counts the head's layer
    assert engine.worker.get_kv_cache_spec()[KV_LAYER].num_kv_heads == kv.num_kv_heads * (kv.num_layers + 1)
    engine.add("a", torch.cat(prompts[:3]), max_tokens=12)  # 48 tokens: two chunks
    table = run(engine)
    chunks = [("| a[0:32] a[32:48]", ["cp", "dc", "cp", "dc"])]
    if not LONE_PREFILL_TAKES_BUDGET:  # 0.16.0: one chunk a step
        chunks = [("| a[0:32]", ["cp", "dc"]), ("| a[32:48]", ["cp", "dc"])]
    decodes = table[len(chunks) : -1]
    assert table[: len(chunks)] == chunks and table[-1] == ("", [])
    assert decodes and all(step == ("a |", ["vf", "dv"]) for step in decodes), table
    assert all(d == K for _, d, _ in engine.verified) and accepted(engine) > 0


def test_a_request_sampled_on_the_host_writes_the_heads_kv_after_each_chunk(pair):
    """Not verifiable (logprobs): it drafts nothing, yet the head's pass follows each of its
    chunks, so the prefix blocks it leaves cached hold the head's K/V."""
    export_dir, hf, prompts = pair
    engine = engine_for(export_dir, eagle3(export_dir))
    prompt = torch.cat(prompts[:3])  # 48 tokens: two chunks
    engine.add("a", prompt, max_tokens=4, logprobs=1)
    kinds = [kind for _, step in run(engine) for kind in step]
    assert kinds.count("cp") == 2 and [kinds[i + 1] for i, k in enumerate(kinds) if k == "cp"] == ["dc"] * 2
    assert "vf" not in kinds and not engine.verified
    assert engine.tokens["a"] == hf_greedy(hf, prompt, 4)


@pytest.mark.parametrize("backend", ["eager", pytest.param("xla", marks=pytest.mark.xla)])
def test_greedy_tokens_equal_transformers_and_drafts_are_accepted(pair, backend):
    _, hf, prompts = pair
    export_dir = head_export(backend)
    engine = engine_for(export_dir, eagle3(export_dir))
    requests = {"a": torch.cat(prompts[:3]), "b": prompts[3], "c": torch.cat(prompts[4:6]), "d": prompts[6]}
    for req_id, ids in requests.items():  # four requests on two rows, chunk edges crossed
        engine.add(req_id, ids, max_tokens=24)
    run(engine)
    assert engine.tokens == {r: hf_greedy(hf, ids, 24) for r, ids in requests.items()}
    assert all(accepted(engine, r) > 0 for r in requests), engine.verified
    assert engine.free_blocks == 2


def native_reference(prompts: list[list[int]], max_tokens: int) -> dict:
    """vLLM's own CPU engine on the pair (testing/vllm_native.py), kept in the test cache under
    the pair's file digests and vLLM's version: it changes only with them."""
    import vllm

    target, head = trained_pair(cache_root())
    manifest = (target.parent / "manifest.json").read_text()
    key = hashlib.sha256(repr((manifest, vllm.__version__, K, max_tokens, prompts)).encode())
    path = cache_root() / "references" / f"vllm-eagle3-{key.hexdigest()[:16]}.json"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        staged = path.with_suffix(".staged")
        staged.write_text(json.dumps(native_eagle3(target, head, K, prompts, max_tokens)))
        staged.rename(path)
    return json.loads(path.read_text())


def test_drafts_are_accepted_per_position_as_vllms_own_engine_accepts_them(pair):
    """Both are lossless: the same tokens. The drafts may differ where the head's top two logits
    nearly tie (the kernels differ), so each position's accepted count is held to vLLM's within
    5 % of its verify calls."""
    export_dir, _, prompts = pair
    native = native_reference([p.tolist() for p in prompts], 32)
    engine = engine_for(export_dir, eagle3(export_dir))
    for i, ids in enumerate(prompts):
        engine.add(str(i), ids, max_tokens=32)
    run(engine)
    assert [engine.tokens[str(i)] for i in range(len(prompts))] == native["tokens"]
    theirs, calls = native["spec_decode"]["num_accepted_tokens_per_pos"], native["spec_decode"]["num_drafts"]
    verified = [accepted for _, drafts, accepted in engine.verified if drafts]  # vLLM counts these
    ours = [sum(a > position for a in verified) for position in range(K)]
    assert abs(len(verified) - calls) <= 0.05 * calls
    assert all(abs(a - b) <= 0.05 * calls for a, b in zip(ours, theirs, strict=True)), (ours, theirs, calls)


def test_seeded_sampling_is_reproducible_through_the_rejection_rule(pair):
    from vllm import SamplingParams

    export_dir, _, prompts = pair

    def sample(seed: int) -> list[int]:
        engine = engine_for(export_dir, eagle3(export_dir))
        params = SamplingParams(max_tokens=24, temperature=1.0, seed=seed, ignore_eos=True)
        engine.add_request("a", torch.cat(prompts[:2]), params)
        engine.add("b", prompts[2], max_tokens=24)  # a greedy neighbour
        run(engine)
        assert accepted(engine, "a") > 0  # drafts through the rejection rule, some kept
        return engine.tokens["a"]

    first = sample(1234)
    assert sample(1234) == first and sample(99) != first


def test_refused_at_start_by_name(pair, tmp_path):
    export_dir, _, _ = pair
    say = lambda model, **args: refusal_at_start(model, seed=0, **args)  # noqa: E731
    llama = checkpoint_path("llama")  # a path vLLM does not read as an eagle3 head
    assert "method 'draft_model' is not supported" in say(
        export_dir,
        speculative_config={"method": "draft_model", "model": str(llama), "num_speculative_tokens": K},
    )
    plain = export_with("llama", "eager", **SHAPE)
    assert "this export has none" in say(plain, speculative_config=eagle3(export_dir))
    other = tmp_path / "other-head"
    shutil.copytree(trained_pair(cache_root())[1], other)
    (other / "model.safetensors").write_bytes((other / "model.safetensors").read_bytes()[:-1] + b" ")
    message = say(export_dir, speculative_config=eagle3(export_dir) | {"model": str(other)})
    assert f"model {other} is not the EAGLE3 head" in message and str(export_dir / "eagle3_head") in message
    from optimum_neuron_chunked.config import NeuronConfig
    from optimum_neuron_chunked.vllm.limits import ServingConfigError
    from optimum_neuron_chunked.vllm.speculation_head import check_head

    (other / "config.json").unlink()  # weights alone: no digest to compare, the fix named
    with pytest.raises(ServingConfigError, match="no config.json: put the head's config.json beside them"):
        check_head(export_dir, NeuronConfig.load(export_dir), str(other))
    assert (
        "num_speculative_tokens 4 is not supported by this export: it serves num_speculative_tokens <= 3"
        in say(export_dir, speculative_config=eagle3(export_dir, K + 1))
    )
    from vllm.config import SpeculativeConfig

    options = dict(draft_sample_method="probabilistic", rejection_sample_method="block", parallel_drafting=True,
                   disable_padded_drafter_batch=True, num_speculative_tokens_per_batch_size=[(1, 2, K)],
                   speculative_token_tree="[(0,), (1,), (0, 0)]")  # fmt: skip
    for name, value in options.items():  # each of compat.DRAFTING_DEFAULTS, and trees
        if name in SpeculativeConfig.__dataclass_fields__:  # 0.32: no trees; 0.16.0: only trees and the bools
            message = say(export_dir, speculative_config=eagle3(export_dir, **{name: value}))
            assert f"{name}={value!r} is not supported" in message
    checkpoint = trained_pair(cache_root())[0]  # exported on the fly: refused before any export
    assert "--mixed-step do not combine" in say(
        checkpoint, speculative_config=eagle3(export_dir), additional_config={"mixed_step": True}
    )


def test_paged_exports_need_blocks_for_the_chain():
    from optimum_neuron_chunked.config import NeuronConfig
    from optimum_neuron_chunked.vllm.compat import FIRST_CHUNK_HAS_LOOKAHEAD
    from optimum_neuron_chunked.vllm.limits import ServingConfigError, check_head_chain

    config = NeuronConfig(**SHAPE, speculation_head="h", kv_cache_blocks=16, kv_block_size=16)
    if not FIRST_CHUNK_HAS_LOOKAHEAD:
        with pytest.raises(ServingConfigError, match="not supported on vLLM 0.16.0"):
            check_head_chain(config, K, 128)
        return
    check_head_chain(config, K, 128)
    check_head_chain(config, K - 1, 100)  # the chain ends at 100 + K - 3 < 112
    with pytest.raises(ServingConfigError, match="num_speculative_tokens 1: .* pass 2 or 3"):
        check_head_chain(config, 1, 128)
    with pytest.raises(
        ServingConfigError, match="--max-model-len 96: the head's chain writes up to position 96"
    ):
        check_head_chain(config, K, 96)


def test_copy_prefix_hits_leave_their_last_token_and_carry_the_heads_kv(pair):
    """Whole-sequence blocks (the copy connector): a hit gives up its last token, as vLLM's eagle
    block drop gives up a block, so the head's K/V there is written with this prompt's next token;
    the copy carries the head's K/V too: b's drafts are those of b computed whole."""
    export_dir, hf, prompts = pair
    system = torch.cat(prompts[:3])
    a, b = torch.cat([system, prompts[3], prompts[5]]), torch.cat([system, prompts[4]])
    common = next(i for i, (x, y) in enumerate(zip(a.tolist(), b.tolist(), strict=False)) if x != y)

    def served(caching: bool) -> tuple[Engine, list]:
        engine = engine_for(export_dir, eagle3(export_dir), enable_prefix_caching=caching)
        engine.add("a", a, max_tokens=16)
        engine.step_until(lambda: engine.tokens["a"])  # a decodes in its block
        engine.add("b", b, max_tokens=16)
        return engine, [engine.step(), engine.worker.runner.last_plan.copies, *run(engine)]

    cached, table = served(True)
    assert [(c.length, table[0].split()[-1]) for c in table[1]] == [(common - 1, f"b[{common - 1}:{len(b)}]")]
    whole, _ = served(False)
    for engine in (cached, whole):
        assert engine.tokens == {"a": hf_greedy(hf, a, 16), "b": hf_greedy(hf, b, 16)}
    assert [v for v in cached.verified if v[0] == "b"] == [v for v in whole.verified if v[0] == "b"]
    assert accepted(cached, "b") > 0


def test_shared_prefix_blocks_drop_their_last_block(pair):
    """Paged exports: vLLM's own prefix cache shares blocks and drops a hit's last block for eagle
    (v1/core/single_type_kv_cache_manager.py); the chain after each row stays in its blocks."""
    from optimum_neuron_chunked.vllm.compat import FIRST_CHUNK_HAS_LOOKAHEAD

    export_dir, hf, prompts = pair
    paged = head_export(kv_cache_blocks=16, kv_block_size=16)
    if not FIRST_CHUNK_HAS_LOOKAHEAD:
        assert "not supported on vLLM 0.16.0" in refusal_at_start(paged, speculative_config=eagle3(paged))
        return
    system = torch.cat(prompts[:3])  # three blocks
    a, b = torch.cat([system, prompts[3], prompts[5]]), torch.cat([system, prompts[4]])
    engine = engine_for(paged, eagle3(paged), enable_prefix_caching=True)
    engine.add("a", a, max_tokens=16)
    engine.step_until(lambda: engine.tokens["a"])
    engine.add("b", b, max_tokens=16)
    first = engine.step()
    assert f"b[32:{len(b)}]" in first.split(), first  # 48 shared positions, one block dropped
    run(engine)
    assert engine.tokens == {"a": hf_greedy(hf, a, 16), "b": hf_greedy(hf, b, 16)}
    assert accepted(engine, "b") > 0


def test_lora_rows_verify_beside_base_rows(pair):
    """The draft calls repeat the verify call's rows with their adapter column (the head runs
    none): a LoRA row's drafts are checked by its adapted target, so its tokens stay peft's."""
    from helpers import greedy
    from vllm.lora.request import LoRARequest

    from optimum_neuron_chunked.testing.lora_adapters import peft_greedy, peft_reference, write_adapter

    _, _, prompts = pair
    target, _ = trained_pair(cache_root())
    adapter = write_adapter(target, cache_root() / "adapters" / f"eagle3-{target.parent.name}", seed=5)
    export_dir = head_export(max_loras=1, max_lora_rank=8)
    engine = engine_for(export_dir, eagle3(export_dir), enable_lora=True, max_loras=1, max_lora_rank=8)
    requests = {"lora": torch.cat(prompts[:3]), "base": prompts[3]}
    engine.add_request("lora", requests["lora"], greedy(16), lora_request=LoRARequest("x", 1, str(adapter)))
    engine.add_request("base", requests["base"], greedy(16))
    run(engine)
    peft = peft_reference(target, {"x": adapter})
    assert engine.tokens == {
        "lora": peft_greedy(peft, requests["lora"].tolist(), "x", 16),
        "base": peft_greedy(peft, requests["base"].tolist(), "__base__", 16),
    }
    assert {r for r, d, _ in engine.verified if d} == {"lora", "base"}


def test_fp8_kv_with_a_head_speculates_as_it_decodes_plainly(pair):
    """The head's K/V in the fp8 pool; without --speculative-config the export decodes plainly."""
    _, _, prompts = pair
    export_dir = head_export(kv_cache_dtype="fp8")
    engines = {"plain": engine_for(export_dir), "eagle3": engine_for(export_dir, eagle3(export_dir))}
    tables = {}
    for name, engine in engines.items():
        engine.add("a", torch.cat(prompts[:3]), max_tokens=16)
        engine.add("b", prompts[3], max_tokens=16)
        tables[name] = run(engine)
    assert {kind for _, kinds in tables["plain"] for kind in kinds} == {"cp", "tg"}
    assert engines["eagle3"].tokens == engines["plain"].tokens
    assert accepted(engines["eagle3"]) > 0


@pytest.mark.parametrize("backend", ["eager", pytest.param("xla", marks=pytest.mark.xla)])
def test_a_checkpoint_is_exported_with_the_head_it_is_served_with(pair, backend, tmp_path, monkeypatch):
    """`vllm serve CHECKPOINT --speculative-config eagle3`: exported on the fly with the head,
    whose content joins the export cache's key; it drafts, and decodes as transformers does."""
    from pathlib import Path

    from vllm.engine.arg_utils import EngineArgs

    from optimum_neuron_chunked.config import NeuronConfig
    from optimum_neuron_chunked.export_cache.store import ENV
    from optimum_neuron_chunked.head_checkpoint import head_digest

    monkeypatch.setenv(ENV, str(tmp_path / "exports"))
    target, head = trained_pair(cache_root())
    copy = shutil.copytree(head, tmp_path / "head")

    def served() -> Path:
        config = EngineArgs(
            model=str(target), seed=0, max_model_len=128, max_num_seqs=2,
            speculative_config={"method": "eagle3", "model": str(copy), "num_speculative_tokens": K},
            additional_config={"backend": backend, "prefill_chunk_size": 32, "context_buckets": [64, 128]},
        ).create_engine_config()  # fmt: skip
        return Path(config.model_config.model)

    entry = served()
    exported = NeuronConfig.load(entry)
    assert (exported.speculation_head, exported.speculation_length) == (str(copy), K)
    assert (
        exported.speculation_head_digest == head_digest(copy)
        and (entry / "eagle3_head/config.json").is_file()
    )
    _, hf, prompts = pair
    engine = engine_for(entry, eagle3(entry))
    engine.add("a", torch.cat(prompts[:3]), max_tokens=16)
    run(engine)
    assert engine.tokens["a"] == hf_greedy(hf, torch.cat(prompts[:3]), 16) and accepted(engine) > 0
    if backend != "eager":
        return  # the head's share of the export-cache key is the same on every backend
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(config | {"rms_norm_eps": config["rms_norm_eps"] * 2}))
    assert served() != entry  # the same path, another head: another export


def test_vllm_serve_with_the_head_equals_transformers(pair, tmp_path):
    """`vllm serve EXPORT --speculative-config eagle3`: concurrent requests on more than the rows,
    transformers' tokens, drafts counted and accepted in vLLM's metrics."""
    from optimum_neuron_chunked.testing.server import Server, concurrent_greedy_tokens

    export_dir, hf, prompts = pair
    spec = json.dumps(eagle3(export_dir))
    server = Server(export_dir, tmp_path / "serve.log", "--speculative-config", spec).wait_ready()
    try:
        chosen = [torch.cat(prompts[:3]), prompts[3], torch.cat(prompts[4:6]), prompts[6]]
        got = concurrent_greedy_tokens(server.url, str(export_dir), [p.tolist() for p in chosen], 16)
        metrics = server.metrics()
    finally:
        assert server.stop() == [], "processes left behind after SIGTERM"
    assert got == [hf_greedy(hf, p, 16) for p in chosen]
    assert metrics.get("vllm:spec_decode_num_drafts_total", 0) > 0
    assert metrics.get("vllm:spec_decode_num_accepted_tokens_total", 0) > 0
