"""vLLM features the runner cannot honour, refused at start-up with the flag that asks for them.

A feature the worker would silently ignore or fail on at the first request is refused before
anything is loaded (LoRA: checked against the export's adapter slots, lora_flags.py). Speculative decoding is checked against the
export's verify graphs (limits.check_speculation); tensor parallelism and quantization against
the export (export_options.check_export_keys).
Attribute names are VllmConfig's and flags are `vllm serve`'s, as of vLLM 0.32
(vllm/config/vllm.py, vllm/engine/arg_utils.py).
"""

from __future__ import annotations

from .compat import uses_v2_model_runner
from .limits import ServingConfigError

# VllmConfig attribute -> (the flag that sets it, why it cannot be served)
UNSUPPORTED_CONFIGS = {
    "kv_transfer_config": (
        "--kv-transfer-config",
        "a KV connector would hand requests KV that the export's cache never received",
    ),
    "ec_transfer_config": ("--ec-transfer-config", "the exported decoders take no encoder inputs"),
    "watermark_config": ("--watermark-config", "the runner's samplers do not apply a watermark"),
    "weight_transfer_config": (
        "--weight-transfer-config",
        "weights are bound to the compiled graphs at load: re-export to change them",
    ),
    "diffusion_config": ("--diffusion-config", "the exported models are autoregressive decoders"),
    "engram_config": ("--engram-config", "the exported decoders have no engram memory"),
}


def refuse_unsupported(vllm_config) -> None:
    """Raise ServingConfigError naming every flag given that this platform cannot honour."""
    from .connector import is_platform_connector  # set by the platform itself: not a flag

    problems = [
        f"{flag} is not supported: {why}."
        for attr, (flag, why) in UNSUPPORTED_CONFIGS.items()
        if getattr(vllm_config, attr, None) is not None
        and not (attr == "kv_transfer_config" and is_platform_connector(vllm_config.kv_transfer_config))
    ]
    pipeline = vllm_config.parallel_config.pipeline_parallel_size
    if pipeline > 1:
        problems.append(
            f"--pipeline-parallel-size {pipeline} is not supported: the export's graphs run every "
            "layer; shard with --tensor-parallel-size (neuron backend) instead."
        )
    if uses_v2_model_runner(vllm_config):
        problems.append(
            "vLLM's model runner V2 is not supported (its scheduler resends resumed requests as new "
            "ones): unset VLLM_USE_V2_MODEL_RUNNER or set it to 0."
        )
    if problems:
        raise ServingConfigError(" ".join(problems))
