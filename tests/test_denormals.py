"""The cpu backend flushes denormal floats to zero in the thread that calls its graphs and in
that thread's intra-op pool (backends/cpu/denormals.py). Run in a fresh interpreter: the mode
is per thread and inherited by threads created after it is set."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import threading
import torch
from optimum_neuron_chunked.backends.cpu.denormals import flushing

tiny = torch.full((1 << 21,), 1e-39)  # a denormal float; 2M elements run on every pool thread
torch.set_num_threads(2)
assert torch.count_nonzero(tiny * 1.0).item() == tiny.numel()  # kept before
graph = flushing(lambda x: x * 1.0)
assert torch.count_nonzero(graph(tiny)).item() == 0
assert torch.count_nonzero(tiny * 1.0).item() == 0  # this thread and its pool keep the mode
assert (graph(torch.full((4,), 1e-30)) == 1e-30).all()  # normal values are untouched
results = []
other = threading.Thread(target=lambda: results.append(torch.count_nonzero(graph(tiny)).item()))
other.start(); other.join()
assert results == [0], results  # another calling thread flushes its own pool
print("ok")
"""


def test_graphs_run_with_denormals_flushed_in_every_calling_thread():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
