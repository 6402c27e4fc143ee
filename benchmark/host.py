"""The machine a result was measured on, and where results go.

A result records the CPU's model and widest vector extension: vLLM's native CPU engine runs
oneDNN kernels picked by those (its timings moved 5x between hosts under one VM label).
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
WORK = Path.home() / ".cache" / "optimum-neuron-chunked"
VECTOR_EXTENSIONS = ("amx_tile", "avx512_bf16", "avx512f", "avx2")  # widest first


def describe_host() -> str:
    """e.g. 'vm 2 cpus, AMD EPYC, avx2'."""
    model, flags = "unknown cpu", set()
    cpuinfo = Path("/proc/cpuinfo")
    for line in cpuinfo.read_text().splitlines() if cpuinfo.is_file() else ():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            model = value.strip()
        elif key.strip() == "flags":
            flags = set(value.split())
        if flags and model != "unknown cpu":
            break
    widest = next((ext for ext in VECTOR_EXTENSIONS if ext in flags), "no avx2")
    return f"{platform.node()} {os.cpu_count()} cpus, {model}, {widest}"


def results_folder(given: Path | str | None, smoke: bool) -> Path:
    """`given`, else benchmark/results; a smoke run's default is a fresh temporary folder, so
    that it never replaces a kept result. Created now: a long run's figures are not lost."""
    if given:
        folder = Path(given)
    elif smoke:
        folder = Path(tempfile.mkdtemp(prefix="bench-smoke-"))
        print(f"smoke run: results in {folder}", file=sys.stderr)
    else:
        folder = RESULTS
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def save(folder: Path, name: str, data: dict, lines: list[str], echo: bool = True) -> list[Path]:
    """`name`.json (the data) and `name`.md (the table) in `folder`; prints the table."""
    paths = [folder / f"{name}.json", folder / f"{name}.md"]
    paths[0].write_text(json.dumps(data, indent=1, default=str) + "\n")
    paths[1].write_text("\n".join(lines) + "\n")
    if echo:
        print("\n".join(lines))
    return paths
