"""The long-context census of a prefill chunk's graph with AWS's attention kernel in it: an
opaque stand-in for nkilib's attention_cte (one custom call, as neuronx-cc receives an NKI
kernel: not the torch reference, which builds the whole score matrix itself) lets torch-xla
lower CP graphs at Llama-3.1-8B attention shapes (one layer; 32 query / 8 KV heads at tp 1,
4 / 1 a core at tp 8) without executing them. With the kernel, no intermediate grows with
chunk x window: the largest is the row's K or V read, linear in the window (or a weight's
relayout, constant); the reference's fp32 scores are chunk x window x heads. The kernels are
the export's own: a trn2 bf16 export's choice against nki-library 2.29_release's limit
constants (NeuronBackend.kernels of the chosen graphs). The figures print (docs/performance.md
keeps them).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

pytest.importorskip("torch_xla", reason="XLA checks run in .venv-sdk: make test-sdk")

import torch  # noqa: E402
from transformers import LlamaConfig  # noqa: E402

from optimum_neuron_chunked.backends.neuron import NeuronBackend  # noqa: E402
from optimum_neuron_chunked.backends.neuron.attention_choice import choose_nki_graphs  # noqa: E402
from optimum_neuron_chunked.backends.xla import HloReport  # noqa: E402
from optimum_neuron_chunked.config import NeuronConfig  # noqa: E402
from optimum_neuron_chunked.graphs import cp_spec, example_inputs, graph_module, graph_specs  # noqa: E402
from optimum_neuron_chunked.modeling import build_model, family_spec  # noqa: E402
from optimum_neuron_chunked.modeling.kernels import Kernels  # noqa: E402
from optimum_neuron_chunked.testing.nki_stand_in import installed  # noqa: E402

pytestmark = pytest.mark.xla

CHUNK, WINDOWS, HEAD_DIM = 256, (8192, 32768, 131072), 128


def opaque_attention_cte(q, k, v, **kwargs):
    """attention_cte as the compiler sees it: a custom call over its inputs -> [B, Sq, d]."""
    from torch_xla.experimental.stablehlo_custom_call import stablehlo_custom_call

    tokens = q.shape[1] if kwargs["tp_q"] else q.shape[2]
    inputs = [q, k, v, kwargs["k_prior"], kwargs["v_prior"], kwargs["prior_used_len"]]
    return stablehlo_custom_call(inputs, "attention_cte", [[q.shape[0], tokens, HEAD_DIM]], [q.dtype])


@pytest.fixture
def opaque_kernel():
    with installed(opaque_attention_cte) as kernel:
        # attention_cte.py's limits on 2.29_release (l.140-143)
        kernel.module._MAX_BS, kernel.module._MAX_SEQLEN, kernel.module._MAX_HEAD_DIM = 512, 131072, 128
        yield


def one_layer(heads: int, kv_heads: int) -> LlamaConfig:
    return LlamaConfig(hidden_size=4096, intermediate_size=256, num_hidden_layers=1, vocab_size=512,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=HEAD_DIM,
                       max_position_embeddings=max(WINDOWS))  # fmt: skip


def shapes(window: int, **fields) -> NeuronConfig:
    return NeuronConfig(batch_size=1, sequence_length=window, prefill_chunk_size=CHUNK, dtype="bfloat16",
                        context_buckets=(window,), **fields)  # fmt: skip


def export_kernels(heads: int, kv_heads: int, window: int):
    """The kernels a trn2 export of this shape compiles its graphs with."""
    config = shapes(window, backend="neuron", instance_type="trn2")
    chosen, reasons, _ = choose_nki_graphs(
        config, family_spec(one_layer(heads, kv_heads)), graph_specs(config)
    )
    assert chosen == (f"cp_w{window}",), reasons
    return NeuronBackend().kernels(replace(config, nki_attention=chosen))


def largest_intermediate(kernels, heads: int, kv_heads: int, window: int) -> int:
    """Bytes of the largest array in the CP graph of one chunk at bucket `window`."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    hf_config = one_layer(heads, kv_heads)
    config = shapes(window, backend="xla")
    device = xm.xla_device()
    model = build_model(hf_config, config, functional_cache=True, kernels=kernels).to(device)
    spec = cp_spec(config, CHUNK, window)
    inputs = [x.to(device) for x in example_inputs(spec, config)]
    with torch.no_grad():
        logits = graph_module(model, spec, config)(*inputs)
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([logits])
    return HloReport.of(spec.name, hlo).largest_bytes


@pytest.mark.parametrize("heads, kv_heads", [(32, 8), (4, 1)], ids=["tp1", "tp8"])
def test_chunks_through_the_kernel_hold_nothing_chunk_by_window(opaque_kernel, heads, kv_heads):
    for window in WINDOWS:
        with_kernel = largest_intermediate(export_kernels(heads, kv_heads, window), heads, kv_heads, window)
        reference = largest_intermediate(Kernels(), heads, kv_heads, window)
        read = kv_heads * window * HEAD_DIM * 2  # one of K, V of the row's window, bf16
        weight = 4096 * heads * HEAD_DIM * 2  # q_proj's, relaid out: constant in the window
        print(f"tp {32 // heads} window {window}: largest intermediate {with_kernel / 2**20:.0f} MiB with "
              f"the kernel, {reference / 2**20:.0f} MiB with the reference")  # fmt: skip
        assert with_kernel <= max(read, weight)
        assert reference >= heads * CHUNK * window * 4  # the reference's fp32 scores
