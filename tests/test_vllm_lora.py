"""vLLM's LoRA serving on the export's slots: vLLM's real scheduler and the real worker step by
step, requests of three adapters and the base over two slots, against peft (greedy tokens exact).

The export: llama, 2 rows, chunk 32, 2 adapter slots of rank 8 (eager on vLLM 0.32; xla on the
SDK's vLLM 0.16.0)."""

from __future__ import annotations

import pytest
import torch
from fixtures.export_models import checkpoint_path, export_with
from helpers import LORA_EXPORT, lora_adapters, prompt
from vllm_stepper import Engine

from optimum_neuron_chunked.testing.lora_adapters import peft_greedy, peft_reference, write_adapter

NEW_TOKENS = 5


@pytest.fixture(scope="module")
def peft():
    return peft_reference(checkpoint_path("llama"), lora_adapters())


@pytest.fixture(scope="module", params=["eager", pytest.param("xla", marks=pytest.mark.xla)])
def lora_export(request):
    return export_with("llama", request.param, **LORA_EXPORT)


def lora_engine(export_dir, prefix_caching: bool = False, **lora) -> Engine:
    from vllm.config import CacheConfig, LoRAConfig, ModelConfig, VllmConfig

    config = VllmConfig(
        model_config=ModelConfig(model=str(export_dir), dtype="float32", seed=0),
        cache_config=CacheConfig(enable_prefix_caching=prefix_caching),
        lora_config=LoRAConfig(**lora),
    )
    return Engine(export_dir, config)


def lora_request(name: str):
    from vllm.lora.request import LoRARequest

    ids = {"a": 1, "b": 2, "c": 3}
    return None if name == "__base__" else LoRARequest(name, ids[name], str(lora_adapters()[name]))


def add(engine: Engine, req_id: str, ids: torch.Tensor, name: str) -> None:
    from helpers import greedy

    engine.add_request(req_id, ids, greedy(NEW_TOKENS), lora_request=lora_request(name))


def test_requests_of_three_adapters_and_the_base_over_two_slots(lora_export, peft):
    engine = lora_engine(lora_export)
    assert engine.worker.vllm_config.lora_config.max_loras == 2  # vLLM's default 1 read as not given
    requests = {"r0": ("a", prompt(80, seed=1)), "r1": ("c", prompt(20, seed=2)),
                "r2": ("__base__", prompt(40, seed=3)), "r3": ("b", prompt(33, seed=4))}  # fmt: skip
    for req_id, (name, ids) in requests.items():
        add(engine, req_id, ids, name)
    mixed = []  # adapters of the rows of each decode call
    while engine.scheduler.has_requests():
        engine.step()
        plan = engine.worker.runner.last_plan
        if plan is not None and plan.decodes:
            mixed.append({d.adapter for d in plan.decodes} | {c.adapter for c in plan.chunks})
    for req_id, (name, ids) in requests.items():
        assert engine.tokens[req_id] == peft_greedy(peft, ids.tolist(), name, NEW_TOKENS), req_id
    assert any(len(adapters) > 1 for adapters in mixed)  # rows of different adapters in one step


@pytest.mark.parametrize(
    "paged, names",
    # whole-sequence blocks (our copy connector) hold two prompts: a third adapter would evict a's
    [(False, ["a", "b", "a"]), (True, ["a", "__base__", "b", "a"])],
    ids=["copy", "paged"],
)
def test_the_prefix_cache_never_shares_kv_across_adapters(lora_export, peft, paged, names):
    if paged:  # vLLM's own prefix cache over a pool of 16-token blocks
        backend = "xla" if "-xla-" in lora_export.name else "eager"
        lora_export = export_with("llama", backend, **LORA_EXPORT, kv_cache_blocks=24, kv_block_size=16)
    engine = lora_engine(lora_export, prefix_caching=True)
    ids = prompt(70, seed=5)
    cached = []
    for i, name in enumerate(names):
        add(engine, f"q{i}", ids, name)
        starts = []  # where the request's computed positions begin: after its cached prefix
        while engine.scheduler.has_requests():
            engine.step()
            plan = engine.worker.runner.last_plan  # None: a step that waited
            starts += [c.start for c in plan.chunks if c.req_id == f"q{i}"] if plan else []
        cached.append(min(starts))
        assert engine.tokens[f"q{i}"] == peft_greedy(peft, ids.tolist(), name, NEW_TOKENS), name
    assert cached[:-1] == [0] * (len(names) - 1) and cached[-1] >= 32, cached


def test_a_refused_adapter_raises_its_reason_and_the_worker_serves_on(lora_export, tmp_path, peft):
    from vllm.lora.request import LoRARequest

    engine = lora_engine(lora_export)
    big = write_adapter(checkpoint_path("llama"), tmp_path / "big", seed=7, rank=16)
    with pytest.raises(ValueError, match="rank 16 exceeds the export's --max-lora-rank 8"):
        engine.worker.add_lora(LoRARequest("big", 9, str(big)))
    assert engine.worker.add_lora(lora_request("a")) and engine.worker.pin_lora(1)
    assert engine.worker.list_loras() == {1}
    ids = prompt(30, seed=6)
    add(engine, "after", ids, "a")
    engine.step_until(lambda: not engine.scheduler.has_requests())
    assert engine.tokens["after"] == peft_greedy(peft, ids.tolist(), "a", NEW_TOKENS)
    assert engine.worker.remove_lora(1) and engine.worker.list_loras() == set()


def test_adapters_with_ngram_speculation_verify_each_rows_drafts_under_its_adapter(lora_export, peft):
    """Verify rows (a token and its drafts, one VF call) of two adapters and the base: tokens as peft's."""
    from vllm.engine.arg_utils import EngineArgs

    backend = "xla" if "-xla-" in lora_export.name else "eager"
    export = export_with("llama", backend, **LORA_EXPORT, speculation_length=3)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    args = EngineArgs(model=str(export), seed=0, speculative_config=spec, enable_lora=True)
    engine = Engine(export, args.create_engine_config())
    span = prompt(11, seed=8)
    requests = {"s0": ("a", span.repeat(4)), "s1": ("__base__", span.repeat(3)), "s2": ("b", span.repeat(5))}
    want = {r: peft_greedy(peft, ids.tolist(), name, NEW_TOKENS) for r, (name, ids) in requests.items()}
    # drafts: the right continuation for s0 and s2, wrong ones for s1 (rejected)
    engine.drafts_for = lambda r, tokens: want[r][len(tokens) : len(tokens) + 3] if r != "s1" else [5, 6, 7]
    for req_id, (name, ids) in requests.items():
        add(engine, req_id, ids, name)
    engine.step_until(lambda: not engine.scheduler.has_requests())
    assert {r: engine.tokens[r] for r in requests} == want
    assert {r for r, drafts, _ in engine.verified if drafts} == set(requests)  # every row verified drafts
