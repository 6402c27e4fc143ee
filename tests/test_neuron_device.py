"""On a Neuron device: export -> load -> generate -> compare with transformers, std and
chunked, tp 1 and 2, plus one vLLM engine run. Each case in its own process (see
tests/neuron_e2e.py). Skipped without /dev/neuron*."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("neuron_e2e.py")


def run_isolated(*args: str) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]


@pytest.mark.neuron
@pytest.mark.parametrize("chunk", [0, 32], ids=["std", "chunked"])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_generate_equals_hf(family, tp, chunk):
    run_isolated("--family", family, "--tp", str(tp), "--chunk", str(chunk))


@pytest.mark.neuron
@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_quantized_generate_equals_hf_on_the_same_weights(quantization):
    run_isolated("--family", "llama", "--tp", "2", "--chunk", "32", "--quantization", quantization)


@pytest.mark.neuron
def test_prefill_chunks_through_the_nki_kernel_are_as_accurate_as_the_reference():
    run_isolated("--attention-kernel")


@pytest.mark.neuron
def test_vllm_engine_equals_hf():
    run_isolated("--family", "llama", "--tp", "2", "--chunk", "32", "--vllm")
