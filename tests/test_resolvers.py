"""One resolver per concept, tested at every entry point that uses it.

* the scale of a ``ScaleLike``: ``_state.scale_of``;
* Flax's fp8 variables layout: ``_fp8.split_variables`` / ``join_variables`` (and
  ``has_fp8_meta`` for meta at any depth);
* the saturating step increment: ``optax.safe_int32_increment``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_lossscale as jls
from jax_lossscale._scaler._state import scale_of
from jax_lossscale.diagnostics import check_underflow
from jax_lossscale.diagnostics import grad_diagnostics

G = {"w": jnp.array([2048.0, -1024.0])}
TX = jls.dynamic_loss_scale(optax.sgd(1.0), init_scale=1024.0)


def _sources():
  state = TX.init(G)
  return {
    "a Python float": 1024.0,
    "an int": 1024,
    "a float32 array": jnp.float32(1024.0),
    "a float16 array": np.float16(1024.0),
    "a DynamicScaleState": jls.get_scale_state(state),
    "an optimizer state": state,
    "a multi_steps state": jls.multi_steps(TX, 2).init(G),
  }


def _entry_points():
  def unscale(s):
    return jls.unscale_and_check(G, s)[0]["w"]

  def scale_loss(s):
    return jls.scale_loss(jnp.float32(2.0), s)

  def underflow(s):
    return check_underflow(lambda p, b, dt: jnp.sum(p["w"]), G, None, scale=s).scale

  def diagnostics(s):
    return grad_diagnostics(G, s)["w/max_abs"]

  return {
    "unscale_and_check": (unscale, jnp.array([2.0, -1.0])),
    "scale_loss": (scale_loss, jnp.float32(2048.0)),
    "check_underflow": (underflow, jnp.float32(1024.0)),
    "grad_diagnostics": (diagnostics, jnp.float32(2.0)),
  }


@pytest.mark.parametrize("entry", list(_entry_points()))
@pytest.mark.parametrize("source", list(_sources()))
def test_every_scale_source_gives_the_same_scale_at_every_entry_point(entry, source):
  fn, want = _entry_points()[entry]
  s = _sources()[source]
  np.testing.assert_array_equal(np.asarray(fn(s)), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(jax.jit(fn)(s)), np.asarray(want))


@pytest.mark.parametrize("entry", list(_entry_points()))
def test_a_state_with_two_scalers_or_none_is_refused_at_every_entry_point(entry):
  fn, _ = _entry_points()[entry]
  two = optax.multi_transform({"a": TX, "b": TX}, {"w": "a", "v": "b"})
  state = two.init({"w": G["w"], "v": G["w"]})
  with pytest.raises(ValueError, match=r"holds 2 loss scalers.*ONE dynamic_loss_scale"):
    fn(state)
  with pytest.raises(ValueError, match="No DynamicScaleState found"):
    fn(optax.sgd(1.0).init(G))


def test_scale_of_is_float32():
  assert scale_of(3).dtype == jnp.float32
  assert scale_of(np.float16(2.0)).dtype == jnp.float32


def test_the_fp8_layout_is_split_and_joined_in_one_place():
  from jax_lossscale._scaler._fp8 import FP8_META
  from jax_lossscale._scaler._fp8 import has_fp8_meta
  from jax_lossscale._scaler._fp8 import join_variables
  from jax_lossscale._scaler._fp8 import split_variables

  p, m = {"w": jnp.ones(2)}, {"amax": jnp.zeros(3)}
  variables = {"params": p, FP8_META: m}
  assert split_variables(variables) == (p, m)
  assert split_variables(p) == (p, None)
  assert join_variables(p, m) == variables and join_variables(p, None) is p
  assert has_fp8_meta({"model": variables}) and not has_fp8_meta(p)


INT32_MAX = np.iinfo(np.int32).max


def test_step_and_skip_counters_saturate_at_the_int32_maximum():
  import jax_lossscale.flax as jflax

  ds = jls.DynamicScaleState.create()
  ds = ds.replace(skipped_steps=jnp.int32(INT32_MAX), consecutive_skips=jnp.int32(INT32_MAX))
  after = jls.update_scale(ds, jnp.bool_(False))
  assert int(after.skipped_steps) == int(after.consecutive_skips) == INT32_MAX
  state = jflax.TrainState.create(apply_fn=None, params=G, tx=optax.sgd(1.0))
  state = state.replace(step=jnp.int32(INT32_MAX))
  state = state.apply_gradients(grads=G)
  assert int(state.step) == INT32_MAX  # saturates as optax's counters do, no wrap to -2**31
