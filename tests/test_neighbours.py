"""Beside the other Neuron packages' registrations: vLLM starts, `VLLM_PLUGINS=neuron_chunked`
selects this platform, and `optimum-cli export neuron` reaches this package's export or the
neighbour's. The neighbours are stand-ins with the same registrations (tests/fixtures/neighbours:
a dist-info with entry_points.txt plus modules), put on the PYTHONPATH of subprocesses only."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from fixtures.export_models import checkpoint_path

from optimum_neuron_chunked.export.cli import add_export_arguments

FIXTURES = Path(__file__).parent / "fixtures" / "neighbours"
BIN = Path(sys.executable).parent
OURS = "NeuronChunkedPlatform"
OPTIMUM_NEURON = "OptimumNeuronPlatform"  # the stand-ins' platform classes
VLLM_NEURON = "NeuronPlatform"
FIX = "VLLM_PLUGINS=neuron_chunked"
ORDERS = ["ours-imported-first", "theirs-imported-first"]
# Variables that would change what these subprocesses see (VLLM_TARGET_DEVICE=cpu skips plugins in 0.32).
CLEARED = ("PYTHONPATH", "PYTHONHASHSEED", "VLLM_PLUGINS", "VLLM_TARGET_DEVICE", "STANDIN_NEURON_DEVICE")


def installed_neighbours() -> list[str]:
    """Platform plugins and optimum-cli registrations this environment has itself, beside ours."""
    plugins = {ep.name for ep in entry_points(group="vllm.platform_plugins")} - {"neuron_chunked"}
    spec = importlib.util.find_spec("optimum.commands.register")
    folders = [Path(p) for p in (spec.submodule_search_locations if spec else ()) if Path(p).is_dir()]
    modules = {f.stem for folder in folders for f in folder.glob("*.py")} - {"register_neuron_chunked"}
    return sorted(plugins | modules)


# The stand-ins are the only neighbours these tests account for.
pytestmark = pytest.mark.skipif(
    bool(installed_neighbours()), reason=f"installed here: {installed_neighbours()}"
)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """Copies of the stand-ins, plus an installed, empty torch-neuronx (optimum-neuron registers its
    `export neuron` only where torch_neuronx imports and has a version)."""
    root = tmp_path_factory.mktemp("neighbours")
    for name in ("optimum-neuron", "vllm-neuron"):
        shutil.copytree(FIXTURES / name, root / name)
    for folder in ("torch_neuronx", "torch_neuronx-2.9.0.dist-info"):
        (root / "sdk" / folder).mkdir(parents=True)
    (root / "sdk" / "torch_neuronx" / "__init__.py").write_text("")
    (root / "sdk" / "torch_neuronx-2.9.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: torch-neuronx\nVersion: 2.9.0\n"
    )
    return root


def environment(*paths: Path, **variables: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(str(p) for p in paths)
    return env | variables


def run(command: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)


# vLLM: `current_platform` runs vllm/platforms/__init__.py resolve_current_platform_cls_qualname,
# where two active plugins fail, at every entry point (`vllm serve`, `vllm.LLM`, the engine core).
RESOLVE = "from vllm.platforms import resolve_current_platform_cls_qualname as r; print('platform:', r())"
CURRENT = "from vllm.platforms import current_platform as p; print('platform:', type(p).__qualname__)"


def current_platform(env: dict[str, str], cwd: Path, script: str = CURRENT) -> tuple[str, str]:
    """The name of the platform class vLLM picks, and the log. RESOLVE stops before importing the
    class (ours imports torch: seconds per test)."""
    done = run([sys.executable, "-c", script], env, cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    # vLLM logs to stdout once its logging is configured (0.16 at import), else Python prints to stderr
    return done.stdout.split("platform:")[-1].strip().rsplit(".", 1)[-1], done.stdout + done.stderr


def test_alone_our_platform_activates(site):
    platform, log = current_platform(environment(), site, RESOLVE)
    assert platform == OURS and FIX not in log


@pytest.mark.parametrize(
    "neighbour, theirs", [("optimum-neuron", OPTIMUM_NEURON), ("vllm-neuron", VLLM_NEURON)]
)
def test_beside_an_active_neighbour_vllm_starts_on_theirs_and_says_how_to_select_ours(
    site, neighbour, theirs
):
    """Before: `RuntimeError: Only one platform plugin can be activated` at every vLLM entry point."""
    platform, log = current_platform(environment(site / neighbour, STANDIN_NEURON_DEVICE="1"), site)
    assert platform == theirs
    assert log.count(FIX) == 1, log[-3000:]


def test_vllm_plugins_selects_ours_beside_both_neighbours_active(site):
    neighbours = ("optimum-neuron", "vllm-neuron")
    env = environment(
        *(site / n for n in neighbours), VLLM_PLUGINS="neuron_chunked", STANDIN_NEURON_DEVICE="1"
    )
    platform, log = current_platform(env, site, RESOLVE)
    assert platform == OURS and FIX not in log


def test_beside_an_inactive_neighbour_ours_still_stays_out(site):
    """Decided from the installed entry points, not from what the others' register() answers:
    vllm-neuron without a device is inactive, and vLLM falls back to its own platform."""
    platform, log = current_platform(environment(site / "vllm-neuron", STANDIN_NEURON_DEVICE="0"), site)
    assert platform not in (OURS, VLLM_NEURON) and FIX in log


# optimum-cli: optimum/commands/optimum_cli.py imports the registration modules in set() order of
# their folders, which PYTHONHASHSEED fixes: each order is tested.


def optimum_cli(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return run([str(BIN / "optimum-cli"), *args], env, cwd)


def import_order(site: Path, seed: int) -> str:
    trace = site / f"trace-{seed}"
    trace.unlink(missing_ok=True)
    env = environment(
        site / "optimum-neuron", site / "sdk", PYTHONHASHSEED=str(seed), STANDIN_TRACE=str(trace)
    )
    done = optimum_cli(env, site, "--help")
    assert done.returncode == 0, done.stderr[-3000:]
    return ORDERS[0] if trace.read_text().strip() == "ours_imported_first=True" else ORDERS[1]


@pytest.fixture(scope="module")
def seeds(site) -> dict[str, int]:
    """order -> a PYTHONHASHSEED that gives it."""
    found: dict[str, int] = {}
    for seed in range(32):
        found.setdefault(import_order(site, seed), seed)
        if len(found) == len(ORDERS):
            return found
    raise AssertionError(f"only {found} in 32 seeds: does optimum-cli still order folders by set()?")


def beside_optimum_neuron(site: Path, seeds: dict[str, int], order: str) -> dict[str, str]:
    assert import_order(site, seeds[order]) == order
    return environment(site / "optimum-neuron", site / "sdk", PYTHONHASHSEED=str(seeds[order]))


def test_export_neuron_alone_is_ours(site):
    done = optimum_cli(environment(), site, "export", "neuron", "--help")
    assert done.returncode == 0, done.stderr
    assert "--prefill-chunk-size" in done.stdout and "Two packages" not in done.stdout


@pytest.mark.parametrize("order", ORDERS)
def test_export_neuron_help_beside_optimum_neuron_shows_both(site, seeds, order):
    """Before: `argparse.ArgumentError: conflicting subparser: neuron` at every optimum-cli command."""
    done = optimum_cli(beside_optimum_neuron(site, seeds, order), site, "export", "neuron", "--help")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Two packages register `optimum-cli export neuron`" in done.stdout
    assert "--prefill-chunk-size" in done.stdout and "--auto_cast" in done.stdout


@pytest.mark.parametrize("order", ORDERS)
def test_our_options_make_our_export_beside_optimum_neuron(site, seeds, order, tmp_path):
    env = beside_optimum_neuron(site, seeds, order)
    model, out = str(checkpoint_path("llama")), tmp_path / "out"
    shape = ["--batch_size", "1", "--sequence_length", "64"]
    ours = ["--prefill-chunk-size", "16", "--backend", "eager"]
    done = optimum_cli(env, site, "export", "neuron", "--model", model, *shape, *ours, str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    config = json.loads((out / "neuron_config.json").read_text())
    assert config["prefill_chunk_size"] == 16 and config["batch_size"] == 1
    assert not (out / "optimum-neuron-standin.json").exists()


@pytest.mark.parametrize("order", ORDERS)
def test_other_command_lines_run_optimum_neurons_export(site, seeds, order, tmp_path):
    env = beside_optimum_neuron(site, seeds, order)
    out = tmp_path / "out"
    args = ["-m", "some/model", "--batch_size", "1", "--sequence_length", "64", "--instance_type", "trn1"]
    done = optimum_cli(env, site, "export", "neuron", *args, "--task", "text-generation", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((out / "optimum-neuron-standin.json").read_text())
    # optimum-neuron's run() re-reads sys.argv[3:] to call its exporter: unchanged.
    assert record == {
        "args_string": " ".join([*args, "--task", "text-generation", str(out)]),
        "model": "some/model",
        "batch_size": 1,
    }
    assert not (out / "neuron_config.json").exists()


def test_optimum_neurons_own_command_stays_reachable(site, seeds):
    done = optimum_cli(beside_optimum_neuron(site, seeds, ORDERS[0]), site, "neuron")
    assert done.returncode == 0 and "optimum-neuron stand-in: neuron command" in done.stdout, done.stderr


def test_without_torch_neuronx_optimum_neuron_adds_no_export_and_ours_is_plain(site):
    done = optimum_cli(environment(site / "optimum-neuron"), site, "export", "neuron", "--help")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--prefill-chunk-size" in done.stdout and "Two packages" not in done.stdout


# The routing rule itself, against a parser with optimum-neuron 0.4.5's options that ours shares.


@pytest.mark.parametrize(
    "args, ours",
    [
        (["--prefill-chunk-size", "16"], True),
        (["--prefill_chunk_size=16"], True),
        (["--backend", "eager"], True),
        (["--dtype", "bfloat16"], True),
        (["--batch-size", "1"], True),  # our spelling only
        (
            ["-m", "x", "--batch_size", "1", "--sequence_length", "64", "--torch_dtype", "bfloat16", "out"],
            False,
        ),
        (["--instance_type", "trn1", "--tensor_parallel_size", "2", "-h"], False),
        (["-m", "x", "out", "--", "--backend"], False),
    ],
)
def test_routing_goes_to_ours_only_with_an_option_they_lack(args, ours):
    from optimum.commands.register.register_neuron_chunked import our_only_options, routes_to_ours

    parser = argparse.ArgumentParser()
    add_export_arguments(parser)
    theirs = argparse.ArgumentParser()
    for flag in ("--model", "--batch_size", "--sequence_length", "--torch_dtype", "--instance_type"):
        theirs.add_argument(flag)
    theirs.add_argument("-m", dest="model")
    theirs.add_argument("--tensor_parallel_size")
    assert routes_to_ours(args, our_only_options(parser, theirs)) is ours
