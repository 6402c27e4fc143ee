"""The vLLM platform: serves an export folder of this package with its own worker.

vLLM tensors stay on the host (device_type "cpu"): the graphs own the accelerator, the
platform only configures the engine around them.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from rich.console import Console
from vllm.logger import init_logger
from vllm.platforms import Platform, PlatformEnum

from ..backends import get_backend
from ..config import NeuronConfig
from ..export_folder import ExportCapabilities, check_export
from ..hub import is_export, resolve_export
from ..modeling.kv_layout import KVPool, PrefixCache
from .compat import cap_scheduled_tokens, drafting_options
from .export_options import check_export_keys, describe_export, export_options
from .features import refuse_unsupported
from .limits import EXACT_FLAGS, EngineRequest, ServingConfigError, serving_limits
from .lora_flags import fit_lora
from .speculation_head import check_head

logger = init_logger(f"vllm.{__name__}")  # under vLLM's configured logger

WORKER = "optimum_neuron_chunked.vllm.worker.NeuronChunkedWorker"
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class NeuronChunkedPlatform(Platform):
    _enum = PlatformEnum.OOT
    device_name = "cpu"
    device_type = "cpu"
    dispatch_key = "CPU"
    dist_backend = "gloo"
    simple_compile_backend = "inductor"
    serves_prompt_logprobs = False  # set from the export by check_and_update_config

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        # vLLM's "auto" takes a checkpoint's 16-bit dtype as it is and turns float32 into the
        # first of these (vllm/config/model.py _resolve_auto_dtype, 0.16.0 and 0.32): bf16 where
        # the neuron backend compiles (AWS's attention kernel computes in bf16), float32 on the
        # cpu / eager / xla backends (exact against transformers).
        from ..backends import default_backend

        if default_backend()[0] == "neuron":
            return [torch.bfloat16, torch.float32, torch.float16]
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def is_cpu(cls) -> bool:
        # vLLM's tensors live in host memory, so its host-side code paths (sampler ops, thread
        # setup of the engine process, shutdown) are the CPU ones; the graphs own the device.
        return True

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return "neuron-chunked"

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        import psutil

        return psutil.virtual_memory().total

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def inference_mode(cls):
        return torch.no_grad()

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        pass

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        pass

    @classmethod
    def import_kernels(cls) -> None:
        from .compat import import_host_kernels

        import_host_kernels()

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        """Check vLLM's arguments against the export and fit the engine to the static cache.

        Runs twice (front end, then engine core) and is idempotent.
        """
        model_config = vllm_config.model_config
        if model_config is None:
            return
        refuse_unsupported(vllm_config)  # before any work, an export included
        folder = _export_folder(vllm_config)
        export = check_export(folder)
        check_export_keys(export, vllm_config)
        adapters = fit_lora(vllm_config, export)
        _one_worker_drives_every_core(vllm_config.parallel_config)
        # validate_request has no config: what the export serves is kept for this process.
        cls.serves_prompt_logprobs = export.prompt_logprobs
        check_serving_host(export, vllm_config.parallel_config)  # each worker takes its devices
        request = _engine_request(vllm_config, export)
        limits = serving_limits(export, request)
        if request.speculative_method == "eagle3":
            check_head(folder, export, request.speculative_head)
        _warn_if_read_as_default(vllm_config, request, limits)
        _fit_engine(vllm_config, limits)
        caching = _set_prefix_caching(vllm_config, export)
        parallel = vllm_config.parallel_config
        if parallel.worker_cls == "auto":
            parallel.worker_cls = WORKER
        if parallel.distributed_executor_backend is None:
            parallel.distributed_executor_backend = "uni"
        vllm_config.compilation_config.cudagraph_capture_sizes = []
        # A process forked after torch ran OpenMP work deadlocks in its first parallel op:
        # engine processes must be spawned (vLLM's CPU platform does the same).
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        logger.info(
            "serving %s (%s) with %s; prefix caching %s; LoRA %s",
            model_config.model,
            _describe(export),
            limits,
            caching,
            adapters,
        )

    @classmethod
    def validate_request(cls, *args, **kwargs) -> None:
        from vllm.exceptions import VLLMValidationError

        from .compat import validate_request_args

        processed_inputs, params = validate_request_args(args, kwargs)

        if getattr(params, "prompt_logprobs", None) is not None and not cls.serves_prompt_logprobs:
            raise VLLMValidationError(
                "prompt_logprobs are not served by this export: its prefill graphs return the logits "
                "of the last prompt token only. Re-export with --prompt-logprobs to serve them.",
                parameter="prompt_logprobs",
            )
        for name in ("prompt_logprob_token_ids", "prompt_logprob_start"):
            if getattr(params, name, None) is not None:
                raise VLLMValidationError(
                    f"{name} is not supported: ask for prompt_logprobs (the top-k of every prompt "
                    "position) instead.",
                    parameter=name,
                )
        if isinstance(processed_inputs, dict) and processed_inputs.get("prompt_embeds") is not None:
            raise VLLMValidationError(
                "prompt embeddings are not supported: send token ids or text.", parameter="prompt_embeds"
            )


def _export_folder(vllm_config) -> Path:
    """The export `vllm serve MODEL` serves: MODEL itself, or the export cache's entry of the
    plain checkpoint MODEL, exported here with what vLLM's flags say (export_options.py) if no
    process built it yet. The entry then stands in for MODEL in vLLM's config, so that later
    runs of this hook (engine cores) serve it as an export; the served model name stays MODEL."""
    model_config = vllm_config.model_config
    if is_export(model_config.model, model_config.revision):
        return served_export(model_config)
    from ..backends import get_backend
    from ..export_cache import cached_export

    # export is None: a max_num_seqs of vLLM's defaults is read as not given (DEFAULT_BATCH_SIZE)
    options, config, notes = export_options(vllm_config, _engine_request(vllm_config, None))
    logger.info("%s is a plain checkpoint: its export is %s", model_config.model, describe_export(config))
    for note in notes:
        logger.info(note)
    get_backend(options["backend"]).check_available()
    folder = cached_export(model_config.model, options, model_config.revision, Console(stderr=True), logger)
    logger.info("serving %s from the export cache: %s", model_config.model, folder)
    if model_config.tokenizer == model_config.model:  # no --tokenizer: the export's portable copy
        model_config.tokenizer = str(folder)  # (export/tokenizer.py), which every vLLM loads
    model_config.model = str(folder)
    return folder


def _one_worker_drives_every_core(parallel) -> None:
    """vLLM's tensor parallelism, checked against the export's (check_export_keys), back to
    one worker: the export's graphs drive every NeuronCore themselves."""
    if parallel.tensor_parallel_size > 1:
        parallel.tensor_parallel_size = 1
        parallel.world_size = parallel.pipeline_parallel_size
        if parallel.world_size == 1:
            parallel.distributed_executor_backend = "uni"


def _fit_engine(vllm_config, limits) -> None:
    """vLLM's scheduler and KV-cache manager sized to the export (serving_limits)."""
    sched, cache = vllm_config.scheduler_config, vllm_config.cache_config
    vllm_config.model_config.max_model_len = limits.max_model_len
    sched.max_num_seqs = limits.max_num_seqs
    sched.max_num_batched_tokens = limits.max_num_batched_tokens
    cap_scheduled_tokens(sched, limits.max_num_batched_tokens)
    sched.long_prefill_token_threshold = limits.long_prefill_token_threshold
    sched.enable_chunked_prefill = limits.enable_chunked_prefill
    sched.async_scheduling = False  # the runner needs each step's tokens before the next
    cache.block_size = limits.block_size
    cache.user_specified_block_size = True
    cache.num_gpu_blocks_override = limits.num_blocks


def _engine_request(vllm_config, export: NeuronConfig | None) -> EngineRequest:
    """vLLM's arguments, with vLLM's own defaults read as 'not given' (the export decides).

    vLLM fills its defaults before any platform hook sees the arguments (EngineArgs.
    _set_default_max_num_seqs_and_batched_tokens_args, vllm/engine/arg_utils.py 0.32), so a
    value typed equal to one of them cannot be told from no flag: it is said in the log,
    and --additional-config '{"max_num_batched_tokens": N}' (or max_num_seqs) forces it."""
    from vllm.config import SchedulerConfig
    from vllm.engine.arg_utils import EngineArgs

    model_config, sched = vllm_config.model_config, vllm_config.scheduler_config
    world = vllm_config.parallel_config.world_size
    tokens_defaults, seqs_defaults = EngineArgs.get_batch_defaults(world)
    default_seqs = {*seqs_defaults.values(), SchedulerConfig.DEFAULT_MAX_NUM_SEQS}
    default_tokens = {*tokens_defaults.values(), SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS}
    # vLLM caps a default budget at max_num_seqs * max_model_len, default seqs at the budget
    default_tokens |= {sched.max_num_seqs * model_config.max_model_len}
    default_seqs |= {min(seqs, sched.max_num_batched_tokens) for seqs in default_seqs}
    exact = _exact_flags(vllm_config)
    seqs = exact.get("max_num_seqs", sched.max_num_seqs)
    if "max_num_seqs" not in exact and seqs in default_seqs and (export is None or seqs > export.batch_size):
        seqs = None
    tokens = exact.get("max_num_batched_tokens", sched.max_num_batched_tokens)
    if "max_num_batched_tokens" not in exact and tokens in default_tokens:
        tokens = None
    given_len = model_config.original_max_model_len
    speculative = vllm_config.speculative_config
    return EngineRequest(
        max_model_len=None if given_len in (None, -1) else given_len,
        max_num_seqs=seqs,
        max_num_batched_tokens=tokens,
        long_prefill_token_threshold=sched.long_prefill_token_threshold,
        dtype=DTYPE_NAMES.get(model_config.dtype, str(model_config.dtype)),
        num_gpu_blocks_override=vllm_config.cache_config.num_gpu_blocks_override,
        speculative_method=speculative.method if speculative is not None else None,
        speculative_tokens=speculative.num_speculative_tokens if speculative is not None else 0,
        speculative_head=speculative.model if speculative is not None else None,
        speculative_options=drafting_options(speculative) if speculative is not None else (),
    )


def _exact_flags(vllm_config) -> dict[str, int]:
    extra = vllm_config.additional_config if isinstance(vllm_config.additional_config, dict) else {}
    exact = {}
    for name in EXACT_FLAGS:
        value = extra.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ServingConfigError(f"--additional-config {name} must be a positive integer, got {value!r}.")
        if value is not None:
            exact[name] = value
    return exact


def _warn_if_read_as_default(vllm_config, request: EngineRequest, limits) -> None:
    sched = vllm_config.scheduler_config
    for name, seen, used in (
        ("max_num_batched_tokens", sched.max_num_batched_tokens, limits.max_num_batched_tokens),
        ("max_num_seqs", sched.max_num_seqs, limits.max_num_seqs),
    ):
        if getattr(request, name) is None and seen != used:
            flag = "--" + name.replace("_", "-")
            logger.info(  # every start without the flag says it too: not a warning
                "%s %d is one of vLLM's defaults, so it is read as not given: serving with %d (the "
                "export's). If you typed it, force it with --additional-config '{\"%s\": %d}'.",
                flag, seen, used, name, seen,
            )  # fmt: skip


def served_export(model_config) -> Path:
    """The export folder of `vllm serve MODEL`: a Hub export that runs code needs vLLM's own
    --trust-remote-code (ModelConfig.trust_remote_code, vLLM 0.16.0 and 0.32)."""
    return resolve_export(
        model_config.model, model_config.revision, model_config.trust_remote_code, "--trust-remote-code"
    )


def data_parallel_rank(parallel_config) -> tuple[int, int]:
    """(this engine core's rank, ranks) among the data-parallel ranks on this host."""
    return parallel_config.data_parallel_rank_local or 0, max(1, parallel_config.data_parallel_size_local)


def check_serving_host(export: NeuronConfig, parallel_config) -> None:
    """Refuse, saying what is missing, a host where the export's backend cannot serve every
    data-parallel rank of this host (the neuron backend: SDK, device, enough NeuronCores)."""
    _, dp_size = data_parallel_rank(parallel_config)
    get_backend(export.backend).check_serving_host(export, dp_size)


def _set_prefix_caching(vllm_config, export: NeuronConfig) -> str:
    """Prefix caching when vLLM's flag asks for it (`--enable-prefix-caching`, on by default
    for generative models in vLLM 0.32) and the export can serve it.
    Whole-sequence blocks: through our copy connector (connector.py); vLLM's own is always off (one block
    per request never fills). Idempotent: on the second call the flag reads False and our
    connector is what says it was asked for.
    Paged exports: vLLM's own block prefix cache, with our wait connector (prefix_wait.py) so
    that concurrent requests do not compute a shared prefix twice.
    Returns how it was decided, for the start-up log."""
    from .connector import POOL_BLOCKS, PrefixCopyConnector, is_platform_connector
    from .prefix_wait import PrefixWaitConnector

    cache = vllm_config.cache_config
    ours = is_platform_connector(vllm_config.kv_transfer_config)
    policy = ExportCapabilities.of(export, vllm_config.model_config.hf_config).kv.prefix_cache
    if policy is PrefixCache.SHARED:
        if not cache.enable_prefix_caching:
            if ours:
                vllm_config.kv_transfer_config = None
            return "off (--no-enable-prefix-caching)"
        _use_connector(vllm_config, PrefixWaitConnector)
        return (
            "on (vLLM's prefix cache shares the export's KV blocks; --no-enable-prefix-caching turns it off)"
        )
    wanted = cache.enable_prefix_caching or ours
    cache.enable_prefix_caching = False
    unsupported = ExportCapabilities.of(export, vllm_config.model_config.hf_config).kv.prefix_cache_refusal
    if not wanted or unsupported:
        if ours:
            vllm_config.kv_transfer_config = None
        return "off (--no-enable-prefix-caching)" if not wanted else f"off: {unsupported}"
    # one KV group, and no hybrid cache manager on this platform (support_hybrid_kv_cache)
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = True
    _use_connector(vllm_config, PrefixCopyConnector, {POOL_BLOCKS: KVPool.of(export).num_blocks})
    return (
        "on (copies cached prefixes between whole-sequence blocks; --no-enable-prefix-caching turns it off)"
    )


def _use_connector(vllm_config, connector: type, extra: dict | None = None) -> None:
    """Name one of our scheduler-side connectors in vLLM's KV-transfer config, with what it
    reads of the export (`extra`); one already set (the front end's call) is kept, given `extra`."""
    from vllm.config import KVTransferConfig

    current = vllm_config.kv_transfer_config
    if current is not None and current.kv_connector_module_path == connector.__module__:
        current.kv_connector_extra_config.update(extra or {})
        return
    vllm_config.kv_transfer_config = KVTransferConfig(
        kv_connector=connector.__name__,
        kv_connector_module_path=connector.__module__,
        kv_role="kv_both",
        kv_connector_extra_config=dict(extra or {}),
    )


def _describe(config: NeuronConfig) -> str:
    kind = f"chunked C={config.prefill_chunk_size}" if config.chunked else "standard"
    kv = f"KV {KVPool.of(config).num_blocks} blocks of {KVPool.of(config).block_size}"
    return f"{kind}, B={config.batch_size}, S={config.sequence_length}, {kv}, backend={config.backend}"
