"""The machine a result was measured on, as a results header records it.

The CPU's model and widest vector extension are part of it: vLLM's native CPU engine runs
oneDNN kernels picked by those, and its timings moved 5x between sessions under one VM label
(an AVX2 host one day, an AVX-512 host the next), so a result must say which host it had.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

VECTOR_EXTENSIONS = ("amx_tile", "avx512_bf16", "avx512f", "avx2")  # widest first


def describe_host() -> str:
    """e.g. 'vm 2 cpus, AMD EPYC, avx2'."""
    model, flags = "unknown cpu", set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
            if flags and model != "unknown cpu":
                break
    widest = next((ext for ext in VECTOR_EXTENSIONS if ext in flags), "no avx2")
    return f"{platform.node()} {os.cpu_count()} cpus, {model}, {widest}"
