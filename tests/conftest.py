"""Test configuration shared by the whole suite.

* Eight CPU devices (for the multi-device tests), set before JAX is imported.
* ``jax_numpy_dtype_promotion="strict"``: no silent dtype promotion anywhere.
* ``maybe_jit``: run a test's function both eagerly and under ``jax.jit``.
* ``slow_batch``: a long device computation that returns its input, for
  proving that code does not wait for the device (see ``tests/test_async.py``).
* In CI (``CI=true``) no test may be skipped for a missing optional dependency
  that ``make test`` installs (torch, hypothesis, orbax, scikit-learn,
  matplotlib, flax, equinox, chex, jmp, tqdm, and the public models' jax-resnet, jraph and
  transformers): :func:`import_optional` fails there, and
  ``pytest.importorskip`` of one of them is turned into a failure too.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

import importlib
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

jax.config.update("jax_numpy_dtype_promotion", "strict")

if os.environ.get("JAX_LOSSSCALE_MUTATE"):  # set by tools/mutation/mutate.py
  try:
    from hypothesis import Phase
    from hypothesis import settings

    # A mutant only needs a failing example, not the smallest one: no shrinking.
    settings.register_profile("mutate", phases=[Phase.explicit, Phase.reuse, Phase.generate])
    settings.load_profile("mutate")
  except ImportError:
    pass


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def maybe_jit(request):
  """``jax.jit`` or the identity, so each test runs with and without jit."""
  if request.param:
    return jax.jit
  return lambda f, *args, **kwargs: f


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
)


def in_ci() -> bool:
  """Whether the suite runs in CI (``CI`` set to ``1``, ``true`` or ``yes``)."""
  return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def import_optional(name: str):
  """Imports module ``name``; skips the test if it is missing, but fails in CI.

  Use it instead of ``pytest.importorskip`` for the dependencies in
  :data:`REQUIRED_IN_CI`: a missing install step in CI must not turn a whole
  file of tests into silent skips.
  """
  try:
    return importlib.import_module(name)
  except ImportError as e:
    if in_ci() and name.split(".")[0] in REQUIRED_IN_CI:
      pytest.fail(f"{name} is required in CI (it is in the test extra): {e}", pytrace=False)
    pytest.skip(f"{name} is not installed", allow_module_level=True)


def import_torch():
  """Imports torch; skips the test outside CI if torch is missing, fails in CI."""
  return import_optional("torch")


def _missing_required_module(report) -> str:
  """The REQUIRED_IN_CI module whose ``importorskip`` skipped ``report``, or ``""``."""
  if not report.skipped or not isinstance(report.longrepr, tuple):
    return ""
  match = re.match(r"(?:Skipped: )?could not import '([\w.]+)'", str(report.longrepr[2]))
  if match and match.group(1).split(".")[0] in REQUIRED_IN_CI:
    return match.group(1)
  return ""


def _fail_required_skip(report) -> None:
  """In CI, turns a report skipped by ``importorskip`` of a required dependency into a failure."""
  name = _missing_required_module(report) if in_ci() else ""
  if name:
    report.outcome = "failed"
    report.longrepr = f"{name} is required in CI (it is in the test extra); importorskip skipped it"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
  """In CI, a module-level ``importorskip`` of a required dependency fails the module."""
  outcome = yield
  _fail_required_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  """In CI, an ``importorskip`` of a required dependency inside a test fails it."""
  outcome = yield
  _fail_required_skip(outcome.get_result())


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


@pytest.fixture
def fresh_warnings():
  """The once-per-process LossScaleWarnings armed again for one test, then restored.

  A test that triggers such a warning must not depend on whether an earlier test already
  fired it (it would fail alone and pass in the suite, or the reverse): it takes this
  fixture and asserts the warning with ``pytest.warns``.
  """
  from jax_lossscale import _signals

  saved = set(_signals._WARNED)
  _signals._WARNED.clear()
  yield
  _signals._WARNED.clear()
  _signals._WARNED.update(saved)
