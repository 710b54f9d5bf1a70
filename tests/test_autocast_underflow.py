"""check_underflow given an autocast function: no dtype parameter, the hand-cast report."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_lossscale as jls
from jax_lossscale.diagnostics import check_underflow

X = jnp.linspace(0.5, 1.5, 16).reshape(8, 2)
C = jnp.tile(jnp.array([[1e-9], [1e-3]]), (4, 2))  # half of the per-element gradients flush
TINY = jnp.full((8, 2), 1e-9)  # every gradient flushes in float16 without scaling
PARAMS = {"w": jnp.asarray([[1.0, -0.5], [0.25, 2.0]]), "b": jnp.asarray([0.1, -0.2])}


def _model(p, batch):
  x, c = batch
  return jnp.sum(jax.nn.relu(x @ p["w"] + p["b"]) * c)


def _by_hand(p, batch, dtype):
  x, c = batch
  h = x.astype(dtype) @ p["w"].astype(dtype) + p["b"].astype(dtype)
  return jnp.sum(jax.nn.relu(h).astype(jnp.float32) * c)


def _same(a, b):
  for field in ("nonzero", "lost_unscaled", "lost_scaled"):
    ga, gb = getattr(a, field), getattr(b, field)
    assert ga.keys() == gb.keys()
    for k in ga:
      assert int(ga[k]) == int(gb[k]), (field, k)
  assert bool(a.finite_unscaled) == bool(b.finite_unscaled)
  assert bool(a.finite_scaled) == bool(b.finite_scaled)


def test_an_autocast_function_gives_the_hand_cast_report(maybe_jit):
  amp = jls.autocast(_model)
  got = maybe_jit(lambda p, b: check_underflow(amp, p, b))(PARAMS, (X, TINY))
  want = check_underflow(_by_hand, PARAMS, (X, TINY))
  _same(got, want)
  assert got.fractions() == {"b": 1.0, "w": 1.0}
  assert got.fractions(scaled=True) == {"b": 0.0, "w": 0.0}
  assert got.needs_loss_scaling()


def test_taps_are_refused_with_an_autocast_function():
  """A float32 tap would promote the activation to float32: the wrong gradient, refused."""
  amp = jls.autocast(_model)
  with pytest.raises(ValueError, match="activations: taps need a dtype-parameterized"):
    check_underflow(amp, PARAMS, (X, C), activations={"logits": jnp.zeros((8, 2))})
  with pytest.raises(ValueError, match="activations: taps need a dtype-parameterized"):
    check_underflow(amp, {"params": PARAMS, "perturbations": {}}, (X, C))


@pytest.mark.parametrize(
  "made, given, used",
  [
    (jnp.bfloat16, None, jnp.bfloat16),  # the autocast function's own dtype
    (jnp.float16, jnp.bfloat16, jnp.bfloat16),  # half_dtype= wins
    (jnp.float32, None, jnp.float16),  # a float32 autocast: float16, as for any loss_fn
  ],
)
def test_the_half_dtype_of_an_autocast_function(made, given, used):
  # TINY: float16 flushes every gradient element without scaling, bfloat16 none.
  got = check_underflow(jls.autocast(_model, made), PARAMS, (X, TINY), half_dtype=given)
  _same(got, check_underflow(_by_hand, PARAMS, (X, TINY), half_dtype=used))
  lost = 1.0 if used == jnp.float16 else 0.0
  assert got.fractions() == {"b": lost, "w": lost}


def test_the_policy_of_an_autocast_function_is_kept():
  """dot_general forced to float32: the model runs in float32, nothing flushes (1.0 without)."""
  amp = jls.autocast(_model, policy={"dot_general": "float32"})
  assert check_underflow(amp, PARAMS, (X, TINY)).fractions() == {"b": 0.0, "w": 0.0}


def test_the_spec_records_fun_dtype_and_policy():
  policy = {"exp": "lower"}
  amp = jls.autocast(_model, jnp.bfloat16, policy)
  assert amp.autocast_spec.fun is _model
  assert amp.autocast_spec.dtype == np.dtype(jnp.bfloat16)
  assert amp.autocast_spec.policy is policy


def test_the_reference_runs_the_function_as_written():
  """Not ``autocast(f, float32)``: a float16 input the model does not cast stays float16 there.

  ``exp`` of the float16 batch runs in float16 in ``f`` itself, where ``exp(-20) ~ 2e-9`` is 0:
  that element's gradient is 0 in the reference and is not counted (autocast's float32 ``exp``
  would keep it, and the half backwards, which run ``exp`` in float32, keep it too).
  """
  amp = jls.autocast(lambda p, x: jnp.sum(jnp.exp(x).astype(jnp.float32) * p["w"]))
  r = check_underflow(amp, {"w": jnp.ones(2)}, jnp.array([-20.0, 0.0], jnp.float16))
  assert {k: int(v) for k, v in r.nonzero.items()} == {"w": 1}
  assert r.fractions() == r.fractions(scaled=True) == {"w": 0.0}
