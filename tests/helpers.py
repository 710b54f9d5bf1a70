"""Helpers shared by the test files: ``from helpers import ...``.

Plain functions and constants only; the fixtures and pytest hooks live in
``tests/conftest.py`` (which sets the eight CPU devices and strict dtype promotion
before any test module, and so before this one, is imported).

* :func:`import_optional`, :func:`import_torch`: an optional test dependency,
  skipped where it is missing, a failure in CI (``CI=true``) for the ones in
  :data:`REQUIRED_IN_CI` (those ``make test`` installs); :func:`in_ci`.
* :func:`standard_promotion`: standard dtype promotion around third-party code
  (``optax.adam``) that is not clean under strict promotion.
* :func:`slow_batch`, :func:`calibrated_iterations`: a long device computation that
  returns its input, for proving that code does not wait for the device (see
  ``tests/test_entry_points_async.py``).
* :func:`has_cuda`: whether JAX sees a CUDA device.
* :func:`make_nnx_optimizer`, :func:`nnx_update`: ``nnx.Optimizer`` built and stepped
  the same way on every Flax version the package supports.
* :func:`bits`, :func:`assert_bits_equal`: every leaf as its raw bits, and two trees
  compared bit for bit (NaN payloads and -0.0 included).
* :func:`load_benchmark_module`: a module of ``benchmarks/`` (with that folder on
  ``sys.path``, as its scripts run), for code that lives beside its benchmark.
"""

import importlib
import inspect
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

BENCHMARKS_DIR = os.path.join(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"
)


def load_benchmark_module(name: str):
  """Imports ``benchmarks/<name>.py``, putting ``benchmarks/`` on ``sys.path`` once."""
  if BENCHMARKS_DIR not in sys.path:
    sys.path.insert(0, BENCHMARKS_DIR)
  return importlib.import_module(name)


def bits(tree):
  """Every leaf as its raw bits (bit-identity, NaN payloads and -0.0 included)."""
  return [
    np.asarray(x).view(f"u{np.asarray(x).dtype.itemsize}") for x in jax.tree_util.tree_leaves(tree)
  ]


def assert_bits_equal(a, b):
  """``a`` and ``b`` have as many leaves, each the same bits."""
  la, lb = bits(a), bits(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(x, y)


def make_nnx_optimizer(model, tx):
  """``nnx.Optimizer(model, tx, wrt=nnx.Param)``; ``wrt`` is required from Flax 0.11 on."""
  from flax import nnx

  if "wrt" in inspect.signature(nnx.Optimizer.__init__).parameters:
    return nnx.Optimizer(model, tx, wrt=nnx.Param)
  return nnx.Optimizer(model, tx)  # Flax < 0.11


def nnx_update(optimizer, model, grads):
  """``optimizer.update(model, grads)`` (Flax >= 0.11) or ``update(grads)``."""
  params = inspect.signature(optimizer.update).parameters.values()
  if sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params) >= 2:
    return optimizer.update(model, grads)
  return optimizer.update(grads)


def has_cuda() -> bool:
  try:
    return any(d.platform == "gpu" for d in jax.devices())
  except RuntimeError:
    return False


#: Optional test dependencies that ``make test`` installs (the ``test`` extra),
#: by import name. In CI a test that needs one of them fails when it is missing.
REQUIRED_IN_CI = (
  "torch",
  "hypothesis",
  "orbax",
  "sklearn",
  "matplotlib",
  "flax",
  "equinox",
  "chex",
  "jmp",
  "tqdm",
  "jax_resnet",
  "jraph",
  "transformers",
  "yaml",
  "jax_plugins",  # jax-cuda12-plugin (the gpu-plan extra): tests/test_gpu_plan.py
)


def in_ci() -> bool:
  """Whether the suite runs in CI (``CI`` set to ``1``, ``true`` or ``yes``)."""
  return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def required_in_ci(name: str) -> bool:
  """Whether a missing ``name`` fails the run: in CI and in :data:`REQUIRED_IN_CI`.

  ``JAX_LOSSSCALE_CI_OPTIONAL`` (space- or comma-separated import names) exempts
  some of them: ``make test-compat`` sets it to what its venv leaves out (torch),
  so every other required dependency still fails there when missing. ``.ci/run``
  never sets it.
  """
  top = name.split(".")[0]
  exempt = os.environ.get("JAX_LOSSSCALE_CI_OPTIONAL", "").replace(",", " ").split()
  return in_ci() and top in REQUIRED_IN_CI and top not in exempt


def import_optional(name: str):
  """Imports module ``name``; skips the test if it is missing, but fails in CI.

  Use it instead of ``pytest.importorskip`` for the dependencies in
  :data:`REQUIRED_IN_CI`: a missing install step in CI must not turn a whole
  file of tests into silent skips.
  """
  try:
    return importlib.import_module(name)
  except ImportError as e:
    if required_in_ci(name):
      pytest.fail(f"{name} is required in CI (it is in the test extra): {e}", pytrace=False)
    pytest.skip(f"{name} is not installed", allow_module_level=True)


def import_torch():
  """Imports torch; skips the test outside CI if torch is missing, fails in CI."""
  return import_optional("torch")


def standard_promotion():
  """Standard dtype promotion, for third-party code that is not strict-clean.

  ``optax.adam`` computes ``b1 ** count`` (a Python float to an int32 power),
  which strict promotion rejects; use this context around steps that run Adam.
  jax_lossscale's own code runs under strict promotion everywhere else.
  """
  return jax.numpy_dtype_promotion("standard")


@jax.jit
def _slow_batch(x, n):
  def body(_, m):
    return jnp.tanh(m @ m) * np.float32(0.5)

  m = jax.lax.fori_loop(0, n, body, jnp.eye(256, dtype=jnp.float32))
  # Depends on the loop's result, equals x (m is finite and bounded).
  return x + jnp.zeros_like(x) * m[0, 0]


def slow_batch(x, n):
  """``x`` unchanged, after ``n`` dependent 256x256 matmuls (a long device computation).

  Whatever is computed from the result cannot be ready before the loop ends;
  so code that returns while the result is not ready has not waited for it
  (on CPU ``jax.transfer_guard`` never fires for device-resident values, so
  this is how "no host sync" is proven).
  """
  return _slow_batch(x, n)


def calibrated_iterations(x, seconds=1.0):
  """Loop length for which :func:`slow_batch` runs about ``seconds``."""
  n = 64
  _slow_batch(x, n).block_until_ready()  # compile
  t0 = time.perf_counter()
  _slow_batch(x, n).block_until_ready()
  dt = max(time.perf_counter() - t0, 1e-4)
  return int(min(max(n * seconds / dt, 64), 1_000_000))
