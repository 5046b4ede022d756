# Two commands do all set-up on a fresh machine: `make run` and `make test`.
# Both create .venv on first use and install the project (editable) into it.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.fmoesim-installed

.PHONY: run test lint bench figures clean compiled pure

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first, pinned: on a CPU machine this is the local CPU wheel, and the extras'
	# unpinned "torch>=2.4" is then already satisfied (no multi-GB CUDA download)
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev,collect]'
	touch $(STAMP)

## Simulate the bundled default trace (Mixtral-8x7B shape, RTX 3090, LRU) and print the summary.
run: $(STAMP)
	$(BIN)/fmoesim

## Run the test suite.
test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check fmoesim policies replay tests
	$(BIN)/ruff format --check fmoesim policies replay tests

## Regenerate every paper figure and table (results/figures/) from the bundled traces.
figures: $(STAMP)
	$(BIN)/fmoesim-plot all --run --jobs 2

bench: $(STAMP)
	$(BIN)/python -m benchmarks.engine

## Optional: compile the engine's hot modules with mypyc (about 2x faster, same results);
## rerun after editing one of them (imports refuse a stale build). `make pure` undoes it.
compiled: $(STAMP)
	$(BIN)/python fmoesim/_compiled.py build

pure: $(STAMP)
	$(BIN)/python fmoesim/_compiled.py pure

clean:
	[ ! -x $(BIN)/python ] || $(BIN)/python fmoesim/_compiled.py pure
	rm -rf $(VENV) build *.egg-info
