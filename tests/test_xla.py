"""The Neuron gate: every graph kind of every family, run by the xla backend (the neuron
backend's bundle on torch-xla's CPU device, with the graphs' int32 inputs), equals eager,
falls back to the host for nothing and lowers to static HLO with no custom-call, host
transfer or loop; xla exports loaded by the loader generate what transformers does.

Run with `make test-sdk` (the `.venv-sdk` environment); skipped where torch-xla is absent.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch_xla", reason="XLA checks run in .venv-sdk: make test-sdk")

import torch  # noqa: E402
from fixtures.export_models import (  # noqa: E402
    BUCKETS,
    CHUNK,
    EXPORTS,
    SEQUENCE_LENGTH,
    checkpoint_path,
)
from helpers import HLO_CENSUS, export_params  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from optimum_neuron_chunked.backends.xla import XlaRuntime, fallback_ops, reset_counters  # noqa: E402
from optimum_neuron_chunked.config import NeuronConfig  # noqa: E402
from optimum_neuron_chunked.graph_runner import GraphRunner  # noqa: E402
from optimum_neuron_chunked.graphs import example_inputs, graph_module, graph_specs, tg_spec  # noqa: E402
from optimum_neuron_chunked.modeling import build_model  # noqa: E402
from optimum_neuron_chunked.modeling.sampler import sampling_params  # noqa: E402
from optimum_neuron_chunked.testing.checkpoints import FAMILIES  # noqa: E402

pytestmark = pytest.mark.xla

TOLERANCE = 1e-4  # fp32 logits and KV cache, XLA vs eager
NEW_TOKENS = 8
MAX_TOPK = 16  # well below the 512-token vocabulary, as 256 is below a real one: top-k is staged


def export_config(
    chunked: bool,
    dtype: str = "float32",
    prompt_logprobs: bool = False,
    prefill_widths: tuple[int, ...] = (),
    decode_widths: tuple[int, ...] = (),
    mixed_step: bool = False,
    kv_cache_blocks: int = 0,
    kv_block_size: int = 0,
    speculation_length: int = 0,
    **quantization,
) -> NeuronConfig:
    return NeuronConfig(
        **quantization,
        batch_size=2,
        sequence_length=SEQUENCE_LENGTH,
        prefill_chunk_size=CHUNK if chunked else 0,
        prefill_widths=prefill_widths,
        decode_widths=decode_widths,
        mixed_step=mixed_step,
        kv_cache_blocks=kv_cache_blocks,
        kv_block_size=kv_block_size,
        speculation_length=speculation_length,
        context_buckets=BUCKETS,
        dtype=dtype,
        max_topk=MAX_TOPK,
        prompt_logprobs=prompt_logprobs,
        backend="neuron",  # what neuronx-cc receives: the neuron backend's choices (attention kernel)
        instance_type="trn1",
    )


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(4, 380, (n,), generator=torch.Generator().manual_seed(seed))


class Pair:
    """The same weights twice: the xla backend's runtime (the neuron backend's bundle) and the
    eager backend's graphs (in-place cache) on CPU, each behind its own GraphRunner (the one
    padding rule)."""

    def __init__(self, family: str, config: NeuronConfig, weights: dict[str, torch.Tensor] | None = None):
        path = checkpoint_path(family)
        self.hf_config = AutoConfig.from_pretrained(path)
        self.eager_model = build_model(self.hf_config, config)
        if weights is None:
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            weights = self.eager_model.weights_from_hf(hf)
        self.eager_model.load_weights(weights)
        self.eager_model.eval()
        xla_model = build_model(self.hf_config, config, functional_cache=True)
        xla_model.load_weights(weights)
        self.xla = XlaRuntime(xla_model, config, graph_specs(config))
        eager_graphs = {s.name: graph_module(self.eager_model, s, config) for s in graph_specs(config)}
        self.eager = GraphRunner(config, eager_graphs)
        self.device = GraphRunner(config, self.xla.graphs())

    def prefill(self, ids: torch.Tensor, start: int, blocks: tuple[int, ...]) -> None:
        every = self.eager.config.prompt_logprobs
        with torch.no_grad():
            want = self.eager.prefill(ids, start, blocks, every_position=every)
        got = self.device.prefill(ids, start, blocks, every_position=every)
        torch.testing.assert_close(got, want, atol=TOLERANCE, rtol=0)

    def decode(self, ids, positions, blocks, params, rand) -> None:
        with torch.no_grad():
            want_tokens, want_logits = self.eager.decode(ids, positions, blocks, (params, rand))
        got_tokens, got_logits = self.device.decode(ids, positions, blocks, (params, rand))
        torch.testing.assert_close(got_logits, want_logits, atol=TOLERANCE, rtol=0)
        assert got_tokens.tolist() == want_tokens.tolist()

    def decode_with_chunk(self, ids, positions, blocks, params, rand, chunk, start, chunk_blocks) -> None:
        args = (ids, positions, blocks, (params, rand), chunk, start, chunk_blocks)
        with torch.no_grad():
            want_tokens, want_logits, want_chunk = self.eager.decode_with_chunk(*args)
        got_tokens, got_logits, got_chunk = self.device.decode_with_chunk(*args)
        torch.testing.assert_close(got_logits, want_logits, atol=TOLERANCE, rtol=0)
        torch.testing.assert_close(got_chunk, want_chunk, atol=TOLERANCE, rtol=0)
        assert got_tokens.tolist() == want_tokens.tolist()

    def verify(self, rows, positions, blocks) -> None:
        with torch.no_grad():
            want_argmax, want_logits = self.eager.verify(rows, positions, blocks)
        got_argmax, got_logits = self.device.verify(rows, positions, blocks)
        torch.testing.assert_close(got_logits, want_logits, atol=TOLERANCE, rtol=0)
        assert got_argmax.tolist() == want_argmax.tolist()

    def copy_prefix(self, source: int, target: int, length: int) -> None:
        with torch.no_grad():
            want = self.eager.copy_prefix(source, target, length)
        assert self.device.copy_prefix(source, target, length) == want

    def assert_caches_equal(self) -> None:
        got = self.xla.caches()
        for name, tensor in got.items():
            torch.testing.assert_close(tensor, getattr(self.eager_model, name), atol=TOLERANCE, rtol=0)


SAMPLING = torch.tensor(
    [sampling_params(temperature=0.0), sampling_params(top_k=5, top_p=0.9, temperature=0.8)]
)
RAND = torch.tensor([0.5, 0.3])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_chunked_graphs_on_xla_equal_eager(family):
    pair = Pair(family, export_config(chunked=True))
    reset_counters()
    a, b = tokens(3 * CHUNK - 10, seed=1), tokens(CHUNK - 12, seed=2)
    pair.prefill(a[:CHUNK], 0, (0,))  # a full chunk, bucket 64
    pair.prefill(a[CHUNK : 2 * CHUNK], CHUNK, (0,))  # the second chunk reads the first from the cache
    pair.prefill(a[2 * CHUNK :], 2 * CHUNK, (0,))  # a partial chunk crossing into bucket 128
    pair.copy_prefix(0, 1, 2 * CHUNK + 5)  # prefix caching: three calls, the last one padded
    pair.assert_caches_equal()
    pair.prefill(b, 0, (1,))  # another block, over part of the copied prefix
    # TG: a greedy row and a top-k/top-p/temperature row, sampled on device
    pair.decode(
        torch.tensor([7, 9]), torch.tensor([len(a), len(b)]), torch.tensor([[0], [1]]), SAMPLING, RAND
    )
    # TG with one real row, padded to the batch by repeating it
    pair.decode(torch.tensor([11]), torch.tensor([len(b) + 1]), torch.tensor([[1]]), SAMPLING[1:], RAND[1:])
    pair.assert_caches_equal()
    assert fallback_ops() == []
    check_hlo(pair, family, "chunked")


def test_narrow_prefill_graphs_on_xla_equal_eager():
    """--prefill-widths: chunks of every compiled width, in both buckets, then a decode over them."""
    pair = Pair("llama", export_config(chunked=True, prefill_widths=(8, CHUNK)))
    reset_counters()
    a = tokens(CHUNK + 5 + CHUNK + 3, seed=6)
    ends = (CHUNK, CHUNK + 5, 2 * CHUNK + 5, len(a))  # widths 32, 8 (bucket 64), 32, 8 (bucket 128)
    for start, end in zip((0, *ends[:-1]), ends, strict=True):
        pair.prefill(a[start:end], start, (1,))
    pair.copy_prefix(1, 0, CHUNK)
    pair.decode(torch.tensor([7, 9]), torch.tensor([CHUNK, len(a)]), torch.tensor([[0], [1]]), SAMPLING, RAND)
    pair.decode(torch.tensor([5]), torch.tensor([CHUNK + 1]), torch.tensor([[0]]), SAMPLING[:1], RAND[:1])
    pair.assert_caches_equal()
    assert fallback_ops() == []
    check_hlo(pair, "llama", "narrow-chunked")


def test_narrow_decode_graphs_on_xla_equal_eager():
    """--decode-widths: one-row steps in the one-row TG graph of each bucket, two-row steps in the
    batch's; the one-row graph still writes and reads the cache by block."""
    pair = Pair("llama", export_config(chunked=True, decode_widths=(1, 2)))
    reset_counters()
    a, b = tokens(2 * CHUNK - 2, seed=7), tokens(CHUNK - 2, seed=8)
    pair.prefill(a[:CHUNK], 0, (1,))
    pair.prefill(a[CHUNK:], CHUNK, (1,))
    pair.prefill(b, 0, (0,))
    # (blocks, positions): one row in bucket 64, two rows, one row, one row crossing into 128, two
    steps = (([1], [62]), ([0, 1], [30, 63]), ([0], [31]), ([1], [64]), ([0, 1], [32, 65]))
    for i, (blocks, positions) in enumerate(steps):
        n = len(blocks)
        ids = tokens(n, seed=20 + i)
        pair.decode(ids, torch.tensor(positions), torch.tensor(blocks)[:, None], SAMPLING[-n:], RAND[-n:])
    pair.assert_caches_equal()
    assert fallback_ops() == []
    ran = {"cp_w64", "tg_w64", "tg_w64_r1", "tg_w128", "tg_w128_r1"}
    assert ran <= set(pair.xla.hlo)
    for name in ran:
        report = pair.xla.hlo[name]
        assert report.forbidden == [] and report.dynamic_shapes == [], name
        HLO_CENSUS[f"llama narrow-decode {name}"] = report


@pytest.mark.parametrize("family", list(FAMILIES))
def test_mixed_graphs_on_xla_equal_eager(family):
    """--mixed-step: one decode row (padded to the batch) with a full chunk of the other block, in
    each bucket; the chunk then continues in CP and both rows decode through TG."""
    pair = Pair(family, export_config(chunked=True, mixed_step=True))
    reset_counters()
    a, b = tokens(CHUNK - 7, seed=9), tokens(3 * CHUNK, seed=10)
    pair.prefill(a, 0, (0,))
    for i, start in enumerate(range(0, 2 * CHUNK + 1, CHUNK)):  # buckets 64, 64, 128
        row = (torch.tensor([5 + i]), torch.tensor([len(a) + i]), torch.tensor([[0]]), SAMPLING[1:], RAND[1:])
        pair.decode_with_chunk(*row, b[start : start + CHUNK], start, (1,))
    pair.decode(
        torch.tensor([7, 9]), torch.tensor([len(a) + 3, len(b)]), torch.tensor([[0], [1]]), SAMPLING, RAND
    )
    pair.assert_caches_equal()
    assert fallback_ops() == []
    for name in ("mx_w64", "mx_w128"):
        report = pair.xla.hlo[name]
        assert report.forbidden == [] and report.dynamic_shapes == [], name
        HLO_CENSUS[f"{family} mixed {name}"] = report


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("paged", [False, True], ids=["whole", "paged"])
def test_verify_graphs_on_xla_equal_eager(family, paged):
    """--speculation-length: decode rows of the last token and 0 to K drafts, two rows in bucket
    64, one row (the narrow VF graph) whose drafts cross into bucket 128, then two rows in 128;
    rejected drafts' K/V is overwritten by the next call."""
    if paged and family != "llama":
        pytest.skip("the block layout's reads are family-independent: llama covers them")
    layout = dict(kv_cache_blocks=20, kv_block_size=16) if paged else {}
    pair = Pair(family, export_config(chunked=True, decode_widths=(1, 2), speculation_length=4, **layout))
    reset_counters()
    a, b = tokens(2 * CHUNK - 4, seed=14), tokens(CHUNK - 3, seed=15)
    kv = ([2, 6, 0, 11, 8, 4, 15, 1], [10, 3, 7, 5]) if paged else ([0], [1])
    pair.prefill(a[:CHUNK], 0, kv[0])
    pair.prefill(a[CHUNK:], CHUNK, kv[0])
    pair.prefill(b, 0, kv[1])

    def table(rows):
        return [kv[r] for r in rows]

    rows = [torch.tensor([5, 6, 7]), torch.tensor([9, 10, 11, 12, 13])]  # 2 and 4 drafts
    pair.verify(rows, torch.tensor([len(a), len(b)]), table([0, 1]))
    pair.verify([torch.tensor([8, 21, 22, 23, 24])], torch.tensor([len(a) + 1]), table([0]))  # 61..65
    pair.verify(
        [torch.tensor([30, 33, 34]), torch.tensor([31])],
        torch.tensor([len(a) + 2, len(b) + 1]),
        table([0, 1]),
    )
    pair.assert_caches_equal()
    assert fallback_ops() == []
    for name in ("vf_w64", "vf_w128_r1", "vf_w128"):
        report = pair.xla.hlo[name]
        assert report.forbidden == [] and report.dynamic_shapes == [], name
        assert report.widest_sort < pair.hf_config.vocab_size // 2, f"{name}: sort of {report.widest_sort}"
        HLO_CENSUS[f"{family} {'paged ' if paged else ''}verify {name}"] = report


def test_paged_graphs_on_xla_equal_eager():
    """--kv-cache-blocks: three requests in shuffled blocks of 16 through CP, TG (a padded row)
    and MX in both buckets; the pools stay equal and every graph lowers to static HLO."""
    pair = Pair("llama", export_config(chunked=True, mixed_step=True, kv_cache_blocks=20, kv_block_size=16))
    reset_counters()
    blocks = ([8, 2, 13, 0, 11, 5, 16, 19], [4, 10, 1], [3, 12, 7, 9, 18])
    a, b, c = tokens(3 * CHUNK - 10, seed=11), tokens(CHUNK - 12, seed=12), tokens(2 * CHUNK, seed=13)
    pair.prefill(a[:CHUNK], 0, blocks[0])  # bucket 64
    pair.prefill(b, 0, blocks[1])
    pair.prefill(a[CHUNK : 2 * CHUNK], CHUNK, blocks[0])
    pair.prefill(a[2 * CHUNK :], 2 * CHUNK, blocks[0])  # crosses into bucket 128
    tables = blocks[:2]
    pair.decode(torch.tensor([7, 9]), torch.tensor([len(a), len(b)]), tables, SAMPLING, RAND)
    pair.decode(torch.tensor([11]), torch.tensor([len(b) + 1]), blocks[1:2], SAMPLING[1:], RAND[1:])
    row = (torch.tensor([5]), torch.tensor([len(b) + 2]), blocks[1:2], SAMPLING[1:], RAND[1:])
    pair.decode_with_chunk(*row, c[:CHUNK], 0, blocks[2])  # mx_w64
    row = (torch.tensor([6]), torch.tensor([len(a) + 1]), blocks[:1], SAMPLING[:1], RAND[:1])
    pair.decode_with_chunk(*row, c[CHUNK:], CHUNK, blocks[2])  # mx_w128: a's row is past 64
    pair.assert_caches_equal()
    assert fallback_ops() == []
    check_hlo(pair, "llama", "paged")


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "standard"])
def test_prompt_logits_graphs_on_xla_equal_eager(chunked):
    """Exports with --prompt-logprobs: prefill graphs return every position's logits."""
    pair = Pair("llama", export_config(chunked=chunked, prompt_logprobs=True))
    reset_counters()
    a = tokens(CHUNK + 20, seed=5)
    if chunked:
        pair.prefill(a[:CHUNK], 0, (0,))
        pair.prefill(a[CHUNK:], CHUNK, (0,))
    else:
        pair.prefill(a, 0, (0,))
    pair.decode(torch.tensor([7]), torch.tensor([len(a)]), torch.tensor([[0]]), SAMPLING[:1], RAND[:1])
    pair.assert_caches_equal()
    assert fallback_ops() == []
    ran = {f"{'cp' if chunked else 'ce'}_w64", "tg_w64"}
    for name in ran:
        report = pair.xla.hlo[name]
        assert report.forbidden == [] and report.dynamic_shapes == [], name
        HLO_CENSUS[f"llama {'chunked' if chunked else 'standard'} prompt-logits {name}"] = report


@pytest.mark.parametrize("family", list(FAMILIES))
def test_standard_graphs_on_xla_equal_eager(family):
    pair = Pair(family, export_config(chunked=False))
    reset_counters()
    a, b = tokens(40, seed=3), tokens(100, seed=4)
    pair.prefill(a, 0, (1,))  # CE over bucket 64
    pair.prefill(b, 0, (0,))  # CE over bucket 128
    pair.decode(
        torch.tensor([5, 6]), torch.tensor([len(b), len(a)]), torch.tensor([[0], [1]]), SAMPLING, RAND
    )
    # TG over bucket 64: one real row (block 1) padded to the batch
    pair.decode(torch.tensor([8]), torch.tensor([len(a) + 1]), torch.tensor([[1]]), SAMPLING[:1], RAND[:1])
    pair.assert_caches_equal()
    assert fallback_ops() == []
    check_hlo(pair, family, "standard")


def fp8_checkpoint_weights(tmp_path, family: str) -> tuple[dict[str, torch.Tensor], NeuronConfig]:
    """The exported weights and config of a block-wise FP8 checkpoint of `family` (16x16 blocks)."""
    from fixtures.export_models import fp8_checkpoint_path
    from safetensors.torch import load_file

    from optimum_neuron_chunked.export.pipeline import export

    source = fp8_checkpoint_path(family, "block", (16, 16))
    out = export(str(source), tmp_path / "out", backend="xla", batch_size=2, sequence_length=SEQUENCE_LENGTH,
                 prefill_chunk_size=CHUNK, context_buckets=BUCKETS)  # fmt: skip
    return load_file(out / "model.safetensors"), NeuronConfig.load(out)


@pytest.mark.parametrize(
    "family,quantization",
    [
        ("llama", "int8"),
        ("qwen3_moe", "int8"),
        ("mixtral", "fp8"),
        ("llama", "fp8 blocks"),
        ("qwen3_moe", "fp8 blocks"),
    ],
)
def test_quantized_graphs_on_xla_equal_eager(family, quantization, tmp_path):
    """int8 / fp8 weights with per-channel scales (experts too), and FP8 checkpoints' block-wise
    scales (a dense family, per-expert ones stacked): every graph of a chunked export with mixed steps on XLA equals eager,
    its quantized weights parameters of 8 bits."""
    if quantization == "fp8 blocks":
        weights, exported = fp8_checkpoint_weights(tmp_path, family)
        fields = {
            f: getattr(exported, f) for f in ("quantization", "quantization_block", "quantization_skip")
        }
    else:
        weights, fields = None, {"quantization": quantization}
    pair = Pair(family, export_config(chunked=True, mixed_step=True, **fields), weights)
    reset_counters()
    a, b = tokens(3 * CHUNK + 7, seed=3), tokens(CHUNK - 5, seed=4)
    pair.prefill(b, 0, (1,))
    for i, start in enumerate(range(0, 3 * CHUNK, CHUNK)):  # mixed steps in buckets 64, 64, 128
        row = (torch.tensor([5 + i]), torch.tensor([len(b) + i]), torch.tensor([[1]]), SAMPLING[1:], RAND[1:])
        pair.decode_with_chunk(*row, a[start : start + CHUNK], start, (0,))
    pair.prefill(a[3 * CHUNK :], 3 * CHUNK, (0,))
    pair.decode(
        torch.tensor([7, 9]), torch.tensor([len(a), len(b) + 3]), torch.tensor([[0], [1]]), SAMPLING, RAND
    )
    pair.decode(torch.tensor([4]), torch.tensor([len(b) + 4]), torch.tensor([[1]]), SAMPLING[1:], RAND[1:])
    pair.copy_prefix(0, 1, CHUNK)
    pair.assert_caches_equal()
    assert fallback_ops() == []
    check_hlo(pair, family, quantization.replace(" ", "-"))
    assert all(report.census["8-bit params"] > 0 for report in pair.xla.hlo.values() if report.census["dot"])


def check_hlo(pair: Pair, family: str, kind: str) -> None:
    assert set(pair.xla.hlo) == {s.name for s in graph_specs(pair.device.config)}, "every graph ran"
    for name, report in pair.xla.hlo.items():
        assert report.forbidden == [], f"{name}: {report.forbidden}"
        assert report.dynamic_shapes == [], f"{name}: {report.dynamic_shapes[:5]}"
        assert report.census["instructions"] > 0
        # on-device top-k never sorts the whole vocabulary (sampler.staged_topk)
        assert report.widest_sort < pair.hf_config.vocab_size // 2, f"{name}: sort of {report.widest_sort}"
        HLO_CENSUS[f"{family} {kind} {name}"] = report


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_bf16_graphs_on_xla_sample_the_eager_tokens(family):
    """bf16 rounds differently on XLA and eager: tokens must agree where eager's top-2 margin
    is wider than bf16's resolution at that magnitude."""
    config = export_config(chunked=True, dtype="bfloat16")
    pair = Pair(family, config)
    ids = tokens(2 * CHUNK + 3, seed=5)
    checked = 0
    for start in range(0, len(ids), CHUNK):
        chunk = ids[start : start + CHUNK]
        with torch.no_grad():
            want = pair.eager.prefill(chunk, start, (0,))
        got = pair.device.prefill(chunk, start, (0,))
        top2 = want.topk(2).values
        if top2[0] - top2[1] > 2 * 2**-7 * top2[0].abs():
            assert got.argmax() == want.argmax()
            checked += 1
    assert checked, "no chunk had a margin wide enough to compare"
    assert fallback_ops() == []


@pytest.mark.parametrize(
    "export_dir", export_params([i for i, spec in EXPORTS.items() if spec.backend == "xla"]), indirect=True
)
def test_generate_on_xla_equals_transformers(export_dir, neuron_model, hf_reference):
    """The loader's generate() on an xla export: every graph executing on the XLA device."""
    assert neuron_model.neuron_config.backend == "xla"
    hf = hf_reference(neuron_model.config.model_type)
    reset_counters()
    for length in (CHUNK + 5, 2):
        ids = tokens(length, seed=length)[None]
        with torch.no_grad():
            expected = hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert (
            neuron_model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False).tolist()
            == expected.tolist()
        )
    assert fallback_ops() == []


def test_cli_xla_export_generates_like_transformers(tmp_path):
    """`optimum-cli export neuron --backend xla`: the weights alone (recorded and checked as the
    eager backend's), loaded by the loader onto the XLA device; greedy tokens equal
    transformers', no aten op falls back to the host and every graph that ran lowered to static
    HLO."""
    from optimum_neuron_chunked import NeuronModelForCausalLM
    from optimum_neuron_chunked.export.cli import main
    from optimum_neuron_chunked.integrity import recorded_files

    path, out = checkpoint_path("llama"), tmp_path / "export"
    argv = ["--model", str(path), "--batch_size", "2", "--sequence_length", str(SEQUENCE_LENGTH),
            "--prefill-chunk-size", str(CHUNK), "--context-buckets", ",".join(map(str, BUCKETS)),
            "--backend", "xla", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert sorted(recorded_files(out)) == ["model.safetensors"]
    assert not (out / "graphs").exists()
    model = NeuronModelForCausalLM.from_pretrained(out, backend="xla", verify_weights=True)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    reset_counters()
    ids = tokens(2 * CHUNK + 3, seed=11)[None]  # chunks in buckets 64, 64, 128; decodes in 128
    with torch.no_grad():
        expected = hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False).tolist() == expected.tolist()
    assert fallback_ops() == []
    runtime = model.runner.graphs["tg_w128"].runtime
    assert set(runtime.hlo) == {"cp_w64", "cp_w128", "tg_w128"}
    for name, report in runtime.hlo.items():
        assert report.forbidden == [] and report.dynamic_shapes == [], name
    # inputs typed otherwise than traced (int64 indices) would be another graph: refused
    inputs = example_inputs(tg_spec(model.neuron_config, 2, 128), model.neuron_config)
    with pytest.raises(TypeError, match="tg_w128 was traced with inputs"):
        model.runner.graphs["tg_w128"](*(x if x.is_floating_point() else x.long() for x in inputs))
