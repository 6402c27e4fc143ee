"""What the neuron backend needs from its host: the SDK, a device, the compile target and
the cores a tensor-parallel model runs on. Pure functions, testable anywhere."""

from __future__ import annotations

import glob
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from ..base import BackendUnavailableError
from .sdk import options_to_drop, sdk_232_advice, sdk_232_stack

SDK_MODULES = ("torch_neuronx", "neuronx_distributed")
VISIBLE_CORES = "NEURON_RT_VISIBLE_CORES"  # the Neuron runtime's choice of cores for a process
SDK_HINT = (
    "pip install 'optimum-neuron-chunked[neuron]' --extra-index-url https://pip.repos.neuron.amazonaws.com"
)


@dataclass(frozen=True)
class NeuronTarget:
    instance_type: str
    compiler_target: str  # neuronx-cc --target
    logical_nc_config: int  # physical NeuronCores per logical core (--lnc)
    cores_per_device: int  # logical NeuronCores per /dev/neuronN
    neuron_core: int  # NeuronCore generation: 2 runs no NKI kernel of SDK 2.29+ (attention_choice.py)


# inf2 and trn1 share NeuronCore-v2 (compiled for trn1, as optimum-neuron does); trn2 runs
# NeuronCore-v3 grouped two by two into logical cores.
TARGETS = {
    "trn1": NeuronTarget("trn1", "trn1", 1, 2, 2),
    "inf2": NeuronTarget("inf2", "trn1", 1, 2, 2),
    "trn2": NeuronTarget("trn2", "trn2", 2, 4, 3),
}


# neuronx-cc flags for a transformer decoder (every graph of the bundle); the tensorizer's
# own options go inside --tensorizer-options.
COMPILER_FLAGS = ("--auto-cast=none", "--model-type=transformer", "--enable-saturate-infinity", "-O2")
TENSORIZER_OPTIONS = (
    "--enable-ccop-compute-overlap",
    "--cc-pipeline-tiling-factor=2",
    "--vectorize-strided-dma",
)


def compiler_args(target: NeuronTarget, compiler: str | None = None) -> str:
    """The flags for `target` with neuronx-cc release `compiler` (None: unknown), less every
    option a known failure of that release on that target rules out (sdk.KNOWN_COMPILER_FAILURES)."""
    dropped = {f.option for f in options_to_drop(compiler, target.instance_type)}
    tensorizer = " ".join(o for o in TENSORIZER_OPTIONS if o not in dropped)
    flags = [f for f in COMPILER_FLAGS if f not in dropped]
    return " ".join(
        [*flags, f"--tensorizer-options='{tensorizer}'", f"--lnc={target.logical_nc_config}"]
        + [f"--target={target.compiler_target}"]
    )


def missing_sdk_modules() -> list[str]:
    return [m for m in SDK_MODULES if importlib.util.find_spec(m) is None]


def require_neuron_sdk() -> None:
    missing = missing_sdk_modules()
    if not missing:
        return
    found = sdk_232_stack()
    if found:
        raise BackendUnavailableError(sdk_232_advice(found))
    raise BackendUnavailableError(
        f"the neuron backend needs the Neuron SDK ({', '.join(missing)} not importable). On a "
        f"Trainium/Inferentia host: {SDK_HINT}; on this host use --backend cpu or eager."
    )


def has_neuron_device() -> bool:
    return bool(glob.glob("/dev/neuron*"))


def require_neuron_device() -> None:
    if not has_neuron_device():
        raise BackendUnavailableError(
            "this export was compiled for the neuron backend, and this host has no Neuron device "
            "(/dev/neuron*): run it on a trn1 / inf2 / trn2 instance, or re-export with --backend cpu."
        )


def instance_type_of(product_name: str) -> str | None:
    """'trn1.32xlarge' -> 'trn1' (EC2 writes the instance type into the DMI product name)."""
    family = product_name.strip().split(".")[0]
    family = "trn1" if family == "trn1n" else family
    return family if family in TARGETS else None


def host_instance_type() -> str | None:
    try:
        return instance_type_of(Path("/sys/devices/virtual/dmi/id/product_name").read_text())
    except OSError:
        return None


def resolve_instance_type(requested: str | None) -> str:
    """The --instance_type given, else this host's; a host that is not one must be told."""
    if requested:
        if requested not in TARGETS:
            raise BackendUnavailableError(
                f"unknown --instance_type {requested!r}: choose one of {', '.join(TARGETS)}."
            )
        return requested
    detected = host_instance_type()
    if detected is None:
        raise BackendUnavailableError(
            "this host is not a Trainium/Inferentia instance: pass --instance_type "
            f"{'|'.join(TARGETS)} to compile for one."
        )
    return detected


def parse_visible_cores(value: str) -> list[int]:
    """NEURON_RT_VISIBLE_CORES syntax: '0-3', '4', '0,2,5-6'."""
    cores = []
    for part in value.split(","):
        part = part.strip()
        if "-" in part:
            first, last = part.split("-")
            cores.extend(range(int(first), int(last) + 1))
        elif part:
            cores.append(int(part))
    return cores


def visible_cores_env(
    tp_degree: int, current: str | None, available: int, dp_rank: int = 0, dp_size: int = 1
) -> str:
    """The NEURON_RT_VISIBLE_CORES of data-parallel rank `dp_rank` (of `dp_size` on this host)
    of a tp_degree model: rank r takes cores [r*tp, (r+1)*tp) of the user's choice if given,
    else of the host."""
    need = tp_degree * dp_size
    ranks = f" x {dp_size} data-parallel ranks" if dp_size > 1 else ""
    if current:
        chosen = parse_visible_cores(current)
        if len(chosen) < need:
            raise BackendUnavailableError(
                f"NEURON_RT_VISIBLE_CORES={current} gives {len(chosen)} NeuronCores, the export needs "
                f"tp_degree={tp_degree}{ranks}: widen it (e.g. 0-{need - 1}) or re-export with a smaller "
                "--tensor_parallel_size."
            )
        if dp_size == 1:
            return current
        return ",".join(map(str, chosen[dp_rank * tp_degree : (dp_rank + 1) * tp_degree]))
    if available < need:
        raise BackendUnavailableError(
            f"this host has {available} NeuronCores, the export needs tp_degree={tp_degree}{ranks}: "
            "re-export with a smaller --tensor_parallel_size, serve fewer ranks, or use a larger instance."
        )
    first = dp_rank * tp_degree
    return f"{first}-{first + tp_degree - 1}"


def host_core_count(target: NeuronTarget) -> int:
    return len(glob.glob("/dev/neuron[0-9]*")) * target.cores_per_device
