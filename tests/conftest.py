from __future__ import annotations

import glob
import importlib.util
import os
import random

import pytest
import torch
import torch._inductor.config
from fixtures.export_models import EXPORTS, cache_root, checkpoint_path, export_model
from helpers import HLO_CENSUS

# `vllm serve CHECKPOINT` and from_pretrained(export=True) in tests: never the user's own cache
os.environ.setdefault("ONC_EXPORT_CACHE", str(cache_root() / "export-cache"))

# AOTInductor specializes a cpu graph's loops to the thread count at compile time (inductor's
# cpp.threads, else torch.get_num_threads()), and make test runs one OpenMP thread a process
# (tools/test_side_by_side.sh): test exports are compiled for two threads whatever the run's
# setting, so that their parallel loops stay tested and a cached export is the same whoever built it.
torch._inductor.config.cpp.threads = 2


def pytest_collection_modifyitems(config, items):
    has_device = bool(glob.glob("/dev/neuron*"))
    has_xla = importlib.util.find_spec("torch_xla") is not None
    for item in items:
        if "neuron" in item.keywords and not has_device:
            item.add_marker(pytest.mark.skip(reason="needs a Neuron device (/dev/neuron*)"))
        if "xla" in item.keywords and not has_xla:
            item.add_marker(
                pytest.mark.skip(reason="needs torch-xla: the SDK-mirror environment (make test-sdk)")
            )


@pytest.fixture(autouse=True)
def seeded_torch():
    """Every test draws the same random tensors and numbers on every run: a failure reproduces."""
    random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def export_dir(request):
    """Indirectly parametrized with an export id: the (cached) export folder."""
    return export_model(EXPORTS[request.param])


@pytest.fixture(scope="session")
def hf_reference():
    """family -> transformers model (fp32, eval) of the same tiny checkpoint."""
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(family: str):
        if family not in cache:
            cache[family] = AutoModelForCausalLM.from_pretrained(
                checkpoint_path(family), dtype=torch.float32
            ).eval()
        return cache[family]

    return get


@pytest.fixture(scope="session")
def neuron_model(export_dir):
    """The loaded export of `export_dir` (one per session: loading AOTI packages takes seconds)."""
    from optimum_neuron_chunked import NeuronModelForCausalLM

    return NeuronModelForCausalLM.from_pretrained(export_dir)


def pytest_terminal_summary(terminalreporter):
    """The HLO census of every graph the XLA tests lowered, so that changes show in CI logs."""
    if not HLO_CENSUS:
        return
    ops = ["instructions", "sort", "scatter", "gather", "dot", "reduce", "s64 values", "8-bit params"]
    terminalreporter.section("HLO census (graphs as the neuron backend traces them)")
    terminalreporter.write_line(
        f"{'graph':<30}" + "".join(f"{op:>13}" for op in [*ops, "widest sort", "largest KiB"])
    )
    for name, report in sorted(HLO_CENSUS.items()):
        counts = [report.census[op] for op in ops] + [report.widest_sort, report.largest_bytes // 1024]
        terminalreporter.write_line(f"{name:<30}" + "".join(f"{c:>13}" for c in counts))


@pytest.fixture(scope="session")
def llm(export_dir):
    """vllm.LLM on the export of `export_dir`, shared by every test of the session on that export
    (pytest keeps one at a time: a test on another export replaces it)."""
    from vllm import LLM

    engine = LLM(model=str(export_dir), seed=0)
    yield engine
    engine.llm_engine.engine_core.shutdown()
