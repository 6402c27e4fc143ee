"""Padded-position masking, the scatter write and bucket windows, on a real tiny decoder."""

from __future__ import annotations

import pytest
import torch
from fixtures.export_models import checkpoint_path
from transformers import AutoConfig, AutoModelForCausalLM

from optimum_neuron_chunked.backends.cpu.kernels import CpuKernels, KernelChoices
from optimum_neuron_chunked.config import NeuronConfig
from optimum_neuron_chunked.graph_runner import pad_repeat_last
from optimum_neuron_chunked.graphs import PrefillGraph
from optimum_neuron_chunked.modeling import build_model
from optimum_neuron_chunked.modeling.kv_layout import KVPool

CHUNK, SEQ = 16, 64

# every cpu-backend kernel switched on, SDPA in decode graphs as well
EVERY_KERNEL = KernelChoices(
    sdpa_prefill_from_window=1,
    sdpa_decode_from_window=1,
    block_view=True,
    live_window=True,
    per_row_live=True,
    rowwise_linear_rows=2,
    onednn_linear=True,
    onednn_chunk_attention_from_window=1,
)


@pytest.fixture(scope="module")
def decoder():
    path = checkpoint_path("llama")
    config = NeuronConfig(batch_size=2, sequence_length=SEQ, prefill_chunk_size=CHUNK, backend="eager")
    model = build_model(AutoConfig.from_pretrained(path), config)
    model.load_weights(model.weights_from_hf(AutoModelForCausalLM.from_pretrained(path)))
    return model.eval()


def run_chunk(model, tokens, start, block=0, width=CHUNK, window=SEQ):
    ids = pad_repeat_last(tokens[None], width, dim=1)
    pos = pad_repeat_last(torch.arange(start, start + len(tokens))[None], width, dim=1)
    with torch.no_grad():
        return PrefillGraph(model, window)(ids, pos, torch.tensor([[block]]))[0]


def test_pad_repeat_last_repeats_the_last_entry():
    x = torch.tensor([[5, 6, 7]])
    assert pad_repeat_last(x, 6, dim=1).tolist() == [[5, 6, 7, 7, 7, 7]]
    assert pad_repeat_last(x.T, 2 + 3, dim=0).flatten().tolist() == [5, 6, 7, 7, 7]
    with pytest.raises(ValueError):
        pad_repeat_last(x, 2, dim=1)


def test_padded_copies_write_identical_kv(decoder):
    """The K/V a padded copy computes equal the last real token's, so the duplicate scatter is a no-op."""
    tokens = torch.arange(5, 5 + 9)
    captured = []
    hook = decoder.model.layers[1].self_attn.k_proj.register_forward_hook(lambda m, i, o: captured.append(o))
    try:
        run_chunk(decoder, tokens, start=0)
    finally:
        hook.remove()
    k = captured[0][0]  # [C, Hkv * D] at the deepest layer
    for padded in range(9, CHUNK):
        torch.testing.assert_close(k[padded], k[8], atol=0, rtol=0)


def test_padding_does_not_change_cache_or_logits(decoder):
    tokens = torch.arange(5, 5 + 9)
    for cache in decoder.cache_names():
        getattr(decoder, cache).zero_()
    padded_logits = run_chunk(decoder, tokens, start=0, width=CHUNK)
    padded_cache = [getattr(decoder, c)[0].clone() for c in decoder.cache_names()]
    for cache in decoder.cache_names():
        getattr(decoder, cache).zero_()
    exact_logits = run_chunk(decoder, tokens, start=0, width=len(tokens))
    torch.testing.assert_close(padded_logits, exact_logits, atol=1e-5, rtol=0)
    for name, before in zip(decoder.cache_names(), padded_cache, strict=True):
        torch.testing.assert_close(getattr(decoder, name)[0], before, atol=1e-5, rtol=0)


def test_logits_come_from_last_real_token(decoder):
    tokens = torch.arange(5, 5 + 9)
    logits = run_chunk(decoder, tokens, start=0)
    shorter = run_chunk(decoder, tokens[:8], start=0)
    assert not torch.allclose(logits, shorter)  # a different last token gives different logits
    hf = AutoModelForCausalLM.from_pretrained(checkpoint_path("llama")).eval()
    with torch.no_grad():
        torch.testing.assert_close(logits, hf(tokens[None]).logits[0, -1], atol=1e-4, rtol=0)


def test_stale_cache_entries_beyond_the_context_are_never_read(decoder):
    tokens = torch.arange(5, 5 + 9)
    for cache in decoder.cache_names():
        getattr(decoder, cache).zero_()
    clean = run_chunk(decoder, tokens, start=0)
    for cache in decoder.cache_names():  # a previous request's leftovers in the block
        getattr(decoder, cache)[0, :, 9:].normal_(0, 100)
    dirty = run_chunk(decoder, tokens, start=0)
    torch.testing.assert_close(dirty, clean, atol=0, rtol=0)


def test_blocks_are_isolated(decoder):
    tokens = torch.arange(5, 5 + 9)
    alone = run_chunk(decoder, tokens, start=0, block=0)
    run_chunk(decoder, torch.arange(40, 60), start=0, block=1, width=20)
    again = run_chunk(decoder, tokens[-1:], start=8, block=0)  # re-run the last token on block 0
    torch.testing.assert_close(again, alone, atol=1e-5, rtol=0)


def test_bucket_window_matches_full_window(decoder):
    tokens = torch.arange(5, 5 + 9)
    torch.testing.assert_close(
        run_chunk(decoder, tokens, start=0, window=16),
        run_chunk(decoder, tokens, start=0, window=SEQ),
        atol=1e-5,
        rtol=0,
    )


def ring_and_linear(family: str, chunk: int):
    """The same checkpoint twice: sliding layers in rings of window + chunk, and position-indexed."""
    path = checkpoint_path(family)
    hf_config = AutoConfig.from_pretrained(path)
    state = None
    models = []
    for width in (chunk, None):
        config = NeuronConfig(
            batch_size=2, sequence_length=128, prefill_chunk_size=width or 0, backend="eager"
        )
        model = build_model(hf_config, config).eval()
        state = state or model.weights_from_hf(AutoModelForCausalLM.from_pretrained(path))
        model.load_weights(state)
        models.append(model)
    return models


@pytest.mark.parametrize("family", ["gemma3_text", "gpt_oss"])
def test_ring_layers_equal_position_indexed_layers_over_stale_blocks(family):
    """Chunks of every width up to C, then decodes, in a block a previous request filled with
    garbage: the ring layers (window + C positions) give the logits of full-length caches."""
    chunk = 16
    ring, linear = ring_and_linear(family, chunk)
    sliding = [i for i, w in enumerate(ring.spec.sliding_windows) if w is not None]
    assert sliding and all(ring.kv.cache_lengths[i] == ring.spec.sliding_windows[i] + chunk for i in sliding)
    assert all(getattr(ring, f"k_cache_{i}").shape[2] < 128 for i in sliding)
    for cache in ring.cache_names():
        getattr(ring, cache).normal_(0, 100)
    tokens, start = torch.randint(4, 380, (110,), generator=torch.Generator().manual_seed(3)), 0
    for width in [16, 1, 7, 16, 16, 3, 16, 16]:  # 91 positions, across the windows (36-40)
        piece = tokens[start : start + width]
        got, want = (
            run_chunk(m, piece, start=start, block=1, width=chunk, window=128) for m in (ring, linear)
        )
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        start += width
    with torch.no_grad():
        for _ in range(8):  # TG: one row per block, block 0 idle
            ids, pos, seq = (
                tokens[start].view(1, 1).repeat(2, 1),
                torch.tensor([[0], [start]]),
                torch.tensor([[0], [1]]),
            )
            got, want = (
                m.logits(m.hidden_states(ids, pos, seq, 128, decode_rows=True))[1] for m in (ring, linear)
            )
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
            start += 1


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_moe", "gpt_oss", "mistral"])
def test_fused_attention_kernel_equals_the_masked_softmax(family):
    """SDPA (the cpu backend's core from its threshold window up) over block views (its chunks
    read block 1 as a scalar), the masked softmax over the live positions only (live_window),
    per decode row over its own block and position (per_row_live) with the decode rows' linear
    layers as dot products (rowwise_linear_rows), against the reference
    masked softmax over gathered bucket windows, eager here (the cpu parity tests run it
    compiled): chunks, then decodes with an idle block, over stale blocks; gemma3's ring layers
    included."""
    from optimum_neuron_chunked.backends.cpu.kernels import kernel_choices
    from optimum_neuron_chunked.modeling import model_from_spec

    path = checkpoint_path(family)
    hf = AutoModelForCausalLM.from_pretrained(path)
    config = NeuronConfig(batch_size=2, sequence_length=128, prefill_chunk_size=16, backend="eager")
    spec = build_model(AutoConfig.from_pretrained(path), config).spec
    models = []
    choices = [
        EVERY_KERNEL,
        KernelChoices(live_window=True),
        KernelChoices(per_row_live=True),
        KernelChoices(),  # the reference: masked softmax over gathered bucket windows
    ]
    for kernels in choices:
        model = model_from_spec(spec, config, kernels=CpuKernels(kernels, KVPool.of(config))).eval()
        model.load_weights(model.weights_from_hf(hf))
        for cache in model.cache_names():
            getattr(model, cache).normal_(0, 100, generator=torch.Generator().manual_seed(5))
        models.append(model)
    assert kernel_choices().sdpa_prefill_from_window
    tokens, start = torch.randint(4, 380, (80,), generator=torch.Generator().manual_seed(4)), 0
    for width in [16, 5, 16, 16]:
        piece = tokens[start : start + width]
        *got, want = (run_chunk(m, piece, start=start, block=1, width=16, window=64) for m in models)
        for logits in got:
            torch.testing.assert_close(logits, want, atol=1e-4, rtol=0)
        start += width
    with torch.no_grad():
        for _ in range(4):
            ids, pos, seq = (
                tokens[start].view(1, 1).repeat(2, 1),
                torch.tensor([[0], [start]]),
                torch.tensor([[0], [1]]),
            )
            *got, want = (m.logits(m.hidden_states(ids, pos, seq, 64, decode_rows=True))[1] for m in models)
            for logits in got:
                torch.testing.assert_close(logits, want, atol=1e-4, rtol=0)
            start += 1


@pytest.mark.parametrize("prefill_from, decode_from", [(1, None), (None, 1), (SEQ, SEQ + 1)])
def test_sdpa_is_chosen_per_graph_kind_and_bucket(monkeypatch, prefill_from, decode_from):
    """kernels.sdpa_prefill_from_window / sdpa_decode_from_window: a chunk (one row) and a decode
    step (one row per block) each take SDPA only from their own threshold on."""
    from optimum_neuron_chunked.modeling import model_from_spec

    path = checkpoint_path("llama")
    config = NeuronConfig(batch_size=2, sequence_length=SEQ, prefill_chunk_size=CHUNK, backend="eager")
    spec = build_model(AutoConfig.from_pretrained(path), config).spec
    kernels = KernelChoices(sdpa_prefill_from_window=prefill_from, sdpa_decode_from_window=decode_from)
    model = model_from_spec(spec, config, kernels=CpuKernels(kernels, KVPool.of(config))).eval()
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(
        torch.nn.functional, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or sdpa(*a, **k)
    )
    run_chunk(model, torch.arange(5, 5 + CHUNK), start=0)
    prefill_calls = len(calls)
    with torch.no_grad():
        model.hidden_states(torch.tensor([[3], [4]]), torch.tensor([[CHUNK], [0]]), torch.tensor([[0], [1]]), SEQ,
                            decode_rows=True)  # fmt: skip
    layers = len(model.model.layers)
    assert (prefill_calls, len(calls) - prefill_calls) == (
        layers if prefill_from is not None and SEQ >= prefill_from else 0,
        layers if decode_from is not None and SEQ >= decode_from else 0,
    )


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["cp", "tg"])
def test_cpu_kernels_compiled_by_aotinductor_equal_the_masked_softmax(tmp_path, kind):
    """The cpu backend's kernels as AOTInductor compiles them - SDPA in decode graphs too (the
    cpu backend's decode graphs keep the masked softmax), a view of block 1 read as a scalar,
    attention over the live positions read as a scalar, per decode row (per_row_live), decode
    rows' linear layers as dot products (rowwise_linear_rows) - against eager's masked softmax
    over gathered bucket windows and ATen's linear: a chunk graph, and a decode graph with an
    idle block, over stale caches."""
    from optimum_neuron_chunked.graphs import GraphSpec, example_inputs, graph_module
    from optimum_neuron_chunked.modeling import model_from_spec

    path = checkpoint_path("qwen3")
    hf = AutoModelForCausalLM.from_pretrained(path)
    config = NeuronConfig(batch_size=2, sequence_length=SEQ, prefill_chunk_size=CHUNK, backend="cpu")
    spec = build_model(AutoConfig.from_pretrained(path), config).spec
    models = [
        model_from_spec(spec, config, kernels=CpuKernels(EVERY_KERNEL, KVPool.of(config))),
        model_from_spec(spec, config),
    ]
    graph = GraphSpec("cp", 1, CHUNK, SEQ) if kind == "cp" else GraphSpec("tg", 2, 1, SEQ)
    for model in models:
        model.load_weights(model.weights_from_hf(hf))
        for cache in model.cache_names():
            getattr(model, cache).normal_(0, 100, generator=torch.Generator().manual_seed(6))
            # every position a call reads before writing it (up to 20 + 7 below) holds
            # real-sized K/V. Std-100 keys there make any fp32 attention (SDPA, oneDNN's, the
            # masked softmax) ~1e-4 off float64, so two of them agree to 1e-4 only by luck.
            getattr(model, cache)[:, :, :27].normal_(0, 1, generator=torch.Generator().manual_seed(7))
    inputs = list(example_inputs(graph, config))
    inputs[0] = torch.randint(
        4, 380, inputs[0].shape, dtype=inputs[0].dtype, generator=torch.Generator().manual_seed(8)
    )
    # positions from 20: earlier positions hold stale garbage, and so do those after the last
    inputs[1] = inputs[1] + torch.tensor([[20]] if kind == "cp" else [[0], [20]], dtype=inputs[1].dtype)
    inputs[2] = torch.tensor([[1]] if kind == "cp" else [[0], [1]], dtype=inputs[2].dtype)
    with torch.no_grad():
        program = torch.export.export(graph_module(models[0].eval(), graph, config), tuple(inputs))
        package = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "g.pt2"))
        compiled = torch._inductor.aoti_load_package(package)
        reference = graph_module(models[1].eval(), graph, config)
        for shift in (0, 7):  # a second call further on: the live length is read per call
            inputs[1] = inputs[1] + shift
            got, want = compiled(*inputs), reference(*inputs)
            if kind == "tg":  # (tokens, logits): row 0 is the idle-ish block at position 0
                got, want = got[1][1], want[1][1]
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("onednn", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(2, 1, 24), (3, 24), (1, 5, 24)])
def test_cpu_linear_equals_linear(shape, bias, onednn):
    """kernels.rowwise_linear_rows / onednn_linear: up to rowwise_rows rows as dot products,
    more through oneDNN or ATen; the same parameters either way."""
    from optimum_neuron_chunked.backends.cpu.linear import CpuLinear

    torch.manual_seed(0)
    cpu = CpuLinear(24, 40, bias=bias, rowwise_rows=3, onednn=onednn)
    linear = torch.nn.Linear(24, 40, bias=bias)
    linear.load_state_dict(cpu.state_dict())
    x = torch.randn(shape)
    with torch.no_grad():
        torch.testing.assert_close(cpu(x), linear(x), atol=1e-5, rtol=1e-5)
