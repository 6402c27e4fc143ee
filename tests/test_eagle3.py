"""EAGLE3's math (modeling/eagle3.py) against references we do not write: the aux states against
transformers' hidden states, the head's first pass and recurrent steps against speculators'
Eagle3DraftModel; its graphs in place and functional, fp8 pools, tp 2 over gloo. Random heads
(testing/random_heads.py) serve these checks only."""

from __future__ import annotations

import pytest
import torch
from fixtures.export_models import checkpoint_path
from transformers import AutoConfig, AutoModelForCausalLM

from optimum_neuron_chunked.config import NeuronConfig
from optimum_neuron_chunked.graphs import INDEX_DTYPE
from optimum_neuron_chunked.modeling import family_spec, model_from_spec
from optimum_neuron_chunked.modeling.eagle3 import Eagle3Spec, head_pass, head_state, propose
from optimum_neuron_chunked.testing.random_heads import TINY_LLAMA_HEAD as HEAD
from optimum_neuron_chunked.testing.random_heads import random_head

K = 3
FP32 = dict(rtol=1e-4, atol=1e-4)  # fp32 against transformers: DESIGN's tolerance for logits


def head_model(config: dict, tensors: dict, neuron_config: NeuronConfig | None = None):
    """The tiny llama with the head, both loaded (the target from transformers)."""
    path = checkpoint_path("llama")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    family = family_spec(AutoConfig.from_pretrained(path))
    spec = Eagle3Spec.of(config, family, shares=("embed_tokens",))
    assert spec.fit_error(family) is None
    neuron_config = neuron_config or NeuronConfig(
        batch_size=2, sequence_length=64, prefill_chunk_size=16, context_buckets=(32, 64), speculation_length=K,
        speculation_head="random",
    )  # fmt: skip
    model = model_from_spec(family, neuron_config, eagle3=spec)
    model.load_weights(model.weights_from_hf(hf, head=head_state(spec, tensors)))
    return model.eval(), hf


def chunk_inputs(ids: torch.Tensor, start: int = 0):
    """One chunk [1, T] at positions start.. of whole-sequence block 0."""
    positions = torch.arange(start, start + ids.shape[0])[None]
    return ids[None].to(INDEX_DTYPE), positions.to(INDEX_DTYPE), torch.zeros(1, 1, dtype=INDEX_DTYPE)


@torch.no_grad()
@torch.no_grad()
def test_aux_states_are_transformers_hidden_states():
    model, hf = head_model(HEAD, random_head(HEAD, 0))
    ids = torch.randint(4, 380, (28,), generator=torch.Generator().manual_seed(1))
    entering = []  # transformers' residual stream entering each layer and the final norm
    hooks = [m.register_forward_pre_hook(lambda _, args: entering.append(args[0][0])) for m in
             [*hf.model.layers, hf.model.norm]]  # fmt: skip
    out = hf(ids[None], output_hidden_states=True)
    for hook in hooks:
        hook.remove()
    for start, stop in ((0, 16), (16, 28)):  # two chunks: the second reads the first's K/V
        model.hidden_states(*chunk_inputs(ids[start:stop], start), window=32)
        aux = model.aux_states[: stop - start].view(stop - start, 3, -1)
        for slot, k in enumerate(model.eagle3.aux_layer_ids):
            if k < 2:  # output_hidden_states[k], k < L; its last entry is after the final norm
                torch.testing.assert_close(aux[:, slot], out.hidden_states[k][0, start:stop], **FP32)
            torch.testing.assert_close(aux[:, slot], entering[k][start:stop], **FP32)


def test_head_configs_read_as_vllm_reads_them():
    family = family_spec(AutoConfig.from_pretrained(checkpoint_path("llama")))
    yuhuili = Eagle3Spec.of(
        HEAD | {"draft_vocab_size": 128, "eagle_aux_hidden_state_layer_ids": [2, 0, 0]}, family
    )
    assert (yuhuili.norm_before_residual, yuhuili.draft_vocab_size, yuhuili.aux_layer_ids) == (
        False,
        128,
        (0, 2),
    )
    layer = {k: v for k, v in HEAD.items() if k not in ("architectures", "eagle_aux_hidden_state_layer_ids")}
    speculators = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                   "speculators_config": {"algorithm": "eagle3"}, "transformer_layer_config": layer,
                   "draft_vocab_size": 256, "norm_output": True}  # fmt: skip
    spec = Eagle3Spec.of(
        speculators, family
    )  # no aux ids: the default (2, L // 2, L - 3) of a 2-layer target
    assert (spec.norm_before_residual, spec.norm_output, spec.draft_vocab_size) == (True, True, 256)
    assert spec.aux_layer_ids == (-1, 1, 2) and "aux layer ids [-1, 1, 2]" in spec.fit_error(family)
    wide = Eagle3Spec.of(HEAD | {"hidden_size": 96, "target_hidden_size": 96}, family)
    assert "target_hidden_size is 96, the target's 64" in wide.fit_error(family)
    assert "num_key_value_heads is 4" in Eagle3Spec.of(HEAD | {"num_key_value_heads": 4}, family).fit_error(
        family
    )
    assert "vocab_size is 500" in Eagle3Spec.of(HEAD | {"vocab_size": 500}, family).fit_error(family)


def test_heads_need_a_chunked_export_with_verify_graphs():
    from optimum_neuron_chunked.config import NeuronConfigError

    shape = dict(batch_size=2, sequence_length=64, context_buckets=(32, 64), speculation_head="h")
    with pytest.raises(NeuronConfigError, match="--speculation-length K"):
        NeuronConfig(**shape, prefill_chunk_size=16)
    with pytest.raises(NeuronConfigError, match="--prefill-chunk-size C"):
        NeuronConfig(**shape, speculation_length=K)
    with pytest.raises(NeuronConfigError, match="--mixed-step"):
        NeuronConfig(**shape, prefill_chunk_size=16, speculation_length=K, mixed_step=True)


def tp_drafts(layers=None, rank: int = 0, functional: bool = False) -> list[torch.Tensor]:
    """Drafts of a fixed run (two prompts in chunks, a verify step) of the tiny llama with a head
    whose draft vocabulary (127) tp 2 does not divide, built with `layers` (tp 1 by default)."""
    config_ = HEAD | {"draft_vocab_size": 127}
    config = NeuronConfig(batch_size=2, sequence_length=64, prefill_chunk_size=16, context_buckets=(32, 64),
                          speculation_length=K, speculation_head="random")  # fmt: skip
    tp1, hf = head_model(config_, random_head(config_, 15), config)
    spec = Eagle3Spec.of(config_, tp1.spec, shares=("embed_tokens",))
    model = model_from_spec(tp1.spec, config, layers, functional, eagle3=spec)
    model.load_weights(model.rank_weights(tp1.unsharded_weights(), rank))
    from optimum_neuron_chunked.graph_runner import GraphRunner
    from optimum_neuron_chunked.graphs import graph_module, graph_specs

    runner = GraphRunner(config, {s.name: graph_module(model.eval(), s, config) for s in graph_specs(config)})
    g, drafts, rows = torch.Generator().manual_seed(16), [], []
    with torch.no_grad():
        for block, n in enumerate((21, 9)):
            prompt = torch.randint(4, 380, (n + 1,), generator=g)
            for start in range(0, n, 16):
                stop = min(start + 16, n)
                runner.prefill(prompt[start:stop], start, (block,))
                drafts.append(runner.draft_after_chunk(prompt[start:stop], int(prompt[stop]), start))
            rows.append(torch.cat([prompt[n:], drafts[-1]]))
        runner.verify(rows, torch.tensor([21, 9]), [(0,), (1,)], False)
        drafts.append(runner.draft_after_verify(runner.last_verify, [5, 6], [1, K]))
    return drafts


def tp_rank(rank: int, world: int, init_file: str, out_file: str) -> None:
    import torch.distributed as dist
    from tp_gloo import DistLayers

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        drafts = tp_drafts(DistLayers(world), rank, functional=True)
        if rank == 0:
            torch.save(drafts, out_file)
    finally:
        dist.destroy_process_group()


def test_the_head_sharded_at_tp2_drafts_as_at_tp1(tmp_path):
    """gloo ranks (tp_gloo.DistLayers: the neuron backend's sharding arithmetic): the head's
    projections split by the target's rules, its draft lm_head padded, fc whole."""
    import torch.multiprocessing as mp

    mp.start_processes(tp_rank, args=(2, str(tmp_path / "init"), str(tmp_path / "tp2.pt")), nprocs=2,
                       start_method="spawn")  # fmt: skip
    sharded, single = torch.load(tmp_path / "tp2.pt"), tp_drafts()
    assert [d.tolist() for d in sharded] == [d.tolist() for d in single]


def test_an_fp8_pool_holds_the_heads_kv_at_scale_1():
    fp8 = NeuronConfig(batch_size=2, sequence_length=64, prefill_chunk_size=16, context_buckets=(32, 64),
                       speculation_length=K, speculation_head="random", kv_cache_dtype="fp8")  # fmt: skip
    model, _ = head_model(HEAD, random_head(HEAD, 12), fp8)
    assert model.draft_k_cache.dtype == torch.float8_e4m3fn and model.kv.draft_storage.scales == (1.0, 1.0)
    ids = torch.randint(4, 380, (16,), generator=torch.Generator().manual_seed(13))
    with torch.no_grad():
        model.hidden_states(*chunk_inputs(ids), window=32)
        drafts = propose(model, *chunk_inputs(ids), torch.tensor([15]), 32, False, K)
    assert drafts.shape == (1, K) and model.draft_k_cache[0, :, :16].float().abs().sum() > 0


@pytest.mark.parametrize("paged", [False, True], ids=["whole", "paged"])
def test_draft_graphs_compute_alike_in_place_and_functionally(paged):
    """Every graph of a head export, int32 inputs, the cache written in place (cpu, eager) or
    reassigned (xla, neuron): the same outputs, the same head K/V and aux states."""
    from optimum_neuron_chunked.graphs import example_inputs, graph_module, graph_specs

    fields = dict(kv_cache_blocks=12, kv_block_size=8) if paged else {}
    config = NeuronConfig(batch_size=2, sequence_length=64, prefill_chunk_size=16, context_buckets=(32, 64),
                          speculation_length=K, speculation_head="random", **fields)  # fmt: skip
    tensors = random_head(HEAD | {"draft_vocab_size": 128}, 14)
    models = [head_model(HEAD | {"draft_vocab_size": 128}, tensors, config)[0] for _ in range(2)]
    models[1].functional_cache = True
    for spec in graph_specs(config):
        inputs = example_inputs(spec, config)
        with torch.no_grad():
            outputs = [graph_module(m, spec, config)(*inputs) for m in models]
        for got, want in zip(*(o if isinstance(o, tuple) else (o,) for o in outputs), strict=True):
            torch.testing.assert_close(got, want)
        if spec.kind in ("dc", "dv"):
            assert outputs[0].dtype == INDEX_DTYPE and outputs[0].shape == (spec.batch, K)
    for name in ("draft_k_cache", "draft_v_cache", "aux_states"):
        torch.testing.assert_close(getattr(models[1], name), getattr(models[0], name))


def speculators_reference(config: dict, tensors: dict, embed: torch.Tensor, norm_before_residual: bool):
    """speculators 0.9.0's Eagle3DraftModel on the same weights (eager attention, fp32)."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    layer = LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures", "draft_vocab_size")})
    layer._attn_implementation = "eager"
    proposal = GreedyTokenProposalConfig(speculative_tokens=K)
    verifier = VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"])
    spec = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=config.get("draft_vocab_size", config["vocab_size"]),
        norm_before_residual=norm_before_residual, eagle_aux_hidden_state_layer_ids=[0, 1, 2],
        speculators_config=SpeculatorsConfig(algorithm="eagle3", proposal_methods=[proposal],
                                             default_proposal_method="greedy", verifier=verifier),
    )  # fmt: skip
    reference = Eagle3DraftModel(spec).eval()
    _, unexpected = reference.load_state_dict(tensors | {"embed_tokens.weight": embed}, strict=False)
    assert not unexpected
    return reference


def run_reference(reference, aux, ids, steps: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(draft-vocabulary logits, draft ids) of each training-time-test step."""
    logits = []
    hook = reference.lm_head.register_forward_hook(lambda _, __, out: logits.append(out[0]))
    with torch.no_grad():
        tokens = reference(hidden_states=aux[None], input_ids=ids[None], document_ids=torch.zeros_like(ids)[None],
                           position_ids=torch.arange(len(ids))[None], ttt_steps=steps)  # fmt: skip
    hook.remove()
    return logits, [t[0] for t in tokens]


@pytest.mark.parametrize("norm_before_residual", [False, True])
@pytest.mark.parametrize("draft_vocab", [512, 128], ids=["no-d2t", "d2t"])
def test_first_pass_is_speculators_eagle3(draft_vocab, norm_before_residual):
    config = HEAD | {"draft_vocab_size": draft_vocab, "norm_before_residual": norm_before_residual}
    tensors = random_head(config, 2, layer_prefix="layers.0.")  # speculators' layout
    model, hf = head_model(config, tensors)
    reference = speculators_reference(config, tensors, hf.model.embed_tokens.weight, norm_before_residual)
    g = torch.Generator().manual_seed(3)
    aux, ids = torch.randn(12, 3 * 64, generator=g), torch.randint(4, 500, (12,), generator=g)
    (want_logits, *_), (want_ids, *_) = run_reference(reference, aux, ids, 1)
    with torch.no_grad():
        hidden = model.draft.combine(aux[None])
        out, _ = head_pass(model, ids[None], torch.arange(12)[None], torch.zeros(1, 1, dtype=torch.long), hidden,
                           32, False)  # fmt: skip
        logits = model.draft.logits(out[0], model.lm_head)
        got = model.draft.target_ids(out[0], model.lm_head)
    torch.testing.assert_close(logits, want_logits, **FP32)
    d2t = tensors.get("d2t", torch.zeros(draft_vocab, dtype=torch.long))
    assert got.tolist() == (want_ids + d2t[want_ids]).tolist()


@pytest.mark.parametrize("norm_before_residual", [False, True])
@pytest.mark.parametrize("draft_vocab", [512, 128], ids=["no-d2t", "d2t"])
def test_recurrent_steps_are_speculators_training_time_test(draft_vocab, norm_before_residual):
    """From index `last`, step j of the chain is speculators' TTT step j at that index fed the
    head's own drafts (its teacher-forced tokens there set to them)."""
    config = HEAD | {"draft_vocab_size": draft_vocab, "norm_before_residual": norm_before_residual}
    tensors = random_head(config, 4, layer_prefix="layers.0.")
    model, hf = head_model(config, tensors)
    reference = speculators_reference(config, tensors, hf.model.embed_tokens.weight, norm_before_residual)
    g = torch.Generator().manual_seed(5)
    aux, ids, last = torch.randn(12, 3 * 64, generator=g), torch.randint(4, 500, (12,), generator=g), 6
    model.aux_states[:12] = aux
    logits, head_logits = [], model.draft.logits
    model.draft.logits = lambda *a: logits.append(head_logits(*a)) or logits[-1]
    with torch.no_grad():
        drafts = propose(model, *chunk_inputs(ids), torch.tensor([last]), 32, False, K)[0]
    fed = ids.clone()
    fed[last + 1 : last + K] = drafts[: K - 1]  # TTT step j reads fed[last + j] at index last
    want_logits, steps = run_reference(reference, aux, fed, K)
    d2t = tensors.get("d2t", torch.zeros(draft_vocab, dtype=torch.long))
    assert drafts.tolist() == [int(s[last] + d2t[s[last]]) for s in steps]
    for step in range(K):  # the first pass at index `last`, then each recurrent step
        torch.testing.assert_close(logits[step][0], want_logits[step][last], **FP32)
