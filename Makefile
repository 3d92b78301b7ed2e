# The two commands: `make run` trains the example job, `make test` runs the whole suite.
# Both create .venv on first use: the CPU build of torch first (a plain `torch` would pull CUDA),
# then scaletrain with its dev extras.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: run test bench venv clean

run: $(STAMP)
	$(BIN)/scaletrain run examples/digits.yaml

test: $(STAMP)
	$(BIN)/python -m pytest tests

# scaletrain against the raw tools (minutes; `make bench ARGS=--full` for the long run):
# bench/results/latest.json, docs/benchmarks.md, docs/benchmarks.png
bench: $(STAMP)
	$(BIN)/python bench/run_all.py $(ARGS)

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

clean:
	rm -rf $(VENV) runs .pytest_cache
