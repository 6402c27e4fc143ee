"""EAGLE3 drafting through exports (--speculation-head): the export refuses a head that does not
fit and writes its weights alike on both weight paths; the runner keeps each row's aux states
through the graph order; generate() is transformers' greedy whatever the drafts, in fewer graph
calls with the trained head (testing/eagle3_heads.py); cpu and xla exports draft as eager."""

from __future__ import annotations

import json

import pytest
import torch
from fixtures.export_models import (
    BUCKETS,
    CHUNK,
    SEQUENCE_LENGTH,
    cache_root,
    checkpoint_path,
    export_with,
    trained_head_export,
    trained_prompts,
)
from helpers import RecordingGraphs
from transformers import AutoModelForCausalLM

from optimum_neuron_chunked import NeuronModelForCausalLM
from optimum_neuron_chunked.config import NeuronConfig
from optimum_neuron_chunked.modeling import family_spec, model_from_spec
from optimum_neuron_chunked.testing.eagle3_heads import trained_pair
from optimum_neuron_chunked.testing.random_heads import TINY_LLAMA_HEAD as HEAD
from optimum_neuron_chunked.testing.random_heads import cached_head, random_head
from optimum_neuron_chunked.testing.reference import hf_greedy

K = 3
SHAPE = dict(batch_size=2, sequence_length=SEQUENCE_LENGTH, prefill_chunk_size=CHUNK, context_buckets=BUCKETS,
             decode_widths=(1, 2), speculation_length=K)  # fmt: skip
LAYOUTS = {"whole": {}, "paged": dict(kv_cache_blocks=16, kv_block_size=16)}


def head_folder(config: dict, seed: int):
    return cached_head(cache_root(), config, seed)


def test_an_export_refuses_a_head_that_does_not_fit(tmp_path):
    from optimum_neuron_chunked.export.pipeline import export
    from optimum_neuron_chunked.modeling import UnsupportedArchitectureError

    head = head_folder(HEAD | {"num_key_value_heads": 4}, 1)
    with pytest.raises(UnsupportedArchitectureError, match="num_key_value_heads is 4, the target's 2"):
        export(
            str(checkpoint_path("llama")),
            tmp_path / "out",
            backend="eager",
            speculation_head=str(head),
            **SHAPE,
        )
    assert not (tmp_path / "out").exists()
    config = HEAD | {"draft_vocab_size": 128}  # d2t: its last draft id maps past the target's 512
    tensors = random_head(config, 1)
    tensors["d2t"][-1] = 512 - 127
    (tmp_path / "head").mkdir()
    torch.save(tensors, tmp_path / "head" / "pytorch_model.bin")
    (tmp_path / "head" / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        UnsupportedArchitectureError, match=r"d2t span \d+\.\.512, outside .* \[0, 512\); pass a head"
    ):
        export(
            str(checkpoint_path("llama")),
            tmp_path / "out",
            backend="eager",
            speculation_head=str(tmp_path / "head"),
            **SHAPE,
        )
    assert not (tmp_path / "out").exists()


def test_head_weights_stream_as_transformers_loads_them_and_shard_at_tp2(tmp_path):
    """A yuhuili head as it ships (pytorch_model.bin): the streamed export's weights equal the
    transformers path's, the head in --dtype; at tp 2 its projections shard by the target's
    suffix rules, fc stays whole and its lm_head's draft vocabulary is padded."""
    from safetensors.torch import load_file

    from optimum_neuron_chunked.backends.neuron import NeuronBackend
    from optimum_neuron_chunked.checkpoint_stream import stream_weights
    from optimum_neuron_chunked.export.pipeline import export, load_hf_config
    from optimum_neuron_chunked.head_checkpoint import fitting_spec, head_weights, load_head

    config = HEAD | {"draft_vocab_size": 127}
    (tmp_path / "head").mkdir()
    torch.save(random_head(config, 11), tmp_path / "head" / "pytorch_model.bin")
    (tmp_path / "head" / "config.json").write_text(json.dumps(config))
    options = SHAPE | dict(backend="eager", dtype="bfloat16", speculation_head=str(tmp_path / "head"))
    folders = [
        export(str(checkpoint_path("llama")), tmp_path / w, weights=w, **options)
        for w in ("stream", "transformers")
    ]
    streamed, loaded = (load_file(f / "model.safetensors") for f in folders)
    assert sorted(streamed) == sorted(loaded)
    assert all(torch.equal(streamed[n], loaded[n]) for n in streamed)
    assert streamed["draft.fc.weight"].dtype == torch.bfloat16 and streamed["draft.d2t"].dtype == torch.int64
    assert json.loads((folders[0] / "eagle3_head" / "config.json").read_text()) == config

    checkpoint = checkpoint_path("llama")
    hf_config = load_hf_config(str(checkpoint))
    neuron = NeuronConfig(backend="neuron", instance_type="trn1", tp_degree=2, model_type="llama",
                          **SHAPE, speculation_head="h", speculation_head_shares=("embed_tokens",))  # fmt: skip
    head = load_head(str(tmp_path / "head"))
    spec = fitting_spec(head.config, neuron, family_spec(hf_config))
    meta = model_from_spec(family_spec(hf_config), neuron, device="meta", eagle3=spec)
    files, tied = NeuronBackend().stream_targets(neuron)
    stream_weights(
        checkpoint, hf_config, neuron, meta, files, tied, tmp_path / "tp2", None, head_weights(head, spec)
    )
    ranks = [load_file(tmp_path / "tp2" / f.path) for f in files]
    assert ranks[0]["model.draft.lm_head.weight"].shape == (64, 64)  # 127 rows padded to 128, split
    assert ranks[0]["model.draft.layers.0.self_attn.q_proj.weight"].shape == (32, 128)
    assert torch.equal(ranks[0]["model.draft.fc.weight"], ranks[1]["model.draft.fc.weight"])


def test_the_head_is_never_quantized_with_the_target():
    """--quantization int8 quantizes the target's projections, never the head's (modeling/eagle3.py):
    its weights are stored as it ships them, in --dtype, without scales; and it drafts: generate
    is the same quantized target's greedy without the head."""
    from safetensors.torch import load_file

    config = HEAD | {"draft_vocab_size": 128}
    quantized = SHAPE | dict(quantization="int8")
    folder = export_with("llama", "eager", **quantized, speculation_head=str(head_folder(config, 12)))
    stored = load_file(folder / "model.safetensors")
    assert stored["model.layers.0.self_attn.q_proj.weight"].dtype == torch.int8  # the target is quantized
    assert "model.layers.0.self_attn.q_proj.scale" in stored
    draft = {name: t for name, t in stored.items() if name.startswith("draft.")}
    assert draft and not [name for name in draft if "scale" in name], sorted(draft)
    assert {t.dtype for name, t in draft.items() if name != "draft.d2t"} == {torch.float32}
    tensors = random_head(config, 12)
    assert torch.equal(draft["draft.fc.weight"], tensors["fc.weight"])
    for projection in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.o_proj", "mlp.down_proj"):
        assert torch.equal(
            draft[f"draft.layers.0.{projection}.weight"], tensors[f"midlayer.{projection}.weight"]
        )

    model = NeuronModelForCausalLM.from_pretrained(folder)
    graphs = model.runner.graphs = RecordingGraphs(model.runner.graphs)
    plain = {k: v for k, v in quantized.items() if k != "speculation_length"}
    target = NeuronModelForCausalLM.from_pretrained(export_with("llama", "eager", **plain))
    g = torch.Generator().manual_seed(13)
    prompts = [torch.randint(4, 380, (CHUNK + 3,), generator=g), torch.randint(4, 380, (11,), generator=g)]
    assert generate_rows(model, prompts, 20) == generate_rows(target, prompts, 20)
    assert {"dc", "dv"} <= {name.split("_")[0] for name in graphs.ran}, graphs.ran


def generate_rows(model, prompts: list[torch.Tensor], new: int) -> list[list[int]]:
    padded = torch.nn.utils.rnn.pad_sequence([p.flip(0) for p in prompts], batch_first=True).flip(1)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(p) for p in prompts], batch_first=True).flip(1)
    out = model.generate(padded, attention_mask=mask, max_new_tokens=new, do_sample=False)
    return [out[i, padded.shape[1] :].tolist() for i in range(len(prompts))]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_generate_with_a_head_is_greedy(layout, hf_reference):
    """Lossless whatever the drafts (a random head's are mostly rejected): chunk edges, a bucket
    edge, rows of different lengths, the chain reaching the sequence's end."""
    head = head_folder(HEAD | {"draft_vocab_size": 128}, 6)
    model = NeuronModelForCausalLM.from_pretrained(
        export_with("llama", "eager", **SHAPE, **LAYOUTS[layout], speculation_head=str(head))
    )
    graphs = model.runner.graphs = RecordingGraphs(model.runner.graphs)
    hf = hf_reference("llama")
    g = torch.Generator().manual_seed(7)
    for prompts, new in (
        ([torch.randint(4, 380, (CHUNK + 3,), generator=g), torch.randint(4, 380, (2 * CHUNK - 6,), generator=g)], 30),
        ([torch.randint(4, 380, (SEQUENCE_LENGTH - 9,), generator=g)], 9),  # to the sequence's last position
    ):  # fmt: skip
        assert generate_rows(model, prompts, new) == [hf_greedy(hf, p, new) for p in prompts]
    kinds = {name.split("_")[0] for name in graphs.ran}
    assert {"cp", "dc", "vf", "dv"} <= kinds and "tg" not in kinds, graphs.ran


def test_drafts_follow_their_rows_through_the_graph_order():
    """A verify call sorts its rows (longest context first) and pads them: the draft call after it
    reads each row's aux states there, and returns drafts in the caller's order - each row's drafts
    as when it runs alone (the same tokens rewrite the same K/V)."""
    head = head_folder(HEAD | {"draft_vocab_size": 128}, 6)
    runner = NeuronModelForCausalLM.from_pretrained(
        export_with("llama", "eager", **SHAPE, speculation_head=str(head))
    ).runner
    g = torch.Generator().manual_seed(10)
    prompts = [torch.randint(4, 380, (n,), generator=g) for n in (9, 20)]
    for block, p in enumerate(prompts):
        runner.prefill(p, 0, (block,))
    rows = [torch.randint(4, 380, (K + 1,), generator=g), torch.randint(4, 380, (2,), generator=g)]
    starts, next_tokens, accepted = torch.tensor([len(p) for p in prompts]), [7, 8], [2, 1]

    def drafts(order: list[int]) -> torch.Tensor:
        runner.verify([rows[i] for i in order], starts[order], [(i,) for i in order], False)
        return runner.draft_after_verify(
            runner.last_verify, [next_tokens[i] for i in order], [accepted[i] for i in order]
        )

    together = drafts([0, 1])
    assert together.shape == (2, K)
    assert drafts([1, 0]).tolist() == together.flip(0).tolist()
    assert [drafts([i])[0].tolist() for i in (0, 1)] == together.tolist()


def test_trained_head_generates_greedy_in_fewer_calls():
    target, _ = trained_pair(cache_root())
    model = NeuronModelForCausalLM.from_pretrained(trained_head_export("eager", **SHAPE))
    graphs = model.runner.graphs = RecordingGraphs(model.runner.graphs)
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    new = 40
    for prompt in trained_prompts()[:4]:
        graphs.ran.clear()
        assert generate_rows(model, [prompt], new) == [hf_greedy(hf, prompt, new)]
        plain = 1 + (new - 1)  # a one-chunk prompt, then one TG call a token
        assert len(graphs.ran) < plain, graphs.ran


def recording_drafts(model) -> list:
    """The drafts every draft call of `model`'s runner returns, in order."""
    runner, seen = model.runner, []
    for name in ("draft_after_chunk", "draft_after_verify"):
        method = getattr(runner, name)
        setattr(runner, name, lambda *a, _m=method, **kw: seen.append(_m(*a, **kw)) or seen[-1])
    return seen


def assert_drafts_as_eager(backend: str, shape: dict, seed: int, new_tokens: int) -> None:
    """A head export on `backend` generates the tokens and drafts the drafts of the same export on eager."""
    head = head_folder(HEAD | {"draft_vocab_size": 128}, 8)
    models = [
        NeuronModelForCausalLM.from_pretrained(export_with("llama", b, **shape, speculation_head=str(head)))
        for b in ("eager", backend)
    ]
    drafts = [recording_drafts(m) for m in models]
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, 380, (CHUNK + 5,), generator=g), torch.randint(4, 380, (11,), generator=g)]
    eager, other = (generate_rows(m, prompts, new_tokens) for m in models)
    assert other == eager
    assert len(drafts[1]) == len(drafts[0]) > 3
    for got, want in zip(drafts[1], drafts[0], strict=True):
        assert got.tolist() == want.tolist()


@pytest.mark.slow
def test_cpu_export_with_a_head_drafts_as_eager():
    shape = SHAPE | dict(decode_widths=(2,), context_buckets=(SEQUENCE_LENGTH,))  # fewer graphs to compile
    assert_drafts_as_eager("cpu", shape, seed=9, new_tokens=20)


@pytest.mark.xla
def test_xla_export_with_a_head_drafts_as_eager():
    """The draft graphs on torch-xla (the neuron backend's bundle, functional cache) lower to static
    device HLO (XlaRuntime raises otherwise) and draft what eager drafts."""
    pytest.importorskip("torch_xla")
    assert_drafts_as_eager("xla", SHAPE | dict(decode_widths=(2,)), seed=17, new_tokens=12)
