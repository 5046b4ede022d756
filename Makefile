# Two commands do all set-up on a fresh machine: `make run` and `make test`.
# Both create .venv on first use and install the project (editable) into it:
# `make run` the simulator alone (no torch), `make test` everything the tests need.
# VENV=PATH uses another environment: one that exists (venv, virtualenv, conda) is used
# as it is, never recreated, and `make clean` keeps it; one that does not is created.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The torch build `make test` installs before the collector's and the replay's extras.
# On a machine without a GPU, point TORCH_INDEX at PyTorch's CPU-only wheels
# (docs/install.md); left empty, pip takes torch from its configured index.
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
# Stamps: what has been installed into $(VENV) (again when pyproject.toml changes).
BASE := $(VENV)/.fmoesim-base
BUILD := $(VENV)/.fmoesim-build
PLOT := $(VENV)/.fmoesim-plot
DEV := $(VENV)/.fmoesim-dev
# Marks an environment make created: `make clean` removes those and the clone's .venv only.
MADE := $(VENV)/.fmoesim-made
# An active environment other than $(VENV) is not used: the recipes that create or build
# say so, and how to use it instead.
ACTIVE := $(filter-out $(abspath $(VENV)),$(abspath $(VIRTUAL_ENV)))
NOTE_ACTIVE = $(if $(ACTIVE),@echo "note: $(VENV) is used and not the active environment $(ACTIVE) (VENV=$(ACTIVE) uses that one)" >&2)
# The interpreter of `make pure` and `make clean`, which need no install.
ANY_PYTHON = $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))

.PHONY: run test lint bench figures reproduce clean compiled pure

# Created only where there is none: `python -m venv` over an existing environment would
# rewrite its pyvenv.cfg (its Python, its access to system packages).
$(BIN)/python:
	$(NOTE_ACTIVE)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	touch $(MADE)

$(BASE): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e .
	touch $@

$(PLOT): $(BASE)
	$(BIN)/python -m pip install --quiet -e '.[plot]'
	touch $@

# What the compiled build needs: the dev extra (mypy, whose mypyc compiles, and setuptools).
$(BUILD): $(BASE)
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

$(DEV): $(BASE)
	$(BIN)/python -m pip install --quiet $(TORCH) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install --quiet -e '.[dev,plot,collect,replay]'
	touch $(PLOT) $(BUILD) $@

## Simulate the bundled default trace (Mixtral-8x7B shape, RTX 3090, LRU) and print the summary.
run: $(BASE)
	$(BIN)/fmoesim

## Run the test suite.
test: $(DEV)
	$(BIN)/python -m pytest -q

lint: $(DEV)
	$(BIN)/ruff check fmoesim policies replay tests benchmarks examples notebooks
	$(BIN)/ruff format --check fmoesim policies replay tests benchmarks examples

## The simulation runs of `make figures` and `make reproduce` take a compiled build made
## for them and removed after them (the same results, about 1.6x faster; a tree already
## compiled stays so), or the sources where mypyc cannot build; RUNS_BUILD=pure runs
## the sources.
RUNS_BUILD ?= compiled
ifeq ($(filter $(RUNS_BUILD),compiled pure),)
$(error RUNS_BUILD=$(RUNS_BUILD): must be compiled or pure)
endif
RUNS_DEPS := $(PLOT) $(if $(filter compiled,$(RUNS_BUILD)),$(BUILD))
RUNS_WITH := $(if $(filter compiled,$(RUNS_BUILD)),$(BIN)/python fmoesim/_compiled.py run --)

## Regenerate every paper figure and table (results/figures/) from the bundled traces.
figures: $(RUNS_DEPS)
	$(RUNS_WITH) $(BIN)/fmoesim-plot all --run --jobs 2

## Score the papers' claims (results/reproduction/) and refresh docs/reproduction.md.
reproduce: $(RUNS_DEPS)
	$(RUNS_WITH) $(BIN)/fmoesim-reproduce all --run --jobs 2 --docs docs/reproduction.md

bench: $(BASE)
	$(BIN)/python -m benchmarks.engine

## Optional: compile the engine's hot modules with mypyc (1.3x to 6x faster, same results)
## for $(VENV)'s Python; rerun after editing one of them (imports refuse a stale build).
## `make pure` undoes it.
compiled: $(BUILD)
	$(NOTE_ACTIVE)
	$(BIN)/python fmoesim/_compiled.py build

pure:
	$(ANY_PYTHON) fmoesim/_compiled.py pure

clean:
	$(ANY_PYTHON) fmoesim/_compiled.py pure
	rm -rf build *.egg-info
	$(if $(or $(filter $(CURDIR)/.venv,$(abspath $(VENV))),$(wildcard $(MADE))),rm -rf $(VENV),rm -f $(BASE) $(BUILD) $(PLOT) $(DEV))
