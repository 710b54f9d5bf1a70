"""Test configuration shared by the whole suite.

* Eight CPU devices (for the multi-device tests), set before JAX is imported.
* ``jax_numpy_dtype_promotion="strict"``: no silent dtype promotion anywhere.
* ``maybe_jit``: run a test's function both eagerly and under ``jax.jit``.
* In CI (``CI=true``) tests marked ``torch`` may not be skipped: missing torch fails.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")


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


def import_torch():
  """Imports torch; skips the test outside CI if torch is missing, fails in CI."""
  try:
    import torch  # noqa: F401
  except ImportError:
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
      pytest.fail("torch is required in CI for the PyTorch conformance tests")
    pytest.skip("torch is not installed")
  return torch


def standard_promotion():
  """Standard dtype promotion, for third-party code that is not strict-clean.

  ``optax.adam`` computes ``b1 ** count`` (a Python float to an int32 power),
  which strict promotion rejects; use this context around steps that run Adam.
  jax_lossscale's own code runs under strict promotion everywhere else.
  """
  return jax.numpy_dtype_promotion("standard")
