# Every target builds what it needs into a virtual environment of its own: .venv for the tests,
# lint, docs and benchmarks, .venv-demo for the demo (no torch), .venv-gpu-plan for JAX's CUDA
# plugin (tests/test_gpu_plan.py, make gpu-plan), the compat venvs below.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
OUT    ?= out

.PHONY: help venv test test-compat test-newest demo rl-demo bench bench-quick gpu-check gpu-bench gpu-bench-large gpu-bench-retry gpu-session gpu-plan bench-compile mutate lint docs docs-check docs-serve dist dist-check clean

help:
	@echo "make test        - create .venv, install jax-lossscale[test], run the whole test suite (CPU); tests/test_gpu_plan.py in .venv-gpu-plan, the tunix tests in .venv-rl"
	@echo "make test-compat - COMPAT=oldest|newest|jax011: the core tests (tests/compat/core.txt) and those of JAX's internals (tests/compat/internals.txt) in .venv-compat-<set> with that version set (tests/compat/<set>.txt)"
	@echo "make test-newest - the same tests on the newest jax, flax, optax, equinox, chex, on a Python >= 3.12 (found or built: tools/find_python.sh), in .venv-newest"
	@echo "make demo        - float16 training demo on scikit-learn's digits (CPU) in .venv-demo (jax-lossscale[demo], no torch), writes $(OUT)/"
	@echo "make rl-demo     - the training-inference mismatch of RL on a tunix Qwen3 in float32, bfloat16, float16 (CPU, ~2 min) in .venv-rl (google-tunix), writes benchmarks/results/rl-mismatch.* and docs/assets/rl-mismatch.png; then 600 GRPO steps in float32 and float16 + scaler into $(OUT)/ (~10 min in all)"
	@echo "make bench       - step/compile-time benchmark against plain Optax and the peers"
	@echo "make bench-quick - the ~1M-parameter MLPs and the char-LM transformer (< 3 minutes)"
	@echo "make gpu-check   - the CUDA comparison tests only (uses the installed python, PYTHONPATH=.)"
	@echo "make gpu-bench   - the quick benchmark with what is installed (for a GPU machine)"
	@echo "make bench-compile - trace, lower and compile seconds of a GPT step (hand-cast, autocast, scaler, retry; 4, 12 and 48 blocks; CPU and an H200 target), ~50 min on 2 cores"
	@echo "make gpu-plan    - bench_large's variants compiled for an H200 and a V100 without a GPU: kernels, bytes, temporaries, host round trips, predicted ratios (benchmarks/results/gpu-plan-*)"
	@echo "make gpu-session - on a lent GPU machine, in one call: gpu-check, gpu-bench-large and gpu-bench-retry, each under a time limit, logs and results in BENCH_OUT (benchmarks/gpu_session.sh; ~9.5 min)"
	@echo "make gpu-bench-retry - whether a retry_on_overflow step makes the host wait (for a GPU machine)"
	@echo "make mutate      - mutation testing of every module, hand-written + generated mutants (about 40 min on 2 cores for its 1412 mutants, more from a fresh clone: 38 min measured on 2026-12-02 with a warm JAX compilation cache, most mutants killed by the one test tools/mutation/killers.json names; later runs on the same sources reuse kills), writes tools/mutation/mutation-report.md; MUTATE_ARGS=\"--modules _state --sample 4\" sizes a run (its report: .mutate-cache/mutation-report-sized.md)"
	@echo "make lint        - ruff check, ruff format --check and mypy on jax_lossscale/ (installs [lint])"
	@echo "make docs        - the docs site into site/ (mkdocs build --strict), then its internal links checked"
	@echo "make docs-check  - make docs, then every page opened from disk in headless Chromium (needs chromium on PATH): fails on a missing image, a console error, a broken #anchor, an internal marker in the text, or search not working (tools/docs_check.py, ~15 s)"
	@echo "make docs-serve  - the docs site on http://127.0.0.1:8000 while editing"
	@echo "make dist        - wheel and sdist into dist/ (python -m build)"
	@echo "make dist-check  - make dist, then each of them installed into a fresh plain venv and imported"

# The venv itself, shared by every stamp below (each stamp adds one extra to it).
$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

# The whole suite in .venv, less tests/test_gpu_plan.py: it runs in .venv-gpu-plan (below),
# the one venv with JAX's CUDA plugin, which every JAX program of its venv loads.
test: $(STAMP)
	$(PY) -m pytest -q --ignore=tests/test_gpu_plan.py
	$(GPU_PLAN_PY) -m pytest -q -p no:cacheprovider tests/test_gpu_plan.py
	$(RL_PY) -m pytest -q -p no:cacheprovider $(TUNIX_TESTS) -k "tunix or grpo or mismatch"

# The versions pyproject.toml claims, tested: a venv per version set (tests/compat/oldest.txt
# pins the lower bounds, tests/compat/newest.txt lets pip pick, tests/compat/jax011.txt takes
# jax 0.11.x), the package and its flax extra installed against those pins, then the core
# subset listed in tests/compat/core.txt and the tests of the code that touches JAX's
# internals (tests/compat/internals.txt). A set whose first line is `# python>=3.12` is
# installed on the Python tools/find_python.sh finds (or builds).
# No torch or other test extras there: CI=1 keeps flax, equinox, chex and hypothesis
# required (a missing one fails, it does not skip), JAX_LOSSSCALE_CI_OPTIONAL exempts the
# ones this venv does not install. Not in .ci/run (its time limit); run it by hand.
COMPAT        ?= newest
COMPAT_SET    := tests/compat/$(COMPAT).txt
COMPAT_VENV   := .venv-compat-$(COMPAT)
COMPAT_PY     := $(COMPAT_VENV)/bin/python
COMPAT_STAMP  := $(COMPAT_VENV)/.installed
COMPAT_TOOLS  := "chex>=0.1.87" "equinox>=0.13.1" "pytest>=8" "hypothesis>=6.100"
COMPAT_CORE   := $(shell sed -e 's/\#.*//' tests/compat/core.txt)
COMPAT_INTERNALS := $(shell sed -e 's/\#.*//' tests/compat/internals.txt)
COMPAT_PYTHON  = $(if $(shell head -n 1 $(COMPAT_SET) 2>/dev/null | grep -x '\# python>=3.12'),$$(tools/find_python.sh),$(PYTHON))

$(COMPAT_STAMP): pyproject.toml $(COMPAT_SET)
	@test -f $(COMPAT_SET) || { echo "COMPAT=$(COMPAT): no $(COMPAT_SET) (oldest, newest or jax011)"; exit 1; }
	rm -rf $(COMPAT_VENV)
	py=$(COMPAT_PYTHON) && $$py -m venv $(COMPAT_VENV)
	$(COMPAT_PY) -m pip install --quiet --upgrade pip
	$(COMPAT_PY) -m pip install --quiet -r $(COMPAT_SET) -e ".[flax]" $(COMPAT_TOOLS)
	$(COMPAT_PY) -m pip list --format=freeze | grep -iE '^(jax|jaxlib|numpy|optax|flax|equinox|chex)==' > $(COMPAT_VENV)/versions.txt
	touch $(COMPAT_STAMP)

test-compat: $(COMPAT_STAMP)
	@echo "== COMPAT=$(COMPAT):" $$($(COMPAT_PY) --version) $$(cat $(COMPAT_VENV)/versions.txt)
	CI=1 JAX_LOSSSCALE_CI_OPTIONAL=torch $(COMPAT_PY) -m pytest -q -p no:cacheprovider $(COMPAT_CORE) $(COMPAT_INTERNALS)

# The JAX that `pip install jax` gives today (jax 0.11+ needs Python >= 3.12), in .ci/run:
# tools/find_python.sh finds a Python >= 3.12 (or builds CPython 3.13 from Debian trixie's
# source package), .venv-newest gets the newest jax, jaxlib, numpy, optax, flax, equinox and
# chex with pytest and hypothesis, then each of NEWEST_OPTIONAL that installs there. Run with
# CI=1: the core subset (tests/compat/core.txt) and every test of the code that touches
# JAX's internals (tests/compat/internals.txt: the autocast interpreter and its primitive
# kinds, check_underflow, the guard, sharding and multi-device, the Flax, NNX and Equinox
# integrations). Not the whole suite: it does not fit .ci/run's time on 2 cores (~15 minutes
# here with the install). Exempt (JAX_LOSSSCALE_CI_OPTIONAL), and printed: torch (no CPU
# wheel for this Python on the index; tests/autocast/test_torch_policy.py is left out), the
# public models' packages (jax_resnet, jraph, transformers: tests/test_public_models.py is
# not in the subset), and each of NEWEST_OPTIONAL that pip cannot install there.
NEWEST_VENV     := .venv-newest
NEWEST_PY       := $(NEWEST_VENV)/bin/python
NEWEST_STAMP    := $(NEWEST_VENV)/.installed
NEWEST_REQUIRED := jax jaxlib numpy optax flax equinox chex "pytest>=8" "hypothesis>=6.100"
# pip name:import name, each installed on its own (one that fails is exempt, not fatal)
NEWEST_OPTIONAL := orbax-checkpoint:orbax scikit-learn:sklearn matplotlib:matplotlib tqdm:tqdm \
                   setuptools:setuptools pyyaml:yaml jmp:jmp
NEWEST_EXEMPT   := torch jax_resnet jraph transformers

$(NEWEST_STAMP): pyproject.toml tools/find_python.sh
	rm -rf $(NEWEST_VENV)
	py=$$(tools/find_python.sh) && $$py -m venv $(NEWEST_VENV)
	$(NEWEST_PY) -m pip install --quiet --upgrade pip
	$(NEWEST_PY) -m pip install --quiet --upgrade -e . $(NEWEST_REQUIRED)
	@echo "$(NEWEST_EXEMPT)" > $(NEWEST_VENV)/exempt.txt
	@for pair in $(NEWEST_OPTIONAL); do \
	  pkg=$${pair%%:*}; mod=$${pair##*:}; \
	  $(NEWEST_PY) -m pip install --quiet "$$pkg" || { echo "== $$pkg does not install here: exempt"; echo "$$mod" >> $(NEWEST_VENV)/exempt.txt; }; \
	done
	$(NEWEST_PY) -m pip list --format=freeze | grep -iE '^(jax|jaxlib|numpy|optax|flax|equinox|chex)==' > $(NEWEST_VENV)/versions.txt
	touch $(NEWEST_STAMP)

test-newest: $(NEWEST_STAMP)
	@echo "== newest:" $$($(NEWEST_PY) --version) $$(cat $(NEWEST_VENV)/versions.txt)
	@echo "== exempt (JAX_LOSSSCALE_CI_OPTIONAL):" $$(cat $(NEWEST_VENV)/exempt.txt)
	CI=1 JAX_LOSSSCALE_CI_OPTIONAL="$$(cat $(NEWEST_VENV)/exempt.txt)" $(NEWEST_PY) -m pytest -q -p no:cacheprovider $(COMPAT_CORE) $(COMPAT_INTERNALS)

# Its own venv with the demo extra only (scikit-learn, matplotlib, tqdm): no torch, no test
# stack. --no-compile: the modules the demo imports are byte-compiled as it imports them, not
# every module of every package at install (half the install's time). The install's time is
# printed; the demo prints its own phases.
DEMO_VENV  := .venv-demo
DEMO_PY    := $(DEMO_VENV)/bin/python
DEMO_STAMP := $(DEMO_VENV)/.installed

$(DEMO_STAMP): pyproject.toml
	@start=$$(date +%s) && \
	  $(PYTHON) -m venv $(DEMO_VENV) && \
	  $(DEMO_PY) -m pip install --quiet --no-compile -e ".[demo]" && \
	  echo "== $(DEMO_VENV): jax-lossscale[demo] installed in $$(( $$(date +%s) - start )) s"
	@touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(DEMO_PY) examples/demo_fp16.py --out $(OUT)

# Its own venv with google-tunix (about 50 packages, 0.7 GB: not a test dependency) and
# matplotlib, built as .venv-demo is. The measurement (benchmarks/rl_mismatch.py) runs each XLA
# setting in a child process of its own, under a time limit.
RL_VENV  := .venv-rl
RL_PY    := $(RL_VENV)/bin/python
RL_STAMP := $(RL_VENV)/.installed

$(RL_STAMP): pyproject.toml
	@start=$$(date +%s) && \
	  $(PYTHON) -m venv $(RL_VENV) && \
	  $(RL_PY) -m pip install --quiet --no-compile -e . google-tunix==0.1.7 matplotlib "pytest>=8" && \
	  echo "== $(RL_VENV): jax-lossscale, google-tunix 0.1.7 installed in $$(( $$(date +%s) - start )) s"
	@touch $(RL_STAMP)

# The mismatch measurement, then a short GRPO run (tunix's GRPOLearner, float32 and float16
# with jls.flax.link_loss_scale, one seed) into $(OUT)/.
rl-demo: $(RL_STAMP)
	$(RL_PY) benchmarks/rl_mismatch.py
	@mkdir -p $(OUT)
	$(RL_PY) benchmarks/rl_grpo.py --steps 600 --seeds 0 --dtypes float32 float16 --out $(OUT) --plot $(OUT)/rl-grpo.png

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
GPU_TESTS := tests/test_skip.py tests/test_numerics.py tests/test_transform_config.py tests/test_transform.py tests/test_retry.py
gpu-check:
	PYTHONPATH=. $(PYTHON) -m pytest -q -m gpu -p no:cacheprovider tests
	PYTHONPATH=. $(PYTHON) -m pytest -q -p no:cacheprovider $(GPU_TESTS)

# The quick benchmark on that machine (jmp left out if missing); writes
# bench-gpu-quick.{md,json} to $(BENCH_OUT).
BENCH_OUT ?= benchmarks/results
gpu-bench:
	PYTHONPATH=. $(PYTHON) benchmarks/bench.py --quick --name bench-gpu-quick --out $(BENCH_OUT)

# GPT-2 small (12 layers, d_model 768, seq 1024) on one GPU: the JAX variants against
# PyTorch autocast + GradScaler, eager and torch.compile (~5 min on an H200); writes
# bench-gpu-large.{md,json} to $(BENCH_OUT).
gpu-bench-large:
	PYTHONPATH=. $(PYTHON) benchmarks/bench_large.py --out $(BENCH_OUT)

# Whether a step with jls.retry_on_overflow makes the host wait (the while loop's predicate),
# as compiled and with XLA's command buffers for while/conditional (< 2 min on an H200);
# writes retry-sync-gpu.md to $(BENCH_OUT).
gpu-bench-retry:
	PYTHONPATH=. $(PYTHON) benchmarks/bench_retry_sync.py --model gpt --out $(BENCH_OUT)

# All of the above in one call of a short lease (benchmarks/gpu_session.sh): each phase under
# its own time limit, never past GPU_SESSION_S in all; at most 8 files in $(BENCH_OUT).
GPU_SESSION_S ?= 570
gpu-session:
	PYTHON=$(PYTHON) benchmarks/gpu_session.sh $(BENCH_OUT) $(GPU_SESSION_S)

# The GPU plan (benchmarks/gpu_plan.py): JAX's CUDA plugin, pinned to the installed jaxlib's
# version, makes a compile-only GPU from a target description (benchmarks/gpu_targets/): no
# GPU, driver or CUDA libraries needed; CUDA 12's ptxas comes with it (CUDA 13's has no
# sm_70). In a venv of its own: JAX loads every installed plugin, and on a machine without
# CUDA this one prints a traceback ("Unable to load CUDA") from every JAX program that does
# not set JAX_SKIP_CUDA_CONSTRAINTS_CHECK. `make test` runs tests/test_gpu_plan.py there (in
# CI too: CI=1 requires the plugin). Flax for the NNX step, pytest for the tests.
GPU_PLAN_VENV  := .venv-gpu-plan
GPU_PLAN_PY    := $(GPU_PLAN_VENV)/bin/python
GPU_PLAN_STAMP := $(GPU_PLAN_VENV)/.installed

$(GPU_PLAN_STAMP): pyproject.toml
	$(PYTHON) -m venv $(GPU_PLAN_VENV)
	$(GPU_PLAN_PY) -m pip install --quiet -e ".[flax]" "pytest>=8"
	$(GPU_PLAN_PY) -m pip install --quiet -e ".[flax,gpu-plan]" "jax-cuda12-plugin==$$($(GPU_PLAN_PY) -c 'import jaxlib; print(jaxlib.__version__)')"
	touch $(GPU_PLAN_STAMP)

test: $(GPU_PLAN_STAMP) $(RL_STAMP)

# The tests of tunix itself (its trainers, GRPO learner, sampler), in .venv-rl with tunix
# installed; in .venv they skip. About 2 min to install and 2.5 min to run on 2 cores.
TUNIX_TESTS := tests/test_loop_tunix.py tests/test_rl_grpo.py tests/test_rl_mismatch.py tests/test_loop_you_do_not_own.py

# Writes gpu-plan-h200.{md,json} and gpu-plan-v100.{md,json} to $(BENCH_OUT) (~10 min on 2 cores).
gpu-plan: $(GPU_PLAN_STAMP)
	$(GPU_PLAN_PY) benchmarks/gpu_plan_report.py --out $(BENCH_OUT)

# Writes bench-compile-gpt.{md,json} to $(BENCH_OUT): the H200 target needs the CUDA plugin's venv.
bench-compile: $(GPU_PLAN_STAMP)
	$(GPU_PLAN_PY) benchmarks/bench_compile_gpt.py --layers 4 12 48 --targets cpu h200 --rounds 3 --out $(BENCH_OUT)

MUTATE_STAMP := $(VENV)/.installed-mutate

$(MUTATE_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e ".[test,mutate]"
	touch $(MUTATE_STAMP)

# Not part of `make test` or CI: run it before stopping whenever the update path changed.
mutate: $(MUTATE_STAMP)
	$(PY) tools/mutation/mutate.py $(MUTATE_ARGS)

LINT_STAMP := $(VENV)/.installed-lint

$(LINT_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e ".[lint]"
	touch $(LINT_STAMP)

lint: $(LINT_STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

DOCS_STAMP := $(VENV)/.installed-docs

$(DOCS_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e ".[docs]"
	touch $(DOCS_STAMP)

# Strict: a warning (a broken reference, a page outside the nav, a docstring griffe cannot
# parse, a public name without an API entry) fails the build. Then every internal link of the
# built site is checked, offline (external URLs are not followed).
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site
	$(VENV)/bin/linkchecker --no-status --ignore-url='^(https?|mailto):' site/index.html

# Not in .ci/run: it needs Chromium (apt-get install chromium), which a fresh clone may not have;
# without it the script says so and exits 2.
docs-check: docs
	$(PY) tools/docs_check.py site

docs-serve: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve --dev-addr 127.0.0.1:8000

DIST_STAMP := $(VENV)/.installed-build
DIST_VENV  ?= build/dist-check-venv

$(DIST_STAMP): | $(PY)
	$(PY) -m pip install --quiet build
	touch $(DIST_STAMP)

dist: $(DIST_STAMP)
	rm -rf dist
	$(PY) -m build --outdir dist .

# Each artifact into its own plain venv (no system site-packages, no test extra), then imported
# from outside the source tree. jax, optax and numpy come from the package index.
dist-check: dist
	@for artifact in dist/*.whl dist/*.tar.gz; do \
	  echo "== $$artifact"; \
	  rm -rf $(DIST_VENV) && $(PYTHON) -m venv $(DIST_VENV) && \
	  $(DIST_VENV)/bin/python -m pip install --quiet "$$artifact" && \
	  (cd / && $(abspath $(DIST_VENV))/bin/python -c "$$DIST_CHECK") || exit 1; \
	done
	rm -rf $(DIST_VENV)

define DIST_CHECK
import jax, jax.numpy as jnp, optax, importlib.metadata as md
import jax_lossscale as jls, jax_lossscale.torch, jax_lossscale.diagnostics, jax_lossscale.checkpoint
assert "site-packages" in jls.__file__, jls.__file__
assert md.version("jax-lossscale") == jls.__version__, (md.version("jax-lossscale"), jls.__version__)
tx = jls.dynamic_loss_scale(optax.sgd(1.0)); s = tx.init(jnp.zeros(2))
u, s = tx.update(jnp.array([1.0, jnp.inf]), s)
assert float(jls.get_scale_state(s).scale) == 2.0**15
try:
    import jax_lossscale.flax
except ImportError as e:
    assert "jax-lossscale[flax]" in str(e), e
print("ok: jax_lossscale", jls.__version__, "from", jls.__file__)
endef
export DIST_CHECK

clean:
	rm -rf $(VENV) $(DEMO_VENV) $(RL_VENV) $(GPU_PLAN_VENV) .venv-compat-* $(NEWEST_VENV) .pytest_cache $(OUT) site dist build
