"""The Neuron SDK releases the neuron backend runs on, the compiler flags each needs, and the
stack it cannot run on (SDK 2.32's own). Pure data and checks: nothing here imports the SDK.

Package sets are AWS's release manifests (aws-neuron/aws-neuron-sdk
`src/helperscripts/n2-manifest.json`, release notes) and vLLM pairings (vllm-project/vllm-neuron
`requirements/core.txt`, the NxD Inference vLLM user guide's "Versioning"). pyproject's
`neuron` extra must admit every XLA set and refuse SDK 2.32's own (tests/test_sdk_sets.py).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import Version


@dataclass(frozen=True)
class SdkSet:
    sdk: str
    packages: tuple[tuple[str, str], ...]  # (distribution, version) as the SDK installs them
    status: str  # what is known of this package running on it

    def versions(self) -> dict[str, str]:
        return dict(self.packages)


_XLA_COMMON = (("torch", "2.9.1"), ("vllm", "0.16.0"), ("transformers", "4.57.6"))
_MIRRORED = "the open stack mirrored by CI (make test-sdk); NxD 0.18 source driven to its trace"
_UNRUN = "the same open stack as 2.29, mirrored by CI; {} not run here (no public source / no host)"


def _xla_set(sdk: str, torch_neuronx: str, neuronx_cc: str, nxd: str, status: str) -> SdkSet:
    own = (("torch-neuronx", torch_neuronx), ("neuronx-cc", neuronx_cc), ("neuronx-distributed", nxd))
    return SdkSet(sdk, _XLA_COMMON + own, status)


XLA_SDK_SETS = (
    _xla_set("2.29.0", "2.9.0.2.13.24727", "2.24.5133.0", "0.18.27753", _MIRRORED),
    _xla_set("2.29.1", "2.9.0.2.13.26312", "2.24.8799.0", "0.18.27753", _MIRRORED),
    _xla_set(
        "2.30", "2.9.0.2.14.27725", "2.25.3371.0", "0.19.28093", _UNRUN.format("NxD 0.19, neuronx-cc 2.25")
    ),
    _xla_set(
        "2.31", "2.9.0.2.15.32035", "2.26.6360.0", "0.19.28492", _UNRUN.format("NxD 0.19, neuronx-cc 2.26")
    ),
    # 2.32 ships no torch-neuronx or NxD; its setup guide (setup/pytorch/manual.rst) still
    # pip-installs torch-neuronx 2.9.0.2.15.32035 with neuronx-cc 2.27.5334.0 ("XLA support ended
    # with 2.31"): 2.31's set with that compiler, in a fresh virtual environment.
    _xla_set(
        "2.32 (XLA venv)", "2.9.0.2.15.32035", "2.27.5334.0", "0.19.28492", _UNRUN.format("neuronx-cc 2.27")
    ),
)
# SDK 2.32's own stack: vllm-neuron's models through torch.compile and libtorch-neuronx-lite.
SDK_232_NATIVE = SdkSet(
    "2.32",
    (("torch", "2.11.0"), ("vllm", "0.24.0"), ("transformers", "5.5.0"), ("vllm-neuron", "0.24.0")),
    "not supported: no torch-neuronx / neuronx-distributed to compile our graphs with",
)

# Distributions that only SDK 2.32's own stack brings (vllm-neuron 0.21 is its Trn2 beta).
SDK_232_MARKERS = {"libtorch-neuronx-lite": SpecifierSet(">=0"), "vllm-neuron": SpecifierSet(">=0.21")}


def sdk_232_stack() -> list[str]:
    """The distributions of SDK 2.32's own stack installed here ('name version'), if any."""
    found = []
    for name, specifier in SDK_232_MARKERS.items():
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        if Version(version) in specifier:
            found.append(f"{name} {version}")
    return found


def sdk_232_advice(found: list[str]) -> str:
    """What works on a host with SDK 2.32's own stack and no torch-neuronx."""
    xla = XLA_SDK_SETS[-1].versions()
    return (
        f"this host has Neuron SDK 2.32's own stack ({', '.join(found)}), which ships no torch-neuronx "
        "or neuronx-distributed: the neuron backend compiles and serves with them. What works here: "
        "(1) a fresh virtual environment with the XLA set SDK 2.32's setup guide installs - "
        "python -m venv ~/onc && ~/onc/bin/pip install 'optimum-neuron-chunked[neuron]' "
        f"neuronx-cc=={xla['neuronx-cc']} --extra-index-url https://pip.repos.neuron.amazonaws.com - "
        "then export and serve from it; (2) vllm-neuron's own models (vllm serve MODEL, Trn2/Trn3), "
        "without chunked exports; (3) --backend cpu for a CPU export."
    )


def installed_compiler_version() -> str | None:
    """neuronx-cc's version here, None where it is not installed."""
    if importlib.util.find_spec("neuronxcc") is None:
        return None
    try:
        return importlib.metadata.version("neuronx-cc")
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class KnownCompilerFailure:
    option: str  # as it appears in the flags
    compilers: SpecifierSet  # neuronx-cc releases that fail with it
    instance_types: frozenset[str]
    issue: str


KNOWN_COMPILER_FAILURES = (
    # neuronx-cc 2.26 asserts with this tensorizer option on inf2; no fixed release is named,
    # so later releases keep it off there until one is.
    KnownCompilerFailure(
        "--enable-ccop-compute-overlap",
        SpecifierSet(">=2.26"),
        frozenset({"inf2"}),
        "https://github.com/aws-neuron/aws-neuron-sdk/issues/1365",
    ),
)


def options_to_drop(compiler: str | None, instance_type: str) -> list[KnownCompilerFailure]:
    """The known failures that apply to neuronx-cc `compiler` (None: unknown, assume the newest)
    compiling for `instance_type`."""
    return [
        f
        for f in KNOWN_COMPILER_FAILURES
        if instance_type in f.instance_types and (compiler is None or Version(compiler) in f.compilers)
    ]
