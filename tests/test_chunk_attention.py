"""kernels.onednn_chunk_attention_from_window: the custom op a cpu chunk graph attends with, against the
masked softmax written out, and as AOTInductor calls it with the live width unbacked."""

from __future__ import annotations

import platform

import pytest
import torch
from fixtures.export_models import checkpoint_path
from transformers import AutoConfig

from optimum_neuron_chunked.backends.cpu import attention
from optimum_neuron_chunked.backends.cpu import chunk_attention as chunk_attention_module
from optimum_neuron_chunked.backends.cpu.chunk_attention import chunk_attention
from optimum_neuron_chunked.backends.cpu.kernels import CpuKernels, KernelChoices
from optimum_neuron_chunked.config import NeuronConfig
from optimum_neuron_chunked.graph_runner import pad_repeat_last
from optimum_neuron_chunked.graphs import PrefillGraph
from optimum_neuron_chunked.modeling import build_model, model_from_spec
from optimum_neuron_chunked.modeling.kv_layout import KVPool


def masked_softmax_attention(query, keys, values, positions, scale):
    groups = query.shape[0] // keys.shape[0]
    keys, values = keys.repeat_interleave(groups, 0), values.repeat_interleave(groups, 0)
    visible = torch.arange(keys.shape[1])[None] <= positions[:, None]
    scores = torch.where(visible, query @ keys.transpose(1, 2) * scale, float("-inf"))
    return torch.softmax(scores, -1) @ values


def chunk(start: int, real: int, width: int) -> torch.Tensor:
    """A chunk's positions: `real` tokens from `start`, padded to `width` by repeating the last."""
    return pad_repeat_last(torch.arange(start, start + real), width, dim=0)


@pytest.mark.parametrize("row_block", [256, 4, 5])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2), (4, 1)])
@pytest.mark.parametrize("start, real", [(0, 16), (0, 5), (40, 16), (37, 9)])
def test_chunk_attention_equals_the_masked_softmax(monkeypatch, row_block, heads, kv_heads, start, real):
    """Prefix keys all visible, the chunk's own causal, padded rows as the last real row; a
    stale cache entry after the last position is never read (the window ends there). Row
    blocks smaller than the chunk (a CE graph's many) give the same result."""
    monkeypatch.setattr(chunk_attention_module, "ROW_BLOCK", row_block)
    torch.manual_seed(0)
    positions = chunk(start, real, 16)
    width = int(positions.max()) + 1
    cache_k, cache_v = torch.randn(2, kv_heads, 64, 8), torch.randn(2, kv_heads, 64, 8)
    query = pad_repeat_last(torch.randn(heads, real, 8), 16, dim=1)  # a padded token repeats the last
    keys, values = cache_k[1, :, :width], cache_v[1, :, :width]  # a view of block 1, as CP reads
    got = chunk_attention(query, keys, values, positions, 0.3)
    torch.testing.assert_close(got, masked_softmax_attention(query, keys, values, positions, 0.3))
    torch.testing.assert_close(got[:, real:], got[:, real - 1 : real].expand(-1, 16 - real, -1))


@pytest.mark.slow
def test_chunk_attention_compiled_by_aotinductor_with_an_unbacked_width(tmp_path):
    """The op as a cpu chunk graph calls it: over a block's view whose width is read from the
    positions inside the graph, one compiled graph for every width."""

    class BlockAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("k", torch.randn(2, 2, 64, 8))
            self.register_buffer("v", torch.randn(2, 2, 64, 8))

        def forward(self, query, positions, block):
            live, block = positions.max().item() + 1, block.item()
            torch._check(live >= 1)  # the bounds CpuKernels.cache_read gives the graph
            torch._check(live <= 64)
            torch._check(block >= 0)
            torch._check(block < 2)
            return chunk_attention(query, self.k[block, :, :live], self.v[block, :, :live], positions, 0.3)

    module = BlockAttention()
    query, block = torch.randn(4, 16, 8), torch.tensor(1)
    program = torch.export.export(module, (query, chunk(48, 16, 16), block))
    compiled = torch._inductor.aoti_load_package(
        torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "a.pt2"))
    )
    for start, real in [(0, 16), (20, 7), (48, 16)]:
        positions = chunk(start, real, 16)
        width = int(positions.max()) + 1
        want = masked_softmax_attention(query, module.k[1, :, :width], module.v[1, :, :width], positions, 0.3)
        torch.testing.assert_close(compiled(query, positions, block), want)


@pytest.mark.parametrize("from_window, window", [(64, 64), (128, 64), (None, 64)])
def test_the_op_runs_in_prefill_graphs_from_its_bucket_only(monkeypatch, from_window, window):
    """A chunk graph whose bucket reaches the threshold attends with the op in every layer; a
    narrower bucket, a decode step and a backend without the choice never call it."""
    config = NeuronConfig(batch_size=2, sequence_length=128, prefill_chunk_size=16, backend="eager")
    spec = build_model(AutoConfig.from_pretrained(checkpoint_path("llama")), config).spec
    model = model_from_spec(
        spec,
        config,
        kernels=CpuKernels(KernelChoices(onednn_chunk_attention_from_window=from_window), KVPool.of(config)),
    )
    calls = []
    monkeypatch.setattr(attention, "chunk_attention", lambda *a: calls.append(1) or chunk_attention(*a))
    with torch.no_grad():
        PrefillGraph(model.eval(), window)(
            torch.arange(5, 21)[None], torch.arange(16)[None], torch.tensor([[0]])
        )
        prefill_calls = len(calls)
        model.hidden_states(torch.tensor([[3], [4]]), torch.tensor([[16], [0]]), torch.tensor([[0], [1]]), window,
                            decode_rows=True)  # fmt: skip
    uses_op = from_window is not None and window >= from_window
    assert (prefill_calls, len(calls)) == ((spec.num_layers,) * 2 if uses_op else (0, 0))


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_glibc_accepts_the_heap_thresholds():
    """The op pays only with the heap kept (backends.cpu.keep_freed_heap): glibc refuses an
    mmap threshold above its maximum (32 MiB on 64-bit), and then nothing would be kept."""
    from optimum_neuron_chunked.backends.cpu import keep_freed_heap

    assert keep_freed_heap()


def test_the_cpu_backend_chooses_the_op_only_on_hosts_with_avx512():
    """oneDNN's products lose to SDPA's flash kernel without AVX-512 (2-4x a layer on an AVX2
    EPYC): the choice follows the vector ISA of the host that compiles."""
    from optimum_neuron_chunked.backends.cpu.kernels import kernel_choices

    assert kernel_choices("AVX512").onednn_chunk_attention_from_window == 2048
    assert kernel_choices("AVX2").onednn_chunk_attention_from_window is None
