"""The exporter, its artifact folder and the loader's refusals."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.export_models import CHUNKED_SHAPE, REPO, STD_SHAPE, checkpoint_path
from helpers import export_params

from optimum_neuron_chunked import InvalidExportError, NeuronModelForCausalLM
from optimum_neuron_chunked.config import CONFIG_NAME

BIN = Path(sys.executable).parent


def cli(*args: str, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "optimum-cli"), "export", "neuron", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=600,
    )


def cli_here(capsys, *args: str) -> tuple[int, str]:
    """`python -m optimum_neuron_chunked.export ARGS` in this process (`optimum-cli export neuron`
    parses and runs the same: test_optimum_cli_exports_eager): (exit code, what it told stderr)."""
    from optimum_neuron_chunked.export.cli import main

    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as e:  # argparse's refusals
        code = e.code
    return code, capsys.readouterr().err


def files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("export_dir", export_params([f"llama-{CHUNKED_SHAPE}-cpu"]), indirect=True)
def test_chunked_artifact_has_cp_and_tg_graphs_and_no_ce(export_dir):
    found = files(export_dir)
    assert {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        CONFIG_NAME,
        "model.safetensors",
    } <= found
    graphs = sorted(f for f in found if f.startswith("graphs/"))
    assert graphs == [
        "graphs/copy.pt2",
        "graphs/cp_w128.pt2",
        "graphs/cp_w64.pt2",
        "graphs/tg_w128.pt2",
        "graphs/tg_w64.pt2",
    ]
    assert json.loads((export_dir / CONFIG_NAME).read_text())["prefill_chunk_size"] == 32


@pytest.mark.parametrize("export_dir", export_params([f"llama-{STD_SHAPE}-cpu"]), indirect=True)
def test_standard_artifact_has_ce_and_tg_graphs(export_dir):
    graphs = sorted(f for f in files(export_dir) if f.startswith("graphs/"))
    assert graphs == ["graphs/ce_w128.pt2", "graphs/ce_w64.pt2", "graphs/tg_w128.pt2", "graphs/tg_w64.pt2"]


@pytest.mark.parametrize("export_dir", export_params([f"llama-{CHUNKED_SHAPE}-cpu"]), indirect=True)
def test_fresh_process_loads_without_compiling(export_dir, hf_reference):
    """A new process loads the AOTI packages (no trace, no compile) and generates HF's tokens."""
    script = (
        "import sys, time, torch\n"
        "import torch._inductor, torch.export\n"
        "def forbidden(*a, **k): raise AssertionError('compiled at load time')\n"
        "torch.export.export = forbidden; torch._inductor.aoti_compile_and_package = forbidden\n"
        "from optimum_neuron_chunked import NeuronModelForCausalLM\n"
        "m = NeuronModelForCausalLM.from_pretrained(sys.argv[1])\n"
        "ids = torch.arange(4, 4 + 45)[None]\n"
        "print(m.generate(ids, max_new_tokens=8, do_sample=False)[0].tolist())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(export_dir)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    import torch

    ids = torch.arange(4, 4 + 45)[None]
    expected = hf_reference("llama").generate(ids, max_new_tokens=8, do_sample=False)[0].tolist()
    assert json.loads(done.stdout.strip().splitlines()[-1]) == expected


def test_optimum_cli_exports_eager(tmp_path):
    out = tmp_path / "out"
    shape = [
        "--batch_size",
        "2",
        "--sequence_length",
        "64",
        "--prefill-chunk-size",
        "16",
        "--backend",
        "eager",
    ]
    done = cli("--model", str(checkpoint_path("qwen2")), *shape, str(out))
    assert done.returncode == 0, done.stderr
    model = NeuronModelForCausalLM.from_pretrained(out)
    assert model.neuron_config.prefill_chunk_size == 16 and model.neuron_config.batch_size == 2
    # a refusal exits 2 with the reason, no traceback (test_unwritable_and_non_empty_outputs_are_refused)
    again = cli("--model", str(checkpoint_path("qwen2")), *shape, str(out))
    assert again.returncode == 2 and "--overwrite" in again.stderr and "Traceback" not in again.stderr


def test_python_m_export_is_the_same_command(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "optimum_neuron_chunked.export", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert done.returncode == 0 and "--prefill-chunk-size" in done.stdout


def test_cli_and_export_take_the_config_options_with_the_config_defaults(tmp_path):
    import argparse

    from optimum_neuron_chunked.config import EXPORT_OPTIONS
    from optimum_neuron_chunked.export.cli import add_export_arguments
    from optimum_neuron_chunked.export.pipeline import export

    parser = argparse.ArgumentParser()
    add_export_arguments(parser)
    args = vars(parser.parse_args(["--model", "m", "--batch_size", "2", "--sequence_length", "64", "out"]))
    options = {o.name: o for o in EXPORT_OPTIONS}
    assert set(args) == {"model", "output", "overwrite"} | set(options)
    for name, option in options.items():
        if option.default is not dataclasses.MISSING:
            assert args[name] == (None if option.metadata["resolved"] else option.default), name
    # export(): its own arguments, then the same options, checked before any work
    own = {"model", "output", "overwrite", "console", "weights"}
    assert set(inspect.signature(export).parameters) == own | {"options"}
    with pytest.raises(TypeError, match=re.escape("'prompt_logits' (did you mean 'prompt_logprobs'?)")):
        export("m", tmp_path / "out", batch_size=2, sequence_length=64, prompt_logits=True)
    with pytest.raises(TypeError, match="missing the required options sequence_length"):
        export("m", tmp_path / "out", batch_size=2)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "/nonexistent/model"], "cannot load a model config"),
        (["--prefill-chunk-size", "512"], "--prefill-chunk-size <= 64"),
        (["--batch_size", "0"], "--batch_size 1 or more"),
        (["--sequence_length", "100000"], "max_position_embeddings"),
    ],
)
def test_cli_errors_name_the_fix_and_leave_nothing(tmp_path, capsys, args, message):
    base = {
        "--model": str(checkpoint_path("llama")),
        "--batch_size": "2",
        "--sequence_length": "64",
        "--backend": "eager",
    }
    for i in range(0, len(args), 2):
        base[args[i]] = args[i + 1]
    code, stderr = cli_here(capsys, *[x for kv in base.items() for x in kv], str(tmp_path / "out"))
    assert code == 2 and message in " ".join(stderr.split()), stderr
    assert list(tmp_path.iterdir()) == []


def fake_neuron_sdk(folder: Path) -> Path:
    """Importable, empty torch_neuronx and neuronx_distributed packages."""
    for name in ("torch_neuronx", "neuronx_distributed"):
        (folder / name).mkdir(parents=True)
        (folder / name / "__init__.py").write_text("")
    return folder


@pytest.mark.parametrize("sdk", ["absent", "importable"])
def test_the_backend_defaults_to_neuron_where_the_sdk_imports(tmp_path, monkeypatch, sdk):
    from optimum_neuron_chunked.backends import default_backend
    from optimum_neuron_chunked.backends.neuron import require_neuron_sdk

    if sdk == "importable":
        monkeypatch.syspath_prepend(str(fake_neuron_sdk(tmp_path / "sdk")))
    else:
        with pytest.raises(Exception, match="Neuron SDK"):
            require_neuron_sdk()  # a host with the SDK cannot check the other branch
    backend, why = default_backend()
    assert backend == ("neuron" if sdk == "importable" else "cpu")
    assert why.startswith(f"the Neuron SDK is {'importable' if sdk == 'importable' else 'not importable'}")


@pytest.mark.parametrize("sdk", ["absent", "importable"])
def test_the_cli_says_which_backend_it_chose_and_how_to_pick_another(tmp_path, monkeypatch, capsys, sdk):
    if sdk == "importable":
        monkeypatch.syspath_prepend(str(fake_neuron_sdk(tmp_path / "sdk")))
    base = ["--model", str(checkpoint_path("llama")), "--sequence_length", "64", "--batch_size", "0"]
    code, stderr = cli_here(capsys, *base, str(tmp_path / "out"))  # no --backend; a batch size refused
    said = " ".join(stderr.split())
    chosen = "neuron (the Neuron SDK is importable:" if sdk == "importable" else "cpu (the Neuron SDK is not"
    assert f"backend: {chosen}" in said and "choose with --backend cpu|eager|neuron" in said, said
    assert code == 2


def test_unsupported_architecture_is_refused_by_name(tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100)).save_pretrained(
        tmp_path / "gpt2"
    )
    shape = ["--batch_size", "1", "--sequence_length", "64", "--backend", "eager"]
    code, stderr = cli_here(capsys, "--model", str(tmp_path / "gpt2"), *shape, str(tmp_path / "out"))
    assert code == 2 and "GPT2LMHeadModel" in stderr and "LlamaForCausalLM" in stderr
    assert not (tmp_path / "out").exists()


def test_unwritable_and_non_empty_outputs_are_refused(tmp_path, capsys):
    model = str(checkpoint_path("llama"))
    common = ["--model", model, "--batch_size", "1", "--sequence_length", "64", "--backend", "eager"]
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    code, stderr = cli_here(capsys, *common, str(tmp_path / "full"))
    assert code == 2 and "--overwrite" in stderr
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    (tmp_path / "a-file").write_text("x")
    code, stderr = cli_here(capsys, *common, str(tmp_path / "a-file" / "out"))
    assert code == 2 and "writable OUT" in " ".join(stderr.split()), stderr
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        code, stderr = cli_here(capsys, *common, str(locked / "out"))
        assert code == 2 and "writable" in stderr


def test_failed_compile_leaves_no_folder(tmp_path, monkeypatch):
    from optimum_neuron_chunked.backends.eager import EagerBackend
    from optimum_neuron_chunked.export import pipeline as exporter

    def broken(self, *args, **kwargs):
        raise RuntimeError("compiler crashed")

    monkeypatch.setattr(EagerBackend, "compile", broken)
    with pytest.raises(RuntimeError, match="compiler crashed"):
        exporter.export(
            str(checkpoint_path("llama")), tmp_path / "out", batch_size=1, sequence_length=64, backend="eager"
        )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("export_dir", export_params([f"llama-{CHUNKED_SHAPE}-cpu"]), indirect=True)
def test_cpu_graphs_compiled_for_another_isa_are_refused_with_the_fix(export_dir, tmp_path):
    """The export records the vector ISA its graphs were built for; a host without it gets an
    error naming the fix, not an illegal instruction in the middle of a graph call."""
    from optimum_neuron_chunked.backends.base import BackendUnavailableError
    from optimum_neuron_chunked.backends.cpu.host import host_cpu_capability

    copy = tmp_path / "copy"
    shutil.copytree(export_dir, copy)
    config = json.loads((copy / CONFIG_NAME).read_text())
    assert config["cpu_isa"] == host_cpu_capability()
    config["cpu_isa"] = "SVE256"  # no x86 host has it
    (copy / CONFIG_NAME).write_text(json.dumps(config))
    with pytest.raises(BackendUnavailableError, match="SVE256 .* export the model again here"):
        NeuronModelForCausalLM.from_pretrained(copy)


@pytest.mark.parametrize(
    "built, host, runs",
    [("AVX512", "AVX2", False), ("AVX2", "AVX512", True), ("AVX2", "AVX2", True), ("", "AVX2", True),
     ("AVX2", "DEFAULT", False), ("SVE256", "AVX512", False)],
)  # fmt: skip
def test_cpu_graphs_run_on_hosts_with_their_isa_or_a_wider_one(built, host, runs):
    from optimum_neuron_chunked.backends.base import BackendUnavailableError
    from optimum_neuron_chunked.backends.cpu import check_runs_here
    from optimum_neuron_chunked.config import NeuronConfig

    config = NeuronConfig(batch_size=1, sequence_length=64, cpu_isa=built)
    if runs:
        check_runs_here(config, host)
    else:
        with pytest.raises(BackendUnavailableError, match=f"with {built} .* this host has {host}"):
            check_runs_here(config, host)


@pytest.fixture
def eager_export(tmp_path):
    from optimum_neuron_chunked.export.pipeline import export

    return export(
        str(checkpoint_path("llama")),
        tmp_path / "out",
        batch_size=1,
        sequence_length=64,
        prefill_chunk_size=16,
        backend="eager",
    )


def test_loader_refuses_incomplete_export(eager_export):
    (eager_export / "model.safetensors").unlink()
    with pytest.raises(InvalidExportError, match="incomplete export.*model.safetensors"):
        NeuronModelForCausalLM.from_pretrained(eager_export)


def test_loader_refuses_a_folder_that_is_no_export(tmp_path):
    with pytest.raises(InvalidExportError, match="not an export"):
        NeuronModelForCausalLM.from_pretrained(checkpoint_path("llama"))
    with pytest.raises(InvalidExportError, match="not a folder"):
        NeuronModelForCausalLM.from_pretrained(tmp_path / "missing")


def test_loader_refuses_other_version_and_other_backend(eager_export):
    with pytest.raises(InvalidExportError, match="--backend cpu"):
        NeuronModelForCausalLM.from_pretrained(eager_export, backend="cpu")
    config = json.loads((eager_export / CONFIG_NAME).read_text())
    config["package_version"] = "0.0.1"
    (eager_export / CONFIG_NAME).write_text(json.dumps(config))
    with pytest.raises(
        InvalidExportError, match=r"export it again, .*: optimum-cli export neuron --model M "
    ):
        NeuronModelForCausalLM.from_pretrained(eager_export)


def test_cpu_export_missing_a_graph_is_refused(tmp_path):
    from fixtures.export_models import EXPORTS, export_model

    source = export_model(EXPORTS[f"llama-{CHUNKED_SHAPE}-eager"])
    copy = tmp_path / "copy"
    shutil.copytree(source, copy)
    config = json.loads((copy / CONFIG_NAME).read_text())
    config["backend"] = "cpu"
    (copy / CONFIG_NAME).write_text(json.dumps(config))
    with pytest.raises(InvalidExportError, match="graphs/cp_w64.pt2"):
        NeuronModelForCausalLM.from_pretrained(copy)


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["--tensor_parallel_size", "2", "--instance_type", "trn2", "--prefill-chunk-size", "16"],
        ["--tensor_parallel_size", "2", "--instance_type", "inf2"],
    ],
    ids=["defaults", "tp2-trn2-chunked", "tp2-inf2-std"],
)
def test_neuron_backend_without_sdk_says_so(tmp_path, capsys, extra):
    shape = ["--batch_size", "1", "--sequence_length", "64", "--backend", "neuron", *extra]
    code, stderr = cli_here(capsys, "--model", str(checkpoint_path("llama")), *shape, str(tmp_path / "out"))
    assert code == 2 and "Neuron SDK" in stderr
    assert "optimum-neuron-chunked[neuron]" in " ".join(stderr.split())
    assert list(tmp_path.iterdir()) == []


def test_an_instance_type_without_the_neuron_backend_is_refused_by_name(tmp_path):
    from optimum_neuron_chunked.config import NeuronConfigError
    from optimum_neuron_chunked.export.pipeline import export

    with pytest.raises(NeuronConfigError, match="--instance_type"):
        export(
            str(checkpoint_path("llama")),
            tmp_path / "out",
            batch_size=1,
            sequence_length=64,
            backend="eager",
            instance_type="trn1",
        )
    assert list(tmp_path.iterdir()) == []


def test_export_without_on_device_sampling_samples_on_the_host(tmp_path, hf_reference):
    import torch

    from optimum_neuron_chunked.export.pipeline import export

    out = export(
        str(checkpoint_path("llama")),
        tmp_path / "out",
        batch_size=2,
        sequence_length=64,
        prefill_chunk_size=16,
        backend="eager",
        on_device_sampling=False,
    )
    model = NeuronModelForCausalLM.from_pretrained(out)
    ids = torch.arange(4, 4 + 21)[None]
    expected = hf_reference("llama").generate(ids, max_new_tokens=10, do_sample=False)
    assert model.generate(ids, max_new_tokens=10, do_sample=False).tolist() == expected.tolist()
    seeded = [
        model.generate(ids, max_new_tokens=10, do_sample=True, generator=torch.Generator().manual_seed(5))
        for _ in range(2)
    ]
    assert seeded[0].tolist() == seeded[1].tolist()
    # on-device sampling draws the same tokens from the same host random numbers
    ods = NeuronModelForCausalLM.from_pretrained(
        export(
            str(checkpoint_path("llama")),
            tmp_path / "ods",
            batch_size=2,
            sequence_length=64,
            prefill_chunk_size=16,
            backend="eager",
        )
    )
    on_device = ods.generate(
        ids, max_new_tokens=10, do_sample=True, generator=torch.Generator().manual_seed(5)
    )
    assert on_device.tolist() == seeded[0].tolist()
