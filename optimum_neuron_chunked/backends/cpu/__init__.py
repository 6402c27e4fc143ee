"""The cpu backend: torch.export + AOTInductor (backend.py) and its kernel strategy (kernels.py)."""

from .backend import INDUCTOR_CONFIGS, CpuBackend, check_runs_here, inductor_configs, keep_freed_heap

__all__ = ["INDUCTOR_CONFIGS", "CpuBackend", "check_runs_here", "inductor_configs", "keep_freed_heap"]
