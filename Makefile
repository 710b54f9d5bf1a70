# Every target builds what it needs into its own virtual environment (.venv).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
OUT    ?= out

.PHONY: help venv test test-fast demo bench bench-quick gpu-check gpu-bench mutate clean

help:
	@echo "make test        - create .venv, install jax-lossscale[test], run the whole test suite (CPU)"
	@echo "make demo        - float16 training demo on scikit-learn's digits (CPU), writes $(OUT)/"
	@echo "make bench       - step/compile-time benchmark against plain Optax and the peers"
	@echo "make bench-quick - the ~1M-parameter MLPs and the char-LM transformer (< 3 minutes)"
	@echo "make gpu-check   - the CUDA comparison tests only (uses the installed python, PYTHONPATH=.)"
	@echo "make gpu-bench   - the quick benchmark with what is installed (for a GPU machine)"
	@echo "make mutate      - mutation testing of every module, hand-written + generated mutants (~30 min on 2 cores), writes tests/mutation-report.md; MUTATE_ARGS=\"--modules _state --sample 4\" sizes a run"

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

demo: $(STAMP)
	$(PY) examples/demo_fp16.py --out $(OUT)

BENCH_STAMP := $(VENV)/.installed-bench

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e ".[test,bench]"
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(PY) benchmarks/bench.py --out benchmarks/results

bench-quick: $(BENCH_STAMP)
	$(PY) benchmarks/bench.py --quick --out benchmarks/results

# Runs on a GPU machine with what is installed there (no network, no venv).
# The CUDA comparison tests, then the exactness, numerics, config and transform
# tests on the GPU backend (XLA:GPU keeps subnormals, so they check every bit).
GPU_TESTS := tests/test_skip.py tests/test_numerics.py tests/test_config.py tests/test_transform.py
gpu-check:
	PYTHONPATH=. $(PYTHON) -m pytest -q -m gpu -p no:cacheprovider tests
	PYTHONPATH=. $(PYTHON) -m pytest -q -p no:cacheprovider $(GPU_TESTS)

# The quick benchmark on that machine (jmp left out if missing); writes
# bench-gpu-quick.{md,json} to $(BENCH_OUT).
BENCH_OUT ?= benchmarks/results
gpu-bench:
	PYTHONPATH=. $(PYTHON) benchmarks/bench.py --quick --name bench-gpu-quick --out $(BENCH_OUT)

# Not part of `make test` or CI: run it before stopping whenever the update path changed.
mutate: $(STAMP)
	$(PY) tests/mutate.py $(MUTATE_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache $(OUT)
