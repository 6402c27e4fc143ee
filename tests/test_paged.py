"""Paged exports (--kv-cache-blocks, --kv-block-size): one pool of KV blocks shared by every
request, each graph reading a row's blocks through its block table. Requests in shuffled,
non-contiguous blocks, their chunks and decodes interleaved, equal HF transformers through the
loader (eager; one cpu export proves AOTInductor compiles the gather and the scatter)."""

from __future__ import annotations

import pytest
import torch
from fixtures.export_models import checkpoint_path, export_with
from helpers import greedy_rows, prompt
from transformers import AutoConfig

from optimum_neuron_chunked import NeuronModelForCausalLM
from optimum_neuron_chunked.backends.cpu.kernels import CpuKernels, KernelChoices
from optimum_neuron_chunked.config import NeuronConfig
from optimum_neuron_chunked.generation import prefill_prompt
from optimum_neuron_chunked.modeling import build_model, model_from_spec
from optimum_neuron_chunked.modeling.decoder import PartInputs
from optimum_neuron_chunked.modeling.kernels import Kernels
from optimum_neuron_chunked.modeling.kv_layout import KVPool

P, C, S, BUCKETS = 8, 16, 64, (32, 64)  # blocks of 8, chunks of 16: every chunk spans two blocks
POOL = 4 * (S // P)  # four whole sequences
LOGITS_TOLERANCE = 1e-4
# a permutation of the pool (ids 0..POOL - 1): requests hold non-contiguous blocks in no order,
# so a wrong gather shows
SHUFFLED = torch.randperm(POOL, generator=torch.Generator().manual_seed(0)).tolist()


def paged_options(**extra) -> dict:
    shapes = dict(batch_size=3, sequence_length=S, prefill_chunk_size=C, context_buckets=BUCKETS)
    return shapes | dict(kv_cache_blocks=POOL, kv_block_size=P) | extra


def request_blocks(i: int) -> list[int]:
    """The i-th request's blocks: a whole sequence's worth, out of the shuffled pool."""
    return SHUFFLED[i * (S // P) : (i + 1) * (S // P)]


def check(hf, logits: torch.Tensor, seq: torch.Tensor) -> int:
    """logits [V] after `seq` equal HF's -> HF's greedy token."""
    with torch.no_grad():
        want = hf(seq[None]).logits[0, -1]
    torch.testing.assert_close(logits, want, atol=LOGITS_TOLERANCE, rtol=0)
    return int(want.argmax())


@pytest.fixture(scope="module")
def llama_paged():
    return NeuronModelForCausalLM.from_pretrained(
        export_with("llama", "eager", **paged_options(mixed_step=True))
    )


def test_interleaved_requests_in_shuffled_blocks_match_transformers(llama_paged, hf_reference):
    model, hf = llama_paged, hf_reference("llama")
    decoder = model.runner.graphs["cp_w32"].__wrapped__.model
    for name in decoder.cache_names():
        getattr(decoder, name).zero_()
    prompts = {"a": prompt(39), "b": prompt(21, seed=1), "c": prompt(9, seed=2), "d": prompt(C, seed=3)}
    blocks = {name: request_blocks(i) for i, name in enumerate(prompts)}
    seqs, written = {}, {}  # written: positions of each request's K/V in the pool
    # a's third chunk crosses into bucket 64; each request's chunks are interleaved with others'
    for name, start in (("a", 0), ("b", 0), ("a", C), ("c", 0), ("b", C), ("a", 2 * C)):
        ids = prompts[name][start : start + C]
        token = check(hf, model.runner.prefill(ids, start, blocks[name]), prompts[name][: start + len(ids)])
        seqs[name] = torch.cat([prompts[name][: start + len(ids)], torch.tensor([token])])
        written[name] = start + len(ids)
    # three rows in bucket 64 with whole tables, then two (padded to three) in bucket 32 with
    # tables of the blocks in use only; a crosses into a new block at 40, b at 24
    for step in range(4):
        names = ["a", "b", "c"] if step % 2 == 0 else ["c", "b"]
        positions = torch.tensor([len(seqs[n]) - 1 for n in names])
        used = [blocks[n][: int(p) // P + 1] for n, p in zip(names, positions, strict=True)]
        rows = [blocks[n] for n in names] if step % 2 == 0 else used
        last = torch.stack([seqs[n][-1] for n in names])
        tokens, logits = model.runner.decode(last, positions, rows, greedy_rows(len(names)))
        for i, name in enumerate(names):
            assert int(tokens[i]) == check(hf, logits[i], seqs[name])
            seqs[name] = torch.cat([seqs[name], tokens[i : i + 1]])
            written[name] = int(positions[i]) + 1
    # a mixed step: a and b decode while d's first chunk fills two blocks of its own
    names = ["a", "b"]
    positions = torch.tensor([len(seqs[n]) - 1 for n in names])
    params, rand = torch.zeros(2, 3), torch.zeros(2)
    tokens, logits, chunk_logits = model.runner.decode_with_chunk(
        torch.stack([seqs[n][-1] for n in names]), positions, [blocks[n] for n in names],
        (params, rand), prompts["d"], 0, blocks["d"],
    )  # fmt: skip
    for i, name in enumerate(names):
        assert int(tokens[i]) == check(hf, logits[i], seqs[name])
        written[name] = int(positions[i]) + 1
    check(hf, chunk_logits, prompts["d"])
    written["d"] = C
    # the pool is the export's POOL blocks; padding repeats real tokens, rows and (in block
    # tables) each row's last block, so only the blocks holding written positions are written:
    # d's and c's later blocks, in their tables, still hold zeros
    held = {b for name, n in written.items() for b in blocks[name][: -(-n // P)]}
    unwritten = [b for b in range(POOL) if b not in held]
    assert len(unwritten) >= 2 * (S // P - 2)
    for name in decoder.cache_names():
        assert getattr(decoder, name).shape[0] == POOL
        assert not getattr(decoder, name)[unwritten].any(), name


def test_generate_on_a_paged_export_matches_transformers(llama_paged, hf_reference):
    """A left-padded batch: generate() takes blocks from its host-side pool and gives them back."""
    model, hf = llama_paged, hf_reference("llama")
    lengths, width = (2 * C + 5, P - 1), 2 * C + 5
    input_ids = torch.full((len(lengths), width), hf.generation_config.pad_token_id)
    attention_mask = torch.zeros_like(input_ids)
    for row, n in enumerate(lengths):
        input_ids[row, width - n :], attention_mask[row, width - n :] = prompt(n, seed=row), 1
    output = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=12)
    expected = hf.generate(input_ids, attention_mask=attention_mask, max_new_tokens=12, do_sample=False)
    assert output.tolist() == expected.tolist()
    assert model.kv_pool.num_free == POOL


def test_the_runner_refuses_what_a_paged_export_cannot_run(llama_paged):
    model, ids = llama_paged, prompt(C)
    with pytest.raises(ValueError, match="positions up to"):  # 16 positions need two blocks
        model.runner.prefill(ids, 0, [5])
    with pytest.raises(ValueError, match="positions up to"):  # position 9 needs a second column
        model.runner.decode(ids[:1], torch.tensor([9]), torch.tensor([[5]]))
    for outside in (POOL, -1):  # the pool's blocks are 0..POOL - 1
        with pytest.raises(ValueError, match=f"pool blocks 0..{POOL - 1}"):
            model.runner.decode(ids[:1], torch.tensor([9]), torch.tensor([[5, outside]]))
    with pytest.raises(ValueError, match="distinct"):  # two rows writing one block
        model.runner.decode(ids[:2], torch.tensor([3, 4]), torch.tensor([[5], [5]]))
    with pytest.raises(ValueError, match="copy graph"):
        model.runner.copy_prefix(0, 1, C)


def test_sliding_window_layers_keep_every_position_in_blocks(hf_reference):
    """gemma3's sliding layers (window 36) keep no rings in a paged export; the mask slides."""
    model = NeuronModelForCausalLM.from_pretrained(export_with("gemma3_text", "eager", **paged_options()))
    caps, hf = model.runner.capabilities, hf_reference("gemma3_text")
    assert (caps.kv.whole_sequence_blocks, caps.kv.ring_layers, caps.kv.num_blocks, caps.kv.block_size) == (
        False,
        (),
        POOL,
        P,
    )
    decoder = build_model(model.config, model.neuron_config)
    caches = [getattr(decoder, name) for name in decoder.cache_names()]
    assert caps.kv.bytes_per_block * caps.kv.num_blocks == sum(c.nbytes for c in caches)
    ids = prompt(50, seed=4)
    check(hf, prefill_prompt(model.runner, ids, request_blocks(2)), ids)
    expected = hf.generate(ids[None], max_new_tokens=10, do_sample=False)
    assert model.generate(ids[None], max_new_tokens=10).tolist() == expected.tolist()


def test_prompt_logprobs_of_a_paged_export_match_transformers(hf_reference):
    """Every position's logits (--prompt-logprobs) through chunks over shuffled blocks."""
    options = paged_options(prompt_logprobs=True)
    model = NeuronModelForCausalLM.from_pretrained(export_with("llama", "eager", **options))
    ids, blocks = prompt(37, seed=5), request_blocks(1)
    got = torch.cat(
        [model.runner.prefill(ids[s : s + C], s, blocks, every_position=True) for s in range(0, len(ids), C)]
    )
    with torch.no_grad():
        want = hf_reference("llama")(ids[None]).logits[0]
    torch.testing.assert_close(got, want, atol=LOGITS_TOLERANCE, rtol=0)


@pytest.mark.slow
def test_a_cpu_paged_export_compiles_and_matches_transformers(hf_reference):
    """AOTInductor: the block gather and scatter in the cpu backend's graphs (one bucket)."""
    path = export_with("llama", "cpu", batch_size=2, sequence_length=32, prefill_chunk_size=C,
                       context_buckets=(32,), kv_cache_blocks=8, kv_block_size=P)  # fmt: skip
    model, hf = NeuronModelForCausalLM.from_pretrained(path), hf_reference("llama")
    prompts, blocks = {"a": prompt(20, seed=5), "b": prompt(9, seed=6)}, {"a": [5, 1, 7], "b": [4, 0]}
    seqs = {}
    for name, start in (("a", 0), ("b", 0), ("a", C)):
        end = min(start + C, len(prompts[name]))
        token = check(
            hf, model.runner.prefill(prompts[name][start:end], start, blocks[name]), prompts[name][:end]
        )
        seqs[name] = torch.cat([prompts[name][:end], torch.tensor([token])])
    for names in (["a", "b"], ["b"], ["a", "b"]):  # ["b"]: padded to two rows
        positions = torch.tensor([len(seqs[n]) - 1 for n in names])
        tokens, logits = model.runner.decode(
            torch.stack([seqs[n][-1] for n in names]),
            positions,
            [blocks[n] for n in names],
            greedy_rows(len(names)),
        )
        for i, name in enumerate(names):
            assert int(tokens[i]) == check(hf, logits[i], seqs[name])
            seqs[name] = torch.cat([seqs[name], tokens[i : i + 1]])


@pytest.mark.parametrize(
    "choices",
    [
        KernelChoices(live_window=True, paged_decode_op=True),  # the decode op, masked-softmax chunks
        KernelChoices(live_window=True, sdpa_prefill_from_window=1, onednn_chunk_attention_from_window=32),
    ],
    ids=["decode-op", "sdpa-onednn"],
)
def test_cpu_paged_reads_equal_the_reference(choices):
    """The cpu backend's paged reads - decode rows reading their blocks in place (the C++ op),
    chunks gathering only their live blocks, alone or in one mixed step - give the reference's
    hidden states. Exact reads (the op's rows, a chunk's one row) read nothing past their row's
    context: the blocks and positions past it may then hold NaN (reads up to the longest row
    need them finite, as the reference's whole-bucket reads do)."""
    config = NeuronConfig(backend="eager", **paged_options())
    spec = build_model(AutoConfig.from_pretrained(checkpoint_path("llama")), config).spec
    torch.manual_seed(0)
    models = [
        model_from_spec(spec, config, kernels=k).eval()
        for k in (Kernels(), CpuKernels(choices, KVPool.of(config)))
    ]
    models[1].load_state_dict(models[0].state_dict())
    caches = [
        (cache, models[1].get_buffer(name)) for name, cache in models[0].named_buffers() if "cache" in name
    ]
    short = request_blocks(1)[:3]  # row 1: 24 positions in 3 blocks, padded by the one rule
    short += short[-1:] * (S // P - len(short))
    tables = torch.tensor([request_blocks(0), short, request_blocks(0)])
    decode = PartInputs(torch.tensor([[3], [4], [3]]), torch.tensor([[50], [20], [50]]), tables, True)
    chunk = PartInputs(torch.arange(5, 5 + C)[None], torch.arange(8, 8 + C)[None], tables[1:2], False)
    op_rows = choices.paged_decode_op
    with torch.no_grad():  # TG, CP, and both parts in one call (MX)
        for parts, exact in (((decode,), op_rows), ((chunk,), True), ((decode, chunk), op_rows)):
            for cache, twin in caches:  # written contexts
                twin.copy_(cache.copy_(torch.randn_like(cache)))
            want, got = (
                torch.cat([h.flatten(0, 1) for h in m.parts_hidden_states(parts, S)]) for m in models
            )
            torch.testing.assert_close(got, want)
            if exact:
                for _, twin in caches:  # past row 1's 24 positions, and past row 0's position 50
                    twin[request_blocks(1)[3:]] = float("nan")
                    twin[request_blocks(0)[7]], twin[request_blocks(0)[6], :, 3:] = float("nan"), float("nan")
                again = torch.cat([h.flatten(0, 1) for h in models[1].parts_hidden_states(parts, S)])
                torch.testing.assert_close(again, got)
