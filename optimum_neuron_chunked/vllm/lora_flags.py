"""vLLM's LoRA flags against the export's adapter slots: checked, then vLLM's `lora_config` set to
what the export serves, so that its scheduler admits at most the export's slots of distinct
adapters a step (v1/core/sched/scheduler.py, 0.16.0 and 0.32).

  --enable-lora            needs an export with --max-loras slots (a plain checkpoint is exported
                           with them: export_options)
  --max-loras N            at most the export's slots; vLLM's default (1) reads as not given
  --max-lora-rank r        at most the export's rank; vLLM's default (16) reads as not given
  --lora-target-modules    a subset of the export's targets (not given: the export's)
  --max-cpu-loras          adapters kept on the host, as vLLM defines it (at least --max-loras)
"""

from __future__ import annotations

from ..config import NeuronConfig
from ..lora_targets import resolve_targets
from .compat import lora_target_modules
from .limits import ServingConfigError


def vllm_defaults() -> tuple[int, int]:
    """(max_loras, max_lora_rank) as vLLM fills them when not given (config/lora.py)."""
    from vllm.config.lora import LoRAConfig

    defaults = LoRAConfig()
    return defaults.max_loras, defaults.max_lora_rank


def lora_export_options(lora_config) -> dict:
    """`vllm serve CHECKPOINT --enable-lora ...`: the export's slots as vLLM's flags say."""
    if lora_config is None:
        return {}
    return {
        "max_loras": lora_config.max_loras,
        "max_lora_rank": lora_config.max_lora_rank,
        "lora_target_modules": tuple(lora_target_modules(lora_config)),
    }


def fit_lora(vllm_config, export: NeuronConfig) -> str:
    """Check vLLM's LoRA flags against the export and set them to what it serves -> a log line.
    Idempotent: the second call (the engine core's) reads the values the first one set."""
    lora_config = vllm_config.lora_config
    if lora_config is None:
        return "off" + (
            f" (the export has {export.max_loras} adapter slots: --enable-lora)"
            if export.has_lora_slots
            else ""
        )
    if not export.has_lora_slots:
        raise ServingConfigError(
            "--enable-lora: this export has no LoRA adapter slots; re-export with --max-loras N "
            "--max-lora-rank R, or serve the source checkpoint with --enable-lora (it is exported with them)."
        )
    default_slots, default_rank = vllm_defaults()
    slots = export.max_loras if lora_config.max_loras == default_slots else lora_config.max_loras
    rank = export.max_lora_rank if lora_config.max_lora_rank == default_rank else lora_config.max_lora_rank
    problems = []
    if slots > export.max_loras:
        problems.append(f"--max-loras {slots} exceeds the export's {export.max_loras} adapter slots")
    if rank > export.max_lora_rank:
        problems.append(f"--max-lora-rank {rank} exceeds the export's {export.max_lora_rank}")
    given = lora_target_modules(lora_config)
    try:
        targets = resolve_targets(given)
    except ValueError as e:
        raise ServingConfigError(str(e)) from None
    missing = [t for t in targets if t not in export.lora_target_modules]
    if given and missing:
        problems.append(
            f"--lora-target-modules {', '.join(missing)}: the export has slots on "
            f"{', '.join(export.lora_target_modules)} only"
        )
    if problems:
        raise ServingConfigError(
            "; ".join(problems) + ": lower them, or re-export with larger --max-loras / --max-lora-rank."
        )
    lora_config.max_loras, lora_config.max_lora_rank = slots, rank
    lora_config.max_cpu_loras = max(lora_config.max_cpu_loras or 0, slots)
    return f"{slots} adapters a step (of {export.max_loras} slots), rank <= {rank}, {lora_config.max_cpu_loras} kept on the host"
