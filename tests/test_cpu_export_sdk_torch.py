"""The cpu backend on the Neuron SDK's torch (2.9, make test-sdk), the default backend of
`optimum-cli export neuron` and `vllm serve CHECKPOINT` on a host without the SDK's closed packages:
its graphs, which read their live width as a scalar, export and compile there and generate as
transformers does; fp8 weights or an fp8 KV pool, which torch 2.9's AOTInductor cannot compile,
are refused before any work, naming what to use instead."""

from __future__ import annotations

import pytest
import torch
from fixtures.export_models import checkpoint_path
from helpers import prompt

from optimum_neuron_chunked.backends import BackendUnavailableError
from optimum_neuron_chunked.backends.cpu.backend import FLOAT8_TORCH
from optimum_neuron_chunked.export.pipeline import export
from optimum_neuron_chunked.generation import prefill_prompt

pytestmark = pytest.mark.skipif(
    torch.__version__ >= FLOAT8_TORCH,
    reason="torch 2.13: the main suite's cpu exports (test_parity, test_kv_fp8) run on it",
)

# a standard export of one bucket: two graphs (CE, TG), no copy graph
SHAPES = dict(batch_size=2, sequence_length=32, prefill_chunk_size=0, context_buckets=(32,), backend="cpu")


def test_the_cpu_backend_exports_on_the_sdk_torch_and_generates_as_transformers(tmp_path, hf_reference):
    from optimum_neuron_chunked import NeuronModelForCausalLM

    source = str(checkpoint_path("llama"))
    for float8 in (dict(kv_cache_dtype="fp8"), dict(quantization="fp8")):
        with pytest.raises(BackendUnavailableError, match=r"needs torch >= 2\.13.*--backend eager"):
            export(source, tmp_path / "fp8", **float8, **SHAPES)
    assert list(tmp_path.iterdir()) == []

    model = NeuronModelForCausalLM.from_pretrained(export(source, tmp_path / "out", **SHAPES))
    hf = hf_reference("llama")
    for length in (1, 9):  # one token: a live width of 1, the smallest the graphs read
        ids = prompt(length)
        with torch.no_grad():
            expected = hf(ids[None]).logits[0, -1]
        torch.testing.assert_close(prefill_prompt(model.runner, ids, (1,)), expected, atol=1e-4, rtol=0)
    pad = hf.generation_config.pad_token_id
    input_ids = torch.tensor([[pad] * 8 + prompt(1).tolist(), prompt(9).tolist()])
    attention_mask = (torch.arange(9) >= torch.tensor([[8], [0]])).long()
    output = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=12)
    expected = hf.generate(input_ids, attention_mask=attention_mask, max_new_tokens=12, do_sample=False)
    assert output.tolist() == expected.tolist()
