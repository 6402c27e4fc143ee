"""The compiling host's vector ISA: the cpu backend's kernel choices and compiled code follow it."""

from __future__ import annotations

import torch


def host_cpu_capability() -> str:
    """ATen's vector ISA on this host ("AVX512", "AVX2", ...; ATEN_CPU_CAPABILITY lowers it)."""
    return torch.backends.cpu.get_cpu_capability()
