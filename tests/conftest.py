"""Test configuration shared by the whole suite.

* Eight CPU devices (for the multi-device tests), set before JAX is imported.
* ``jax_numpy_dtype_promotion="strict"``: no silent dtype promotion anywhere.
* Fixtures: ``maybe_jit`` (run a test's function both eagerly and under
  ``jax.jit``), ``fresh_warnings`` (the once-per-process warnings armed again).
* In CI (``CI=true``) no test may be skipped for a missing optional dependency
  that ``make test`` installs (``helpers.REQUIRED_IN_CI``): ``helpers.import_optional``
  fails there, and the hooks below turn ``pytest.importorskip`` of one of them
  into a failure too. ``JAX_LOSSSCALE_CI_OPTIONAL`` exempts named ones
  (``make test-compat``, whose venv has no torch; see ``helpers.required_in_ci``).

The helper functions the test files share live in ``tests/helpers.py``
(``from helpers import ...``); they are re-exported here for the files that
still import them from ``conftest``.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
# JAX's CUDA plugin (the gpu-plan extra, for tests/test_gpu_plan.py's compile-only GPUs, in
# .venv-gpu-plan only: see the Makefile) registers only if it is not asked to check the CUDA
# libraries, which a CPU machine lacks. Read when JAX first initialises its backends, so set
# before any test touches JAX.
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import re

import jax
import pytest

jax.config.update("jax_numpy_dtype_promotion", "strict")

# Re-exported: test files that predate tests/helpers.py import these from conftest.
from helpers import REQUIRED_IN_CI  # noqa: E402, F401
from helpers import calibrated_iterations  # noqa: E402, F401
from helpers import has_cuda  # noqa: E402, F401
from helpers import import_optional  # noqa: E402, F401
from helpers import import_torch  # noqa: E402, F401
from helpers import in_ci  # noqa: E402, F401
from helpers import required_in_ci  # noqa: E402
from helpers import slow_batch  # noqa: E402, F401
from helpers import standard_promotion  # noqa: E402, F401

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


def _missing_required_module(report) -> str:
  """The REQUIRED_IN_CI module whose ``importorskip`` skipped ``report``, or ``""``."""
  if not report.skipped or not isinstance(report.longrepr, tuple):
    return ""
  match = re.match(r"(?:Skipped: )?could not import '([\w.]+)'", str(report.longrepr[2]))
  if match and required_in_ci(match.group(1)):
    return match.group(1)
  return ""


def _fail_required_skip(report) -> None:
  """In CI, turns a report skipped by ``importorskip`` of a required dependency into a failure."""
  name = _missing_required_module(report)
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


@pytest.fixture
def fresh_warnings():
  """The once-per-process LossScaleWarnings armed again for one test, then restored.

  A test that triggers such a warning must not depend on whether an earlier test already
  fired it (it would fail alone and pass in the suite, or the reverse): it takes this
  fixture and asserts the warning with ``pytest.warns``.
  """
  from jax_lossscale._scaler import _signals

  saved = set(_signals._WARNED)
  _signals._WARNED.clear()
  yield
  _signals._WARNED.clear()
  _signals._WARNED.update(saved)
