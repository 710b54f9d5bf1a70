"""Equinox: filter_value_and_grad of a scaled loss, filtered params, skip bit for bit."""

import equinox as eqx
from helpers import assert_bits_equal
from helpers import standard_promotion
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_lossscale as jls

D, HIDDEN = 4, 8


def _model(dtype):
  model = eqx.nn.MLP(D, 1, HIDDEN, depth=1, activation=jax.nn.relu, key=jax.random.key(0))
  model = jax.tree_util.tree_map(lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, model)
  # A -0.0 and a float16 subnormal (2**-20; a normal float32) among the params.
  w = model.layers[0].weight.at[0, 0].set(-0.0).at[0, 1].set(2.0**-20)
  return eqx.tree_at(lambda m: m.layers[0].weight, model, w)


def _loss(model, x, y):
  half = jax.tree_util.tree_map(
    lambda a: a.astype(jnp.float16) if eqx.is_inexact_array(a) else a, model
  )
  pred = jax.vmap(half)(x.astype(jnp.float16)).astype(jnp.float32)
  return jnp.mean(jnp.square(pred - y))


def _assert_bit_identical(a, b):
  """The arrays of ``a`` and ``b`` (a module's other leaves left out), bit for bit."""
  assert_bits_equal(eqx.filter(a, eqx.is_array), eqx.filter(b, eqx.is_array))


def _step_fn(tx):
  @eqx.filter_jit
  def step(model, opt_state, x, y):
    def scaled(m):
      loss = _loss(m, x, y)
      return jls.scale_loss(loss, opt_state), loss

    (_, _), grads = eqx.filter_value_and_grad(scaled, has_aux=True)(model)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, updates, grads

  return step


def _data(scale_x=1.0):
  k1, k2 = jax.random.split(jax.random.key(1))
  x = jax.random.normal(k1, (16, D)) * np.float32(scale_x)
  return x, jax.random.normal(k2, (16, 1))


def test_filter_value_and_grad_of_scaled_loss_is_scale_times_the_gradient():
  model = _model(jnp.float32)
  x, y = _data()
  state = jls.DynamicScaleState.create(init_scale=2.0**10)
  (scaled, loss), g = eqx.filter_value_and_grad(
    lambda m: (jls.scale_loss(_loss(m, x, y), state), _loss(m, x, y)), has_aux=True
  )(model)
  assert scaled.dtype == jnp.float32 and float(scaled) == float(loss) * 2.0**10
  # Non-array fields (the activation function) get no gradient.
  assert g.activation is None
  g1 = eqx.filter_grad(_loss)(model, x, y)
  # The float16 backward of the scaled loss keeps more bits, so compare to
  # float16 precision; the grads have the model's structure and dtypes.
  for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(g1)):
    assert a.dtype == b.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(a) / 2.0**10, np.asarray(b), rtol=2e-3, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16], ids=["f32", "f16"])
def test_skipped_step_leaves_model_and_optimizer_state_bit_identical(dtype):
  model = _model(dtype)
  params = eqx.filter(model, eqx.is_array)
  tx = jls.dynamic_loss_scale(optax.adam(1e-2), init_scale=2.0**8, growth_interval=100)
  opt_state = tx.init(params)
  step = _step_fn(tx)
  x, y = _data()
  with standard_promotion():  # optax.adam
    # Two clean steps so Adam's moments and count are non-trivial.
    for _ in range(2):
      model, opt_state, _, _ = step(model, opt_state, x, y)
    assert int(jls.get_scale_state(opt_state).skipped_steps) == 0
    # Put the -0.0 and the subnormal back right before the overflowing step.
    w = model.layers[0].weight.at[0, 0].set(-0.0).at[0, 1].set(2.0**-20)
    if dtype == jnp.float32:  # and a float32 subnormal
      w = w.at[0, 2].set(np.float32(1e-40))
    model = eqx.tree_at(lambda m: m.layers[0].weight, model, w)
    before_model, before_inner = model, opt_state.inner_state
    # Inputs of 1e4: the scaled float16 backward overflows.
    new_model, opt_state, updates, grads = step(model, opt_state, *_data(1e4))
  assert not bool(jls.all_finite(grads))
  s = jls.get_scale_state(opt_state)
  assert int(s.skipped_steps) == 1 and float(s.scale) == 2.0**7
  _assert_bit_identical(new_model, before_model)
  _assert_bit_identical(opt_state.inner_state, before_inner)
  w = np.asarray(new_model.layers[0].weight)
  assert w.dtype == dtype
  assert np.signbit(w[0, 0]) and w[0, 0] == 0
  assert w[0, 1] == 2.0**-20
  if dtype == jnp.float16:
    assert np.asarray(w[0, 1]).view(np.uint16) == 0x0010  # a float16 subnormal, bit for bit
  else:
    # A float32 subnormal survives too: XLA folds apply_updates' add of -0.0
    # into the skip's select inside the one filter_jit step.
    assert np.asarray(w[0, 2]).view(np.uint32) == np.float32(1e-40).view(np.uint32) != 0
  for u in jax.tree_util.tree_leaves(updates):
    assert np.all(np.signbit(np.asarray(u))) and not np.any(np.asarray(u))  # -0.0


def test_clean_steps_train_like_plain_adam_on_unscaled_grads():
  model = _model(jnp.float32)
  params = eqx.filter(model, eqx.is_array)
  tx = jls.dynamic_loss_scale(optax.adam(1e-2), init_scale=2.0**4)
  step = _step_fn(tx)
  opt_state = tx.init(params)
  x, y = _data()
  plain = optax.adam(1e-2)
  p_state = plain.init(params)
  with standard_promotion():
    for _ in range(3):
      new_model, opt_state, updates, grads = step(model, opt_state, x, y)
      g = jax.tree_util.tree_map(lambda a: a / np.float32(2.0**4), grads)
      ref_updates, p_state = plain.update(g, p_state, eqx.filter(model, eqx.is_array))
      # Same values up to the rounding of a differently fused Adam (eager here).
      for a, b in zip(jax.tree_util.tree_leaves(updates), jax.tree_util.tree_leaves(ref_updates)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=0)
      model = new_model
  assert int(jls.get_scale_state(opt_state).skipped_steps) == 0


def test_example_trains_and_reports():
  import importlib.util
  import pathlib

  path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "equinox_mlp.py"
  spec = importlib.util.spec_from_file_location("equinox_mlp", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  with standard_promotion():
    assert module.main(["--steps", "40"]) == 0
