"""One resolver of a ``ScaleLike`` (``_state.scale_of``), at every entry point taking a scale."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_lossscale as jls
from jax_lossscale._state import scale_of
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
