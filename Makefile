# Tessera developer commands. `make demo` and `make test` set themselves up from nothing.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# torch is installed first and then pinned, so no later resolve can swap in a CUDA build.
# On this project's CPU machines `torch==2.13.0` is the CPU wheel on local disk. Elsewhere set
# TORCH_SPEC (any torch>=2.11, the packages' declared minimum) and, for a CPU-only machine, TORCH_PIP_ARGS="--index-url <your CPU wheel index>".
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
PACKAGES := -e packages/common -e kernels -e packages/data_prep -e packages/trainer \
            -e packages/ckpt_convert -e packages/inference
STAMP := $(VENV)/.tessera-installed
PYTEST_ARGS ?=
# Test processes (pytest-xdist), one per core up to 4; each test file stays on one worker
# (--dist loadfile) so module fixtures are built once; files with the most tests go first (xdist's
# default: handing out the multi-process folders first made both workers run process groups at
# once and took longer). PYTEST_WORKERS=0 runs in this process.
PYTEST_WORKERS ?= $(shell $(PYTHON) -c "import os; print(min(4, len(os.sched_getaffinity(0))))" 2>/dev/null || echo 2)

.PHONY: setup test lint lint-imports demo bench clean

setup: $(STAMP)

$(STAMP): Makefile requirements-dev.txt packages/*/pyproject.toml kernels/pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "[setup] installing torch ($(TORCH_SPEC))"
	@$(PIP) install -q --disable-pip-version-check "$(TORCH_SPEC)" $(TORCH_PIP_ARGS) > $(VENV)/install-torch.log 2>&1 \
		|| { grep -v "is ignored: it is neither" $(VENV)/install-torch.log; exit 1; }
	@$(PY) -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > $(VENV)/torch-constraint.txt
	@echo "[setup] installing tessera packages and dev tools (torch pinned to $$(cat $(VENV)/torch-constraint.txt))"
	@$(PIP) install -q --disable-pip-version-check -c $(VENV)/torch-constraint.txt \
		$(PACKAGES) -r requirements-dev.txt > $(VENV)/install.log 2>&1 \
		|| { grep -v "is ignored: it is neither" $(VENV)/install.log; exit 1; }
	@$(PY) -c "import tessera.common, tessera.kernels, tessera.data_prep, tessera.trainer, tessera.ckpt_convert, tessera.inference"
	@touch $(STAMP)

# Without CUDA, Triton kernels run in Triton's interpreter (tests force them onto CPU tensors).
TRITON_ENV := $(shell command -v nvidia-smi >/dev/null 2>&1 || echo TRITON_INTERPRET=1)

test: $(STAMP)
	@$(MAKE) --no-print-directory lint-imports
	$(TRITON_ENV) $(VENV)/bin/pytest -q -p no:cacheprovider --timeout=600 --durations=30 \
		-n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

lint-imports: $(STAMP)
	@$(VENV)/bin/lint-imports --no-cache

lint: $(STAMP) lint-imports
	$(VENV)/bin/ruff check packages kernels tests benchmarks examples

demo: $(STAMP)
	@$(PY) examples/demo.py

bench: $(STAMP)
	@echo "see benchmarks/README.md; e.g. $(PY) benchmarks/train_throughput.py"

clean:
	rm -rf $(VENV) .demo build
