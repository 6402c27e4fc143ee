"""vLLM's flags as export options: `vllm serve MODEL` on a plain checkpoint exports it with
what the flags say (the one mapping; README's table), and serving an export checks the same
flags against it.

  --max-model-len            sequence_length (not given: DEFAULT_SEQUENCE_LENGTH, at most the
                             checkpoint's maximum - vLLM would fill in e.g. 131072 for Llama-3.1)
  --max-num-seqs             batch_size (not given: DEFAULT_BATCH_SIZE)
  --dtype                    dtype, as vLLM resolved it (`auto`: the platform's supported_dtypes)
  --tensor-parallel-size N   tp_degree (neuron backend); vLLM's own TP is then set back to 1:
                             one worker drives every NeuronCore of the export
  --quantization fp8         quantization fp8: weight-only, per output channel (not vLLM's W8A8);
                             one vLLM read from an FP8 checkpoint's config is the checkpoint's
  --speculative-config       ngram with K tokens: speculation_length K; eagle3 with a head
                             `model` and K tokens: speculation_head HEAD, speculation_length K
  --kv-cache-dtype fp8       kv_cache_dtype fp8 (fp8_e4m3 the same; auto or the export's dtype:
                             no change; vLLM's other values refused by name)
  --enable-lora              max_loras, max_lora_rank, lora_target_modules from --max-loras,
                             --max-lora-rank, --lora-target-modules (lora_flags.py)
  --additional-config        every other export option under its NeuronConfig name
                             (prefill_chunk_size, context_buckets, backend, mixed_step, ...)
"""

from __future__ import annotations

from difflib import get_close_matches

from ..config import EXPORT_OPTIONS, NeuronConfig
from .limits import EXACT_FLAGS, EngineRequest, ServingConfigError, check_speculative_method
from .lora_flags import lora_export_options

# export option -> the vLLM flag that sets it
FROM_FLAGS = {
    "sequence_length": "--max-model-len",
    "batch_size": "--max-num-seqs",
    "dtype": "--dtype",
    "tp_degree": "--tensor-parallel-size",
    "speculation_length": "--speculative-config",
    "speculation_head": "--speculative-config",
    "kv_cache_dtype": "--kv-cache-dtype",
}
# keys vLLM writes into additional_config itself (vllm/engine/arg_utils.py, 0.32)
VLLM_WRITTEN_KEYS = ("gdn_prefill_backend", "kda_prefill_backend", "kda_decode_backend")
FP8_FLAGS = ("fp8", "fp8_per_channel", "fp8_per_tensor")  # vLLM 0.32's spellings; 0.16.0: fp8
DEFAULT_SEQUENCE_LENGTH = 4096
DEFAULT_BATCH_SIZE = 8
OPTION_NAMES = tuple(o.name for o in EXPORT_OPTIONS)


def additional_export_keys(additional_config) -> dict:
    """The export options given through --additional-config; refuses unknown keys and keys a
    vLLM flag sets."""
    given = additional_config if isinstance(additional_config, dict) else {}
    keys = {k: v for k, v in given.items() if k not in (*EXACT_FLAGS, *VLLM_WRITTEN_KEYS)}
    for name in keys:
        if name in FROM_FLAGS:
            raise ServingConfigError(
                f"--additional-config {name}: pass vLLM's {FROM_FLAGS[name]} instead (it sets the export's {name})."
            )
        if name not in OPTION_NAMES:
            close = get_close_matches(name, (*OPTION_NAMES, *EXACT_FLAGS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ServingConfigError(
                f"--additional-config {name!r}{hint} is not an option of this platform: its keys are "
                f"{', '.join(n for n in OPTION_NAMES if n not in FROM_FLAGS)} (export options) and "
                f"{', '.join(EXACT_FLAGS)}."
            )
    return {k: tuple(v) if isinstance(v, list) else v for k, v in keys.items()}


def export_options(vllm_config, request: EngineRequest) -> tuple[dict, NeuronConfig, list[str]]:
    """(export()'s options for the served checkpoint, their NeuronConfig, what was chosen for the
    user: log lines)."""
    model_config = vllm_config.model_config
    options = additional_export_keys(vllm_config.additional_config)
    notes = []
    length = request.max_model_len
    if length is None:
        length = min(DEFAULT_SEQUENCE_LENGTH, model_config.max_model_len)
        notes.append(
            f"--max-model-len not given: compiling for {length} positions (the checkpoint allows "
            f"{model_config.max_model_len}); pass --max-model-len N for another length"
        )
    batch = request.max_num_seqs or DEFAULT_BATCH_SIZE
    if request.max_num_seqs is None:
        notes.append(f"--max-num-seqs not given: compiling for {batch} sequences; pass --max-num-seqs N")
    options |= {"sequence_length": length, "batch_size": batch, "dtype": request.dtype}
    options["tp_degree"] = vllm_config.parallel_config.tensor_parallel_size
    if options["tp_degree"] > 1 and options.get("backend", "neuron") != "neuron":
        raise ServingConfigError(
            f"--tensor-parallel-size {options['tp_degree']} shards the export across NeuronCores: the "
            f"{options['backend']} backend runs on one process; drop the flag."
        )
    check_speculative_method(request.speculative_method, request.speculative_options)
    options["speculation_length"] = request.speculative_tokens if request.speculative_method else 0
    if request.speculative_method == "eagle3":  # vLLM refuses eagle3 without a model itself
        options["speculation_head"] = request.speculative_head
    kv_dtype = kv_cache_dtype_option(vllm_config.cache_config.cache_dtype, request.dtype)
    if kv_dtype is not None:
        options["kv_cache_dtype"] = kv_dtype
    options |= lora_export_options(vllm_config.lora_config)
    quantization = quantization_option(model_config, options.get("quantization"))
    if quantization is not None:
        options["quantization"] = quantization
    return _with_host_choices(options, notes)


def _with_host_choices(options: dict, notes: list[str]) -> tuple[dict, NeuronConfig, list[str]]:
    """The backend, target and default chunk size resolved on this host, the whole validated
    once (with the chunk size it will be exported with)."""
    from ..backends import BackendUnavailableError, get_backend
    from ..export_cache.build import host_choices, resolved_config

    try:
        host = host_choices(options)
        if "prefill_chunk_size" not in options:
            chunk = get_backend(host["backend"]).default_chunk_size(host.get("instance_type", ""))
            options = options | {"prefill_chunk_size": min(chunk, options["sequence_length"])}
        config, resolved = resolved_config(options, host)
    except (ValueError, BackendUnavailableError) as e:  # they name the flag
        raise ServingConfigError(f"the export these flags ask for cannot be made: {e}") from e
    if "dtype" in options:
        notes.append(f"dtype {resolved['dtype']} (vLLM's --dtype, `auto` resolved by this platform)")
    return resolved, config, notes


def kv_cache_dtype_option(flag: str, dtype: str) -> str | None:
    """vLLM's --kv-cache-dtype (config/cache.py CacheDType) as the export option: fp8 for fp8 /
    fp8_e4m3 (vLLM's alias), None (no change) for auto or the model's own dtype; refused by name
    otherwise. `dtype`: the export's compute dtype."""
    if flag in ("auto", dtype):
        return None
    if flag in ("fp8", "fp8_e4m3"):
        return "fp8"
    raise ServingConfigError(
        f"--kv-cache-dtype {flag} is not supported: the KV pool holds {dtype} (auto) or fp8 (float8 e4m3, "
        "--kv-cache-dtype fp8)."
    )


def quantization_option(model_config, key: str | None) -> str | None:
    """The export's quantization from --quantization and the additional-config key: fp8 from
    the flag, int8 from the key only; a quantization vLLM read from the checkpoint's own config
    leaves it to the export (FP8 checkpoints stay FP8). None: the export decides."""
    flag = model_config.quantization
    if flag is None or _quantized_checkpoint(model_config):
        return key
    if flag not in FP8_FLAGS:
        raise ServingConfigError(
            f"--quantization {flag} is not supported: this platform exports weight-only fp8 "
            f'(--quantization fp8) or int8 (--additional-config \'{{"quantization": "int8"}}\').'
        )
    if key not in (None, "fp8"):
        raise ServingConfigError(
            f"--quantization {flag} and --additional-config quantization {key!r} disagree: give one."
        )
    return "fp8"


def _quantized_checkpoint(model_config) -> bool:
    """Whether the checkpoint's own config declares its quantization (vLLM then reads its
    --quantization from it: the export decides, not the flag)."""
    return getattr(model_config.hf_config, "quantization_config", None) is not None


def check_export_keys(export: NeuronConfig, vllm_config) -> None:
    """Serving an export: the export options given must be what it was exported with."""
    keys = additional_export_keys(vllm_config.additional_config)
    differ = {
        k: v
        for k, v in keys.items()
        if k != "instance_type" and getattr(export, k) != _as_field(export, k, v)
    }
    if differ:
        said = ", ".join(f"{k} {v!r} (the export's: {getattr(export, k)!r})" for k, v in differ.items())
        raise ServingConfigError(
            f"--additional-config {said}: an export serves the options it was exported with; drop "
            "them, or serve the source checkpoint to export it with these."
        )
    tp = vllm_config.parallel_config.tensor_parallel_size
    if tp not in (1, export.tp_degree):
        raise ServingConfigError(
            f"--tensor-parallel-size {tp} differs from the export's {export.tp_degree}: drop the flag, "
            f"or re-export with --tensor_parallel_size {tp}."
        )
    kv_dtype = kv_cache_dtype_option(vllm_config.cache_config.cache_dtype, export.dtype)
    if kv_dtype not in (None, export.kv_cache_dtype):
        raise ServingConfigError(
            f"--kv-cache-dtype {vllm_config.cache_config.cache_dtype} differs from the export's KV cache "
            f"({export.kv_cache_dtype}): drop the flag, or serve the source checkpoint to export it with fp8 KV."
        )
    flag = vllm_config.model_config.quantization
    quantized_checkpoint = _quantized_checkpoint(vllm_config.model_config)
    if (
        flag is not None
        and not quantized_checkpoint
        and not (flag in FP8_FLAGS and export.quantization == "fp8")
    ):
        raise ServingConfigError(
            f"--quantization {flag} is not what this export holds ({export.quantization or 'unquantized'} "
            "weights): drop the flag, the export decides."
        )


def _as_field(export: NeuronConfig, name: str, value):
    current = getattr(export, name)
    return tuple(value) if isinstance(current, tuple) and isinstance(value, list | tuple) else value


def describe_export(config: NeuronConfig) -> str:
    """The first log line of an export for `vllm serve`: the shapes, the graph count, the flags."""
    from ..graphs import graph_specs

    chunk = config.prefill_chunk_size
    kind = f"chunks of {chunk}" if chunk else "the standard context encoding"
    return (
        f"for {config.batch_size} sequences (--max-num-seqs) of {config.sequence_length} "
        f"positions (--max-model-len), {kind} (--additional-config prefill_chunk_size), "
        f"{config.dtype} (--dtype), backend {config.backend}: {len(graph_specs(config))} graphs"
    )
