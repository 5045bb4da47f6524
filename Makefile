# p3d: two commands on a fresh machine.
#   make train   create the environment if missing, then run the default training job
#   make test    create the environment if missing, then run the test suite (less its slow tier)
#   make test-all    the whole suite, slow tier included
#   make test-fast   the in-process tests less the slow tier (tests/unit/: no worker, no p3d-train, no Slurm job)
#   make lint    ruff (lint + format check) and mypy
#   make gpu-check   the GPU path on a CUDA machine (docs/gpu.md); a dry mode anywhere else
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.p3d-installed
ARGS ?=
PYTEST_ARGS ?=

.PHONY: install train test test-all test-fast lint format bench dry-run gpu-check clean

$(STAMP): pyproject.toml requirements-cpu.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first: the CPU wheel (any other torch pulls a multi-GB CUDA build), then the rest pinned
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -r requirements-cpu.txt
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $@

install: $(STAMP)

train: $(STAMP)
	$(BIN)/p3d-train $(ARGS)

# The suite less its slow tier (variants of paths it runs, marked slow where defined); test-all: all of it.
# Two tests at a time on the machine's two cores (pytest-xdist, work stealing): a test's processes leave cores idle
# while they start, write and wait, and another test's fill them. Then, one at a time, the tests marked serial in
# tests/conftest.py: those that time their processes or race a signal against them, and tests/cluster/ (one Slurm
# cluster). PYTEST_ARGS given: one run of exactly those, one test at a time.
PAIRED := $(BIN)/python -m pytest -q -n 2 --dist worksteal tests
ALONE := $(BIN)/python -m pytest -q tests
test: $(STAMP)
ifeq ($(strip $(PYTEST_ARGS)),)
	$(PAIRED) -m "not slow and not serial"
	$(ALONE) -m "not slow and serial"
else
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)
endif

test-all: $(STAMP)
ifeq ($(strip $(PYTEST_ARGS)),)
	$(PAIRED) -m "not serial"
	$(ALONE) -m "serial"
else
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)
endif

# tests/unit/: in-process; a test there that starts a process fails (tests/conftest.py).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 tests/unit -m "not slow" $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: $(STAMP)
	$(BIN)/python bench/overhead.py

# On a machine with CUDA GPUs: train, measure and write docs/gpu.md (bench/gpu_check.py); without
# one: a dry mode that checks each step's config. Needs no venv on a GPU machine (bench/gpu_check.sh).
gpu-check:
	bash bench/gpu_check.sh $(ARGS)

dry-run: $(STAMP)
	$(BIN)/p3d-train mesh=tp8_pp8 model=llama70b cluster=h100_sxm cluster.nodes=8 schedule=large dry_run=true

clean:
	rm -rf outputs multirun .pytest_cache
