"""The cpu backend's C++ ops: built by torch's cpp_extension on first use (cached on disk by
name and source), registered with the dispatcher, no Python module."""

from __future__ import annotations

from pathlib import Path


def build_op_library(name: str, source: Path, cflags: list[str], ldflags: list[str]) -> None:
    """Compile `source` (or reuse the build cached under `name`) and load its TORCH_LIBRARY ops."""
    from torch.utils.cpp_extension import load

    load(name=name, sources=[str(source)], extra_cflags=cflags, extra_ldflags=ldflags, is_python_module=False)
