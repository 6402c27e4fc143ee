"""Denormal floats flushed to zero in the threads that call cpu graphs.

x86 computes with denormal operands (magnitudes under 1.2e-38) ~100x slower than with normal
ones, and softmax weights of long rows land there (exp of scores far below the row's maximum;
the figure: docs/performance.md). Flushing changes no value above 1.2e-38. The mode (MXCSR) is
per thread, and OpenMP's pool belongs to the thread that starts parallel work: each thread that
calls graphs sets it once, for itself and its pool (denormals.cpp), built on first use like the
decode op.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from .extension import build_op_library

SOURCE = Path(__file__).with_suffix(".cpp")
_thread = threading.local()


def flush_denormals() -> None:
    """FTZ | DAZ for this thread and its intra-op pool (once per thread)."""
    if getattr(_thread, "flushed", False):
        return
    _load()
    torch.ops.optimum_neuron_chunked.flush_denormals()
    _thread.flushed = True


def flushing(graph: Callable) -> Callable:
    """`graph`, called with denormals flushed in the calling thread."""

    def call(*args):
        flush_denormals()
        return graph(*args)

    return call


@functools.cache
def _load() -> None:
    build_op_library("optimum_neuron_chunked_denormals", SOURCE, ["-O2", "-fopenmp"], ["-fopenmp"])
