# The two commands: `make run` trains the example job, `make test` runs the whole suite.
# Both create .venv on first use: torch first ($(TORCH), from PyPI, or from $(TORCH_INDEX) when
# set: on Linux PyPI's wheel is the CUDA build, so TORCH_INDEX=https://download.pytorch.org/whl/cpu
# gets a CPU-only one), then scaletrain with its dev extras.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
TORCH  ?= torch==2.13.0
TORCH_INDEX ?=
STAMP  := $(VENV)/.installed

.PHONY: run test tools bench gpu-check gpu-wheels venv clean

run: $(STAMP)
	$(BIN)/scaletrain run examples/digits.yaml

test: $(STAMP) tools
	$(BIN)/ruff check src tests bench
	$(BIN)/mypy src
	$(BIN)/python -m pytest tests --cov --cov-report=term

# The Debian tools the tests run for real (prometheus, with promtool; chromium, headless, for the
# report page): installed when missing if this is root with apt-get (CI); elsewhere their tests
# skip, naming the package (under CI=true a missing tool fails them).
DEBIAN_TOOLS := prometheus chromium
tools:
	@command -v promtool >/dev/null 2>&1 && command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Debian packages: $(DEBIAN_TOOLS)"; \
	    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(DEBIAN_TOOLS) >/dev/null; } \
	      || echo "could not install $(DEBIAN_TOOLS): the tests that need them fail under CI=true, naming them"; \
	  else echo "missing Debian packages: $(DEBIAN_TOOLS) (their tests are skipped; CI=true fails them)"; fi; }

# scaletrain against the raw tools (minutes; `make bench ARGS=--full` for the long run):
# bench/results/latest/ (summary.json, one file per bench), docs/benchmarks.md, docs/benchmarks.png
bench: $(STAMP)
	$(BIN)/python bench/run_all.py $(ARGS)

# On a machine with an NVIDIA GPU: bench/gpu_check.py's five checks in under 8 minutes
# (bench/results/latest/gpu.json); `make gpu-check ARGS="--table"` also fills docs/benchmarks.md.
# It needs only torch there: scaletrain runs from src/, pydantic and blake3 come from .whl/ (below).
gpu-check:
	bash bench/gpu_check.sh $(ARGS)

# The wheels bench/gpu_check.sh installs where pydantic or blake3 is missing and there is no network: the
# versions in .venv, for CPython 3.12 on x86_64 Linux, into .whl/ (git-ignored; carry it over).
gpu-wheels:
	python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 blake3==1.0.11

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

clean:
	rm -rf $(VENV) runs .pytest_cache
