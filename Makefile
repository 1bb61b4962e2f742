# Two commands do all set-up on a fresh clone with only python3:
#   make plan   -> builds .venv once, then runs `plan --model qwen-vl-32b --gpus 16`
#   make test   -> builds .venv once, then runs the whole test suite
#   make test-fast -> the planner and cost-model tests only (the inner loop)
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
PLAN_ARGS ?= --model qwen-vl-32b --gpus 16

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q "torch==2.13.0"
	$(VENV)/bin/pip install -q -e ".[runtime,notebooks,test]"
	touch $(STAMP)

.PHONY: venv plan test test-fast
venv: $(STAMP)

plan: $(STAMP)
	$(VENV)/bin/plan $(PLAN_ARGS)

# the project's bytecode, compiled once: every process the suite starts (Ray workers, CLI runs, ranks, notebook
# kernels) would otherwise compile it again (~0.45 s each) where PYTHONDONTWRITEBYTECODE is set, as on CI
BYTECODE := $(VENV)/bin/python -m compileall -q planner runtime tests benchmarks scripts

test: $(STAMP)
	$(BYTECODE)
	$(VENV)/bin/python -m pytest -q -n 2 --durations=25 tests

# the inner loop: planner, cost model, catalog and hardware, no torch (seconds)
test-fast: $(STAMP)
	$(BYTECODE)
	$(VENV)/bin/python -m pytest -q -m "not slow" tests/cost tests/planner tests/test_catalog.py tests/test_hardware.py
