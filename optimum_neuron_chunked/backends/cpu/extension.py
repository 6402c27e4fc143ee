"""The cpu backend's C++ ops: built by torch's cpp_extension on first use (cached on disk by
name and source), registered with the dispatcher, no Python module."""

from __future__ import annotations

import hashlib
from pathlib import Path


def build_op_library(name: str, source: Path, cflags: list[str], ldflags: list[str]) -> None:
    """Compile `source` (or reuse the build cached under `name` and a digest of what it is built
    from) and load its TORCH_LIBRARY ops. The digest in the name: torch keys a build by name alone
    and rebuilds it in place when anything differs, so processes of two environments on one host
    (another version of this package, another torch) could load each other's op - an
    AOTInductor package then calls a schema that is not there."""
    import torch
    from torch.utils.cpp_extension import load

    built_from = [source.read_bytes(), torch.__version__.encode(), " ".join(cflags + ldflags).encode()]
    digest = hashlib.sha256(b"\0".join(built_from)).hexdigest()[:12]
    load(
        name=f"{name}_{digest}",
        sources=[str(source)],
        extra_cflags=cflags,
        extra_ldflags=ldflags,
        is_python_module=False,
    )
