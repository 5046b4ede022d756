# Two commands do all set-up on a fresh machine: `make run` and `make test`.
# Both create .venv on first use and install the project (editable) into it:
# `make run` the simulator alone (no torch), `make test` everything the tests need.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The torch build `make test` installs before the collector's and the replay's extras.
# On a machine without a GPU, point TORCH_INDEX at PyTorch's CPU-only wheels
# (docs/install.md); left empty, pip takes torch from its configured index.
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
BASE := $(VENV)/.fmoesim-base
PLOT := $(VENV)/.fmoesim-plot
DEV := $(VENV)/.fmoesim-dev

.PHONY: run test lint bench figures reproduce clean compiled pure

$(BASE): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e .
	touch $@

$(PLOT): $(BASE)
	$(BIN)/python -m pip install --quiet -e '.[plot]'
	touch $@

$(DEV): $(BASE)
	$(BIN)/python -m pip install --quiet $(TORCH) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install --quiet -e '.[dev,plot,collect,replay]'
	touch $(PLOT) $@

## Simulate the bundled default trace (Mixtral-8x7B shape, RTX 3090, LRU) and print the summary.
run: $(BASE)
	$(BIN)/fmoesim

## Run the test suite.
test: $(DEV)
	$(BIN)/python -m pytest -q

lint: $(DEV)
	$(BIN)/ruff check fmoesim policies replay tests benchmarks examples
	$(BIN)/ruff format --check fmoesim policies replay tests benchmarks examples

## Regenerate every paper figure and table (results/figures/) from the bundled traces.
figures: $(PLOT)
	$(BIN)/fmoesim-plot all --run --jobs 2

## Score the papers' claims (results/reproduction/) and refresh docs/reproduction.md.
reproduce: $(PLOT)
	$(BIN)/fmoesim-reproduce all --run --jobs 2 --docs docs/reproduction.md

bench: $(BASE)
	$(BIN)/python -m benchmarks.engine

## Optional: compile the engine's hot modules with mypyc (1.3x to 6x faster, same results);
## rerun after editing one of them (imports refuse a stale build). `make pure` undoes it.
compiled: $(DEV)
	$(BIN)/python fmoesim/_compiled.py build

pure: $(BASE)
	$(BIN)/python fmoesim/_compiled.py pure

clean:
	[ ! -x $(BIN)/python ] || $(BIN)/python fmoesim/_compiled.py pure
	rm -rf $(VENV) build *.egg-info
