"""Multi-LoRA on the static graphs: adapters written by peft, served from an export's slots,
against peft on transformers (fp32, greedy tokens exact, logits within 1e-4).

The export: llama 2 rows, chunk 32, 2 adapter slots of rank 8. Three adapters of different
ranks, targets and scalings over the 2 slots, so serving them swaps slots by writes."""

from __future__ import annotations

import re

import pytest
import torch
from fixtures.export_models import cache_root, checkpoint_path, export_with
from helpers import LORA_EXPORT, lora_adapters, prompt

from optimum_neuron_chunked.testing.lora_adapters import peft_greedy, peft_reference, write_adapter

NEW_TOKENS = 6


@pytest.fixture(scope="module")
def peft():
    return peft_reference(checkpoint_path("llama"), lora_adapters())


@pytest.fixture(scope="module")
def model(request):
    from optimum_neuron_chunked import NeuronModelForCausalLM

    backend = getattr(request, "param", "eager")
    loaded = NeuronModelForCausalLM.from_pretrained(export_with("llama", backend, **LORA_EXPORT))
    for name, path in lora_adapters().items():
        loaded.load_adapter(path, adapter_name=name)
    return loaded


def expected(peft, prompts, names, new_tokens=NEW_TOKENS, eos=2, pad=3) -> list[list[int]]:
    """peft's greedy tokens, as generate() returns them: a row ends at its eos, then pad."""
    rows = [peft_greedy(peft, p.tolist(), n, new_tokens) for p, n in zip(prompts, names, strict=True)]
    rows = [r[: r.index(eos) + 1] if eos in r else r for r in rows]
    width = max(len(r) for r in rows)
    return [r + [pad] * (width - len(r)) for r in rows]


def test_adapters_change_the_base_tokens(peft):
    """Else every comparison below would prove nothing."""
    p = prompt(40, seed=1).tolist()
    tokens = {n: tuple(peft_greedy(peft, p, n, NEW_TOKENS)) for n in ("a", "b", "c", "__base__")}
    assert len(set(tokens.values())) == 4, tokens


def left_padded(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.stack([torch.cat([torch.zeros(width - len(p), dtype=p.dtype), p]) for p in prompts])
    mask = torch.stack([(torch.arange(width) >= width - len(p)).long() for p in prompts])
    return ids, mask


def generated(model, prompts, names, new_tokens=NEW_TOKENS) -> list[list[int]]:
    ids, mask = left_padded(prompts)
    out = model.generate(ids, mask, max_new_tokens=new_tokens, do_sample=False, adapter_names=names)
    return out[:, ids.shape[1] :].tolist()


@pytest.fixture
def graph_calls(model):
    """The names of the graphs the model calls, in order."""
    calls, graphs = [], dict(model.runner.graphs)
    for name, graph in graphs.items():
        model.runner.graphs[name] = lambda *x, _g=graph, _n=name: (calls.append(_n), _g(*x))[1]
    yield calls
    model.runner.graphs.update(graphs)


def test_rows_of_an_adapter_and_the_base_share_each_decode_call(model, peft, graph_calls):
    prompts, names = [prompt(70, seed=2), prompt(45, seed=3)], ["a", "__base__"]  # 3 chunks, 2 chunks
    assert generated(model, prompts, names) == expected(peft, prompts, names)
    assert [c[:2] for c in graph_calls].count("tg") == NEW_TOKENS - 1  # one call a step for both rows


def test_more_adapters_than_slots_swap_slots_between_calls(model, peft):
    for names in (["b", "c"], ["a", "b"], ["c", "__base__"], ["c", "a"]):  # 3 adapters, 2 slots
        prompts = [prompt(33, seed=4), prompt(20, seed=5)]
        assert generated(model, prompts, names) == expected(peft, prompts, names), names


def test_logits_match_peft_for_every_adapter(model, peft):
    from optimum_neuron_chunked.generation import prefill_prompt

    ids = prompt(50, seed=6)
    for name in ("a", "b", "c", "__base__"):
        (slot,) = model.adapter_slots([name], 1)
        blocks = model.kv_pool.acquire(len(ids))
        try:
            logits = prefill_prompt(model.runner, ids, blocks, slot)
        finally:
            model.kv_pool.release(blocks)
        with torch.no_grad():
            want = peft(input_ids=ids[None], adapter_names=[name]).logits[0, -1]
        torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)


def test_an_adapter_not_loaded_is_refused_by_name(model):
    ids, mask = left_padded([prompt(8), prompt(9)])
    with pytest.raises(ValueError, match=r"\['z'\] are not loaded"):
        model.generate(ids, mask, max_new_tokens=1, adapter_names=["a", "z"])


def refused_adapter(tmp_path, case: str):
    """An adapter folder of the kind `case` names, written by peft (or edited after)."""
    from safetensors.torch import load_file, save_file

    base, folder = checkpoint_path("llama"), tmp_path / case
    kinds = {
        "dora": dict(use_dora=True),
        "bias": dict(bias="lora_only"),
        "modules_to_save": dict(modules_to_save=["lm_head"]),
        "rank": dict(rank=16),
        "embedding": dict(target_modules=["embed_tokens"]),
    }
    options = dict(kinds.get(case, {}))
    write_adapter(base, folder, seed=9, rank=options.pop("rank", 4), **options)
    weights = folder / "adapter_model.safetensors"
    if case == "unreadable":
        weights.write_bytes(weights.read_bytes()[:100])
    elif case in ("other_base", "experts"):
        tensors = load_file(weights)
        key = next(k for k in tensors if "q_proj.lora_A" in k)
        if case == "other_base":
            tensors[key] = torch.zeros(4, 96)
        else:
            tensors = {
                k.replace("self_attn.q_proj", "mlp.experts.0.gate_proj"): v for k, v in tensors.items()
            }
        save_file(tensors, weights)
    return folder


@pytest.mark.parametrize(
    "case, reason",
    [
        ("dora", "DoRA"),
        ("bias", "bias='lora_only'"),
        ("modules_to_save", "modules_to_save"),
        ("rank", "rank 16 exceeds the export's --max-lora-rank 8"),
        ("embedding", "LoRA on embed_tokens is not served"),
        ("not_compiled", "the export has no slots on down_proj"),
        ("other_base", "trained on another base model"),
        ("experts", "expert (MoE) projections"),
        ("unreadable", "unreadable"),
    ],
)
def test_adapters_the_slots_cannot_hold_are_refused_by_name(tmp_path, case, reason):
    from transformers import AutoConfig

    from optimum_neuron_chunked.lora_adapter import LoraConfigError, read_adapter
    from optimum_neuron_chunked.modeling.family import family_spec
    from optimum_neuron_chunked.modeling.lora import LoraSpec

    spec = family_spec(AutoConfig.from_pretrained(checkpoint_path("llama")))
    targets = (
        ("q_proj", "v_proj")
        if case == "not_compiled"
        else ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    )
    folder = refused_adapter(tmp_path, "plain" if case == "not_compiled" else case)
    with pytest.raises(LoraConfigError, match=re.escape(reason)):
        read_adapter(folder, spec, LoraSpec(2, 8, targets), torch.float32)


def test_phi3_fused_qkv_and_gate_up_adapters_split_over_the_projections():
    from optimum_neuron_chunked import NeuronModelForCausalLM

    base = checkpoint_path("phi3")
    folder = write_adapter(base, cache_root() / "adapters" / "phi3", seed=4, rank=8,
                           target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])  # fmt: skip
    model = NeuronModelForCausalLM.from_pretrained(export_with("phi3", "eager", **LORA_EXPORT))
    model.load_adapter(folder, adapter_name="fused")
    peft = peft_reference(base, {"fused": folder})
    prompts, names = [prompt(40, seed=7), prompt(40, seed=7)], ["fused", "__base__"]
    want = expected(peft, prompts, names)
    assert want[0] != want[1] and generated(model, prompts, names) == want


def test_an_int8_base_keeps_its_weights_and_adapters_apply_on_them():
    """The reference: peft over transformers' model with the export's int8 weights dequantized."""
    from transformers import AutoModelForCausalLM

    from optimum_neuron_chunked import NeuronModelForCausalLM
    from optimum_neuron_chunked.modeling.quantization import quantize

    path = lora_adapters()["a"]
    model = NeuronModelForCausalLM.from_pretrained(
        export_with("llama", "eager", quantization="int8", **LORA_EXPORT)
    )
    model.load_adapter(path, adapter_name="a")
    hf = AutoModelForCausalLM.from_pretrained(checkpoint_path("llama"), dtype=torch.float32)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("_proj.weight") and ".layers." in name:
                stored, scale = quantize(param, "int8")
                param.copy_(stored.float() * scale)
    from peft import PeftModel

    peft = PeftModel.from_pretrained(hf, path, adapter_name="a").eval()
    prompts, names = [prompt(50, seed=8), prompt(30, seed=9)], ["a", "__base__"]
    assert generated(model, prompts, names) == expected(peft, prompts, names)


def test_slot_table_places_least_recently_used_first_and_keeps_pins():
    from optimum_neuron_chunked.adapter_slots import SlotsExhausted, SlotTable

    table = SlotTable(2)
    assert table.place(["a", "b"]) == [(0, "a"), (1, "b")]
    assert table.place(["a"]) == [] and table.place(["c"]) == [(1, "c")]  # b was least recently used
    table.pin("a")
    table.release("a")  # a reload under the same key: a new slot write, the pin kept
    assert table.place(["a"]) == [(0, "a")] and "a" in table.pinned
    assert table.place(["b"]) == [(1, "b")]  # c leaves; the pinned a stays
    with pytest.raises(SlotsExhausted, match="one must stay free"):
        table.pin("b")


def test_the_cli_takes_lora_target_modules_as_one_comma_separated_word():
    import argparse

    from optimum_neuron_chunked.export.cli import add_export_arguments

    parser = argparse.ArgumentParser()
    add_export_arguments(parser)
    words = ["--model", "m", "--batch_size", "1", "--sequence_length", "64", "--max-loras", "2"]
    args = parser.parse_args([*words, "--lora-target-modules", "qkv_proj,o_proj", "out"])
    assert (args.lora_target_modules, args.output) == (("qkv_proj", "o_proj"), "out")
