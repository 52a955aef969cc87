# The two commands of the README: `make serve` and `make test`. Both set up everything from nothing
# (a Python 3.11 interpreter and the package registries), and are quick when already set up.

PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch (on this project's machines it lies on disk, found through pip's
# find-links). A GPU machine uses `make venv-gpu` instead (docs/gpu.md).
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.sglang_kda-installed
MODEL_DIR ?= models/tiny-kimi-linear
HOST ?= 127.0.0.1
PORT ?= 30000
PYTEST_ARGS ?=

.PHONY: venv venv-gpu serve test model bench-kernels gpu-kit lint clean libibverbs jemalloc

venv: $(STAMP)

$(STAMP): pyproject.toml requirements/runtime.txt requirements/test.txt requirements/constraints.txt
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found (set PYTHON=...)"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)" triton==3.8.0
	# sglang's own dependency list pins CUDA packages; its serving path's real needs are listed in
	# requirements/runtime.txt.
	$(BIN)/pip install -q --no-deps sglang==0.5.23
	$(BIN)/pip install -q -c requirements/constraints.txt -r requirements/runtime.txt -r requirements/test.txt
	$(BIN)/pip install -q --no-deps -e .
	$(BIN)/python -c "import sglang_kda, sglang, torch; print('sglang', sglang.__version__, 'torch', torch.__version__)"
	@$(MAKE) --no-print-directory libibverbs jemalloc
	touch $(STAMP)

# Mooncake's engine.so (requirements/test.txt, PD disaggregation) links libibverbs.so.1, Debian's
# libibverbs1. Installed with apt-get when missing and this runs as root; otherwise a note, and
# tests/server/test_pd.py skips naming the missing library.
libibverbs:
	@if $(BIN)/python -c "import mooncake.engine" 2>/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get install -y -q libibverbs1 >/dev/null 2>&1 || \
		{ apt-get update -q >/dev/null && apt-get install -y -q libibverbs1 >/dev/null; } || \
		echo "note: apt-get could not install libibverbs1; PD (mooncake) tests will skip"; \
	else echo "note: mooncake.engine does not import (libibverbs1 missing?); as root: apt-get install -y libibverbs1"; fi

# The CPU launcher preloads jemalloc (Debian's libjemalloc2) into SGLang's processes: under
# glibc's malloc the kda scheduler's memory kept rising with the checkpoint cache's churn
# (docs/cpu.md, "Memory"). Installed with apt-get when missing and this runs as root; otherwise
# a note, and the launcher runs on glibc's malloc and says so.
jemalloc:
	@if ls /usr/lib/*/libjemalloc.so.2 >/dev/null 2>&1 || [ -e /usr/lib64/libjemalloc.so.2 ] || [ -e /usr/local/lib/libjemalloc.so.2 ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get install -y -q libjemalloc2 >/dev/null 2>&1 || \
		{ apt-get update -q >/dev/null && apt-get install -y -q libjemalloc2 >/dev/null; } || \
		echo "note: apt-get could not install libjemalloc2; the CPU server runs on glibc's malloc"; \
	else echo "note: jemalloc missing; as root: apt-get install -y libjemalloc2 (the CPU server runs on glibc's malloc without it)"; fi

# GPU machines (not yet run: no GPU has been lent): SGLang 0.5.23 with its own CUDA dependency
# list (torch 2.14.1, sglang-kernel, flashinfer, ...), then this package without deps, so nothing
# here re-pins torch or Triton (requirements/gpu-constraints.txt keeps SGLang's torch).
venv-gpu:
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c requirements/gpu-constraints.txt sglang==0.5.23
	$(BIN)/pip install -q -c requirements/gpu-constraints.txt safetensors tokenizers pytest \
		requests hypothesis matplotlib sglang-router==0.3.2
	$(BIN)/pip install -q --no-deps -e .
	$(BIN)/python -c "import torch, sglang, sglang_kda; assert torch.cuda.is_available(); \
		print('sglang', sglang.__version__, 'torch', torch.__version__, 'cuda', torch.version.cuda)"
	touch $(STAMP)

model: venv
	$(BIN)/python -m sglang_kda.tiny_model $(MODEL_DIR)

serve: venv
	SGLANG_KDA_MODEL_DIR=$(MODEL_DIR) $(BIN)/python -m sglang_kda.launch_server --host $(HOST) --port $(PORT) $(ARGS)

test: venv
	$(BIN)/python -m pytest $(PYTEST_ARGS)

bench-kernels: venv
	$(BIN)/python benchmark/kernel_kda.py

# One archive of what the lent H200 machine lacks (SGLang trimmed, sglang-kernel 0.4.5, the small
# wheels of requirements/gpu-kit.txt, this package): build/gpu-kit/sglang-kda-gpu-kit.tar.xz, at
# most 32 MiB. Downloads from the registry; GPU_KIT_ARGS="--python PY312" also imports the serving
# modules from it with a Python 3.12 that has torch (docs/gpu.md, "GPU kit").
gpu-kit: venv
	$(BIN)/python benchmark/gpu_kit.py $(GPU_KIT_ARGS)

clean:
	rm -rf $(VENV) models build *.egg-info

lint: venv
	$(BIN)/ruff check --select E,F,W sglang_kda kda_harness patches kernels tests
	$(BIN)/ruff format --check sglang_kda kda_harness patches tests/server
