"""The Neuron SDK releases we install on: pyproject's `neuron` extra admits every XLA SDK's
package set without changing one of them, and refuses SDK 2.32's own stack; a host with that
stack and no torch-neuronx hears what works there, from the export and from `vllm serve`;
compiler options with a known failure stay off where they fail. Runs in both environments."""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

import pytest
from fixtures.export_models import checkpoint_path
from packaging.requirements import Requirement

from optimum_neuron_chunked.backends import BackendUnavailableError
from optimum_neuron_chunked.backends.neuron.sdk import SDK_232_NATIVE, XLA_SDK_SETS
from optimum_neuron_chunked.backends.neuron.target import TARGETS, compiler_args, missing_sdk_modules
from optimum_neuron_chunked.export.pipeline import export

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
needs_no_sdk = pytest.mark.skipif(not missing_sdk_modules(), reason="checks a host without torch-neuronx")


def neuron_extra() -> dict[str, Requirement]:
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    return {(r := Requirement(line)).name: r for line in extras["neuron"]}


@pytest.mark.parametrize("sdk", XLA_SDK_SETS, ids=lambda s: s.sdk)
def test_the_neuron_extra_admits_every_xla_sdk_as_installed(sdk):
    versions = sdk.versions()
    for name, requirement in neuron_extra().items():
        assert name in versions, f"SDK {sdk.sdk} lists no {name}"
        assert requirement.specifier.contains(versions[name], prereleases=True), (sdk.sdk, str(requirement))


def test_the_neuron_extra_refuses_sdk_232s_own_stack():
    extra, versions = neuron_extra(), SDK_232_NATIVE.versions()
    refused = [n for n in ("torch", "vllm", "transformers") if not extra[n].specifier.contains(versions[n])]
    assert refused == ["torch", "vllm", "transformers"]


def stand_in_distribution(site: Path, name: str, version: str) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


@needs_no_sdk
@pytest.mark.parametrize("stack", [("vllm-neuron", "0.24.0"), ("libtorch-neuronx-lite", "2.11.0.1")])
def test_sdk_232s_own_stack_hears_what_works_from_export_and_serve(stack, tmp_path, monkeypatch):
    stand_in_distribution(tmp_path / "site", *stack)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    says = rf"Neuron SDK 2.32's own stack \({stack[0]} {stack[1]}\).*fresh virtual environment.*neuronx-cc==2\.27"
    model, shape = str(checkpoint_path("llama")), dict(batch_size=1, sequence_length=64)
    for backend in (None, "neuron"):  # the default too: no silent cpu export on a Neuron host
        with pytest.raises(BackendUnavailableError, match=says):
            export(model, tmp_path / "out", backend=backend, **shape)
    assert not (tmp_path / "out").exists()
    if importlib.util.find_spec("vllm") is not None:
        from vllm.config import ParallelConfig

        from optimum_neuron_chunked.config import NeuronConfig
        from optimum_neuron_chunked.vllm.platform import check_serving_host

        with pytest.raises(BackendUnavailableError, match=says):
            check_serving_host(
                NeuronConfig(backend="neuron", instance_type="trn2", **shape), ParallelConfig()
            )


@needs_no_sdk
def test_an_older_vllm_neuron_is_not_sdk_232(tmp_path, monkeypatch):
    stand_in_distribution(tmp_path / "site", "vllm-neuron", "0.5.3")  # SDK 2.31's plugin
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    with pytest.raises(BackendUnavailableError, match=r"needs the Neuron SDK \(torch_neuronx"):
        export(
            str(checkpoint_path("llama")),
            tmp_path / "out",
            backend="neuron",
            batch_size=1,
            sequence_length=64,
        )


@pytest.mark.parametrize(
    "instance_type, compiler, overlap",
    [
        ("inf2", "2.24.8799.0", True),
        ("inf2", "2.25.3371.0", True),
        ("inf2", "2.26.6360.0", False),  # aws-neuron-sdk#1365
        ("inf2", "2.27.5334.0", False),  # no fixed release named yet
        ("inf2", None, False),  # release unknown: as the newest
        ("trn1", "2.26.6360.0", True),
        ("trn2", "2.27.5334.0", True),
    ],
)
def test_the_ccop_overlap_option_stays_off_where_it_fails(instance_type, compiler, overlap):
    args = compiler_args(TARGETS[instance_type], compiler)
    assert ("--enable-ccop-compute-overlap" in args) == overlap
    assert (
        "--cc-pipeline-tiling-factor=2 --vectorize-strided-dma" in args and "--model-type=transformer" in args
    )
