"""kernels.decode_attention_op: the C++ op a cpu decode graph attends with, against the masked
softmax written out, inside the model against the path it replaces, and as AOTInductor calls it."""

from __future__ import annotations

import pytest
import torch
from fixtures.export_models import checkpoint_path
from transformers import AutoConfig

from optimum_neuron_chunked.backends.cpu import attention
from optimum_neuron_chunked.backends.cpu.decode_attention import decode_attention
from optimum_neuron_chunked.backends.cpu.kernels import CpuKernels, KernelChoices, kernel_choices
from optimum_neuron_chunked.config import NeuronConfig
from optimum_neuron_chunked.modeling import build_model, model_from_spec
from optimum_neuron_chunked.modeling.kv_layout import KVPool


@pytest.fixture(autouse=True)
def two_threads():
    """The op hands its (row, KV head) tasks to the intra-op threads: two of them take tasks here,
    whatever OMP_NUM_THREADS the run has (make test runs one a process)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def reference(query, k_cache, v_cache, blocks, lengths, scale):
    """Each row over its whole-sequence block's first `length` positions, heads grouped
    as transformers' repeat_kv."""
    groups = query.shape[1] // k_cache.shape[1]
    outs = []
    for q, block, length in zip(query, blocks.tolist(), lengths.tolist(), strict=True):
        keys = k_cache[block, :, :length].repeat_interleave(groups, 0)
        values = v_cache[block, :, :length].repeat_interleave(groups, 0)
        outs.append((torch.softmax(q[:, None] @ keys.transpose(1, 2) * scale, -1) @ values)[:, 0])
    return torch.stack(outs)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2), (8, 4), (4, 1)])
@pytest.mark.parametrize("head_dim", [64, 32, 12])  # 12: a tail after the vector lanes
def test_decode_attention_equals_the_masked_softmax(heads, kv_heads, head_dim):
    """Rows of different lengths (1, not a multiple of the key block, the whole cache) in any
    block order, a padded row repeating a real one; positions past a row's length (stale
    entries) are never read. 150 positions: more than one block of value rows (64)."""
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(3, kv_heads, 150, head_dim), torch.randn(3, kv_heads, 150, head_dim)
    blocks, lengths = torch.tensor([2, 0, 1, 0]), torch.tensor([1, 71, 150, 71])
    query = torch.randn(4, heads, head_dim)
    query[3] = query[1]  # a padded row repeats the real row 1
    tables = blocks[:, None]  # one whole-sequence block a row
    got = decode_attention(query, k_cache, v_cache, tables, lengths, 0.3)
    torch.testing.assert_close(got, reference(query, k_cache, v_cache, blocks, lengths, 0.3))
    k_cache[:, :, 71:] = v_cache[:, :, 71:] = float("nan")
    stale = decode_attention(query[1:2], k_cache, v_cache, tables[1:2], lengths[1:2], 0.3)
    torch.testing.assert_close(stale, got[1:2])


def test_decode_attention_with_weights_below_the_normal_range():
    """Peaked scores (a spread of hundreds): weights under exp(-69) become 0, as they round in
    the reference's sum."""
    torch.manual_seed(1)
    k_cache, v_cache = torch.randn(2, 2, 300, 64), torch.randn(2, 2, 300, 64)
    query, blocks, lengths = torch.randn(2, 4, 64) * 40, torch.tensor([1, 0]), torch.tensor([300, 257])
    got = decode_attention(query, k_cache, v_cache, blocks[:, None], lengths, 0.3)
    torch.testing.assert_close(got, reference(query, k_cache, v_cache, blocks, lengths, 0.3))


def test_decode_attention_reads_block_tables_in_place():
    """Pools of smaller blocks: each row reads its blocks in table order, up to its length (a
    partial last block; the table's columns past it, padded by repeating the row's last block,
    never read), shared blocks and a padded row repeating a real one: equal to the same rows
    laid out as whole-sequence blocks."""
    torch.manual_seed(0)
    block, kv_heads, heads, head_dim = 16, 2, 4, 32
    pool_k, pool_v = torch.randn(9, kv_heads, block, head_dim), torch.randn(9, kv_heads, block, head_dim)
    tables = torch.tensor([[3, 1, 7, 7], [5, 5, 5, 5], [3, 1, 2, 8], [5, 5, 5, 5]])
    lengths = torch.tensor([40, 16, 64, 16])
    query = torch.randn(4, heads, head_dim)
    query[3] = query[1]

    def as_whole_sequence_blocks(pool):
        return pool[tables].transpose(1, 2).reshape(4, kv_heads, 4 * block, head_dim)

    got = decode_attention(query, pool_k, pool_v, tables, lengths, 0.3)
    want = reference(
        query,
        as_whole_sequence_blocks(pool_k),
        as_whole_sequence_blocks(pool_v),
        torch.arange(4),
        lengths,
        0.3,
    )
    torch.testing.assert_close(got, want)
    # what no row reads: blocks in no table, and block 7 past row 0's 40 positions (8 of 16)
    for unread in ((0,), (4,), (6,), (7, slice(None), slice(8, None))):
        pool_k[unread] = pool_v[unread] = float("nan")
    torch.testing.assert_close(decode_attention(query, pool_k, pool_v, tables, lengths, 0.3), got)


@pytest.mark.parametrize("block, length", [(3, 5), (-1, 5), (0, 0), (0, 41)])
def test_decode_attention_refuses_a_row_outside_the_cache(block, length):
    caches = torch.zeros(3, 2, 40, 8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        decode_attention(
            torch.zeros(1, 2, 8), caches, caches, torch.tensor([[block]]), torch.tensor([length]), 1.0
        )


def test_the_op_replaces_the_decode_attention_of_plain_layers_only(monkeypatch):
    """Every layer of a decode step calls the op, once for all rows, and gives the hidden states
    of the per-row path it replaces; a prefill chunk never calls it."""
    config = NeuronConfig(batch_size=3, sequence_length=128, prefill_chunk_size=16, backend="eager")
    spec = build_model(AutoConfig.from_pretrained(checkpoint_path("llama")), config).spec
    torch.manual_seed(0)
    models = {
        op: model_from_spec(spec, config, kernels=CpuKernels(KernelChoices(live_window=True, per_row_live=True,
                                                                           decode_attention_op=op),
                                                               KVPool.of(config))).eval()
        for op in (False, True)
    }  # fmt: skip
    models[True].load_state_dict(models[False].state_dict())
    for name, cache in models[False].named_buffers():
        if "cache" in name:  # a context already written, the same in both
            cache.copy_(torch.randn_like(cache))
            models[True].get_buffer(name).copy_(cache)
    calls = []
    monkeypatch.setattr(attention, "decode_attention", lambda *a: calls.append(1) or decode_attention(*a))
    ids, positions, tables = (
        torch.tensor([[3], [4], [4]]),
        torch.tensor([[70], [5], [5]]),
        torch.tensor([[2], [0], [0]]),
    )
    with torch.no_grad():
        got, want = (
            models[op].hidden_states(ids, positions, tables, 128, decode_rows=True) for op in (True, False)
        )
        assert len(calls) == spec.num_layers
        models[True].hidden_states(torch.arange(5, 21)[None], torch.arange(16)[None], torch.tensor([[1]]), 128,
                                   decode_rows=False)  # fmt: skip
    assert len(calls) == spec.num_layers
    torch.testing.assert_close(got, want)


@pytest.mark.slow
def test_decode_attention_compiled_by_aotinductor(tmp_path):
    """The op as a cpu decode graph calls it: block tables and lengths are graph inputs, the
    caches the graph's buffers."""

    class DecodeAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("k", torch.randn(3, 2, 64, 8))
            self.register_buffer("v", torch.randn(3, 2, 64, 8))

        def forward(self, query, positions, tables):
            return decode_attention(query, self.k, self.v, tables, positions[:, 0] + 1, 0.3)

    module = DecodeAttention()
    query = torch.randn(2, 4, 8)
    program = torch.export.export(module, (query, torch.tensor([[5], [9]]), torch.tensor([[0], [2]])))
    compiled = torch._inductor.aoti_load_package(
        torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "a.pt2"))
    )
    for positions, tables in [([[5], [9]], [[0], [2]]), ([[63], [0]], [[1], [1]])]:
        positions, tables = torch.tensor(positions), torch.tensor(tables)
        want = reference(query, module.k, module.v, tables[:, 0], positions[:, 0] + 1, 0.3)
        torch.testing.assert_close(compiled(query, positions, tables), want)


def test_the_cpu_backend_chooses_the_decode_op_on_the_hosts_it_was_measured_on():
    assert kernel_choices("AVX2").decode_attention_op and kernel_choices("AVX512").decode_attention_op
    assert not kernel_choices("DEFAULT").decode_attention_op
