"""vLLM platform plugin (entry point `neuron_chunked` in group `vllm.platform_plugins`).

vLLM calls every loaded platform plugin's `register()` and refuses to start when two out-of-tree
ones answer ("Only one platform plugin can be activated", vllm/platforms/__init__.py
`resolve_current_platform_cls_qualname`, 0.16.0 and 0.32); `VLLM_PLUGINS`, when set, is its
allow-list of the plugins it loads at all (vllm/plugins/__init__.py `load_plugins_by_group`).
Neuron hosts often carry another platform plugin: optimum-neuron's `optimum_neuron` (0.4.5,
always active) on Hugging Face's images, vllm-neuron's `neuron` (active where /dev/neuron*
exists) on AWS's. So this one activates:

- when `VLLM_PLUGINS` lists `neuron_chunked` (the user chose it; vLLM then loads no other
  platform plugin unless listed too),
- or, `VLLM_PLUGINS` unset, when no other platform plugin is installed.

Otherwise it stays out and says once per process how to select it (`VLLM_PLUGINS=neuron_chunked`),
so the neighbour keeps working as it does without this package. It decides from the installed
entry points, not by calling the others' `register()`: their detection code stays theirs to
run (it may warn or patch vLLM), and the answer is the same on every host. `VLLM_PLUGINS=`
(empty) deselects every plugin. Once active, the platform serves export folders only and refuses
anything else at start-up with a message.
"""

from __future__ import annotations

from importlib.metadata import entry_points

PLATFORM = "optimum_neuron_chunked.vllm.platform.NeuronChunkedPlatform"
ENTRY_POINT = "neuron_chunked"
GROUP = "vllm.platform_plugins"  # vllm/plugins/__init__.py PLATFORM_PLUGINS_GROUP


def other_platform_plugins() -> list[str]:
    """Names of the installed platform plugins other than this one."""
    return sorted({ep.name for ep in entry_points(group=GROUP)} - {ENTRY_POINT})


def register() -> str | None:
    from vllm import envs

    allowed = envs.VLLM_PLUGINS  # parsed as vLLM parses it (comma-split, None when unset)
    if allowed is not None:
        return PLATFORM if ENTRY_POINT in allowed else None
    others = other_platform_plugins()
    if not others:
        return PLATFORM
    from vllm.logger import init_logger

    # warning, not info: in 0.32 vLLM's log handlers may not be configured yet when the platform is
    # chosen (logger.py configures them lazily), and Python's fallback prints warnings only. "process"
    # scope: the default ("local" in 0.32) imports vllm.distributed.parallel_state for the rank while
    # vLLM is still choosing its platform.
    init_logger(f"vllm.{__name__}").warning_once(
        "optimum-neuron-chunked's platform plugin is not activated: other vLLM platform plugins are "
        "installed (%s). To serve an optimum-neuron-chunked export, select it with "
        "VLLM_PLUGINS=neuron_chunked; to silence this, name the plugin you use (e.g. VLLM_PLUGINS=%s).",
        ", ".join(others),
        others[0],
        scope="process",
    )
    return None
