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


def _params_only(d):
  return {k: v for k, v in d.items() if not k.startswith("activations/")}


def _same(a, b):
  """The same report for the params (an autocast report also has its automatic taps)."""
  for field in ("nonzero", "lost_unscaled", "lost_scaled"):
    ga, gb = _params_only(getattr(a, field)), getattr(b, field)
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
  assert _params_only(got.fractions()) == {"b": 1.0, "w": 1.0}
  assert _params_only(got.fractions(scaled=True)) == {"b": 0.0, "w": 0.0}
  assert got.needs_loss_scaling()


def _logits_model(p, batch):
  # The logits' per-element gradients are c: half of them (1e-9) flush in float16. Each
  # weight-gradient element sums over the batch, and half of its terms survive.
  x, c = batch
  return jnp.sum((x @ p["w"]) * c)


def _logits_by_hand(p, batch, dtype, taps):
  x, c = batch
  logits = x.astype(dtype) @ p["w"].astype(dtype) + taps["logits"].astype(dtype)
  return jnp.sum(logits.astype(jnp.float32) * c)


W = {"w": jnp.asarray([[1.0, -0.5], [0.25, 2.0]])}


def test_an_autocast_function_sees_its_logits_without_taps(maybe_jit):
  """The outputs of the lower-precision ops are tapped: the logits' loss is reported."""
  amp = jls.autocast(_logits_model)
  r = maybe_jit(lambda p, b: check_underflow(amp, p, b))(W, (X, C))
  want = check_underflow(_logits_by_hand, W, (X, C), activations={"logits": jnp.zeros((8, 2))})
  assert r.fractions() == {"activations/dot_general#0": 0.5, "w": 0.0}
  assert want.fractions()["activations/logits"] == 0.5
  assert int(r.nonzero["activations/dot_general#0"]) == int(want.nonzero["activations/logits"])
  assert r.needs_loss_scaling()
  assert r.fractions(scaled=True)["activations/dot_general#0"] == 0.0


def test_a_float32_tap_inside_an_autocast_function_measures_the_float16_gradient():
  """``h + taps[...]`` with a float32 tap: the tap takes h's float16, not the reverse."""

  def tapped(p, batch, taps):
    x, c = batch
    return jnp.sum((x @ p["w"] + taps["logits"]) * c)

  amp = jls.autocast(tapped)
  r = check_underflow(amp, W, (X, C), activations={"logits": jnp.zeros((8, 2))})
  assert r.fractions()["activations/logits"] == 0.5  # 0.0 if the tap promoted h
  # the automatic tap of the same output is not counted again
  assert r.looked_at()["activations"] == ["activations/logits"]


def test_flax_perturbations_inside_an_autocast_function_measure_the_float16_gradient():
  import flax.linen as nn

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x, c):
      logits = self.perturb("logits", nn.Dense(2, use_bias=False)(x))
      return jnp.sum(logits * c)

  model = Model()
  variables = model.init(jax.random.key(0), X, C)
  variables = {
    "params": {"Dense_0": {"kernel": W["w"]}},
    "perturbations": variables["perturbations"],
  }
  amp = jls.autocast(lambda v, batch: model.apply(v, *batch))
  r = check_underflow(amp, variables, (X, C))
  assert r.fractions()["perturbations/logits"] == 0.5


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
  assert _params_only(got.fractions()) == {"b": lost, "w": lost}


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
