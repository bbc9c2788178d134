# Colonnade: `make demo` trains on the built-in corpus across 4 CPU ranks and samples text;
# `make test` runs the whole suite. Both set up the virtualenv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test flake-hunt lint bench clean gpu-wheels

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/colonnade train --config configs/demo.toml --nproc 4
	$(BIN)/colonnade generate checkpoints/demo --prompt "def " --max-new-tokens 160 --temperature 0.7

test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -p no:cacheprovider tests

# The tests that race the OS (marked timing), 10 rounds of 2 copies at once: 20 runs, 0 may fail.
flake-hunt: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m tests.flake_hunt --rounds 10 --copies 2

# Wheels the GPU benchmark needs on an offline GPU machine (benchmarks/README.md).
gpu-wheels:
	bash benchmarks/gpu_wheels.sh

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) runs checkpoints data .pytest_cache .ruff_cache
