"""Flax fp8 meta-state (the ``_overwrite_with_gradient`` collection) is never a gradient.

``nn.Fp8DirectDotGeneralOp`` returns its new fp8 scales and amax histories as
the cotangents of its ``_overwrite_with_gradient`` variables, and
``apply_gradients`` overwrites the old ones with them. They are not multiplied
by the loss scale in the backward pass, so a loss scaler must neither unscale
them nor count an inf in them as an overflow.
"""

import flax.linen as nn
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
from flax.training import train_state
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_lossscale as jls
from jax_lossscale._scaler._fp8 import FP8_META
from jax_lossscale.flax import TrainState

SCALE = 2.0**10


def test_the_collection_name_is_flaxs():
  assert FP8_META == OVERWRITE_WITH_GRADIENT


def _problem():
  model = nn.Dense(4, dot_general_cls=nn.Fp8DirectDotGeneralOp)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(16, 8)), jnp.float32)
  y = jnp.asarray(rng.normal(size=(16, 4)), jnp.float32)
  variables = model.init(jax.random.key(0), x)
  loss_fn = lambda v: jnp.mean((model.apply(v, x) - y) ** 2)
  return model, variables, loss_fn


def _unscaled_reference(steps=4):
  """Flax's stock TrainState on the unscaled loss: no loss scaler anywhere."""
  model, variables, loss_fn = _problem()
  ref = train_state.TrainState.create(apply_fn=model.apply, params=variables, tx=optax.sgd(0.1))

  @jax.jit
  def step(ref):
    return ref.apply_gradients(grads=jax.grad(loss_fn)(ref.params))

  for _ in range(steps):
    ref = step(ref)
  return ref.params


def _check_against_reference(params, ref):
  """Params and the forward fp8 meta bit for bit; the gradient meta exactly SCALE times."""
  assert set(params) == {"params", OVERWRITE_WITH_GRADIENT}
  np.testing.assert_array_equal(params["params"]["kernel"], ref["params"]["kernel"])
  np.testing.assert_array_equal(params["params"]["bias"], ref["params"]["bias"])
  meta, ref_meta = params[OVERWRITE_WITH_GRADIENT], ref[OVERWRITE_WITH_GRADIENT]
  op, ref_op = meta["Fp8DirectDotGeneralOp_0"], ref_meta["Fp8DirectDotGeneralOp_0"]
  for name in ("input_scale", "input_amax_history", "kernel_scale", "kernel_amax_history"):
    np.testing.assert_array_equal(op[name], ref_op[name], err_msg=name)
  assert float(op["input_scale"][0]) != 1.0  # the meta did move (not a stale init)
  # The output-gradient meta records the gradients the backward pass quantized:
  # the scaled ones, exactly SCALE (a power of two) times the unscaled run's.
  for name in ("output_grad_scale", "output_grad_amax_history"):
    np.testing.assert_array_equal(op[name], np.asarray(ref_op[name]) * np.float32(SCALE))


def test_fp8_dense_trains_through_trainstate_as_without_scaling():
  model, variables, loss_fn = _problem()
  state = TrainState.create(
    apply_fn=model.apply,
    params=variables,
    tx=optax.sgd(0.1),
    dynamic_scale=jls.DynamicScaleState.create(init_scale=SCALE),
  )

  @jax.jit
  def step(state):
    out = state.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=out.grads, finite=out.finite), out.finite

  for _ in range(4):
    state, finite = step(state)
    assert bool(finite)
  assert int(state.step) == 4 and float(state.dynamic_scale.scale) == SCALE
  _check_against_reference(state.params, _unscaled_reference())


def test_the_optimizer_state_covers_the_params_not_the_fp8_meta():
  # The momentum is built for variables["params"] only, as Flax's TrainState does, and a
  # step updates it.
  model, variables, loss_fn = _problem()
  tx = optax.sgd(0.1, momentum=0.9)
  state = TrainState.create(apply_fn=model.apply, params=variables, tx=tx)
  trace = state.opt_state[0].trace
  assert jax.tree_util.tree_structure(trace) == jax.tree_util.tree_structure(variables["params"])
  out = state.value_and_grad(loss_fn)(state.params)
  new = state.apply_gradients(grads=out.grads, finite=out.finite)
  assert int(new.step) == 1
  np.testing.assert_array_equal(new.opt_state[0].trace["bias"], out.grads["params"]["bias"])


def test_fp8_dense_trains_through_stock_trainstate_and_dynamic_loss_scale():
  # The scaler inside the optimizer: Flax's apply_gradients strips the fp8 meta
  # before tx.update, and jax.grad never scales it.
  model, variables, loss_fn = _problem()
  tx = jls.dynamic_loss_scale(optax.sgd(0.1), init_scale=SCALE)
  state = train_state.TrainState.create(apply_fn=model.apply, params=variables, tx=tx)

  @jax.jit
  def step(state):
    grads = jax.grad(lambda v: jls.scale_loss(loss_fn(v), state))(state.params)
    return state.apply_gradients(grads=grads)

  for _ in range(4):
    state = step(state)
  assert int(jls.metrics(state)["skipped_steps"]) == 0
  _check_against_reference(state.params, _unscaled_reference())


def _meta_op(w, m):
  """``w * 2``, whose backward pass returns ``m_new`` as the cotangent of ``m`` (as fp8 ops do)."""
  return w * 2.0


_meta_op = jax.custom_vjp(_meta_op)
_meta_op.defvjp(lambda w, m: (w * 2.0, None), lambda _, g: (g * 2.0, jnp.full((2,), jnp.inf)))


def _meta_loss(v):
  return jnp.sum(_meta_op(v["params"]["w"], v[OVERWRITE_WITH_GRADIENT]["amax"]))


def _meta_variables():
  return {
    "params": {"w": jnp.ones(2, jnp.float32)},
    OVERWRITE_WITH_GRADIENT: {"amax": jnp.zeros(2, jnp.float32)},
  }


def test_an_inf_in_the_fp8_meta_is_not_an_overflow():
  state = TrainState.create(
    apply_fn=None,
    params=_meta_variables(),
    tx=optax.sgd(1.0),
    dynamic_scale=jls.DynamicScaleState.create(init_scale=SCALE),
  )
  out = state.value_and_grad(_meta_loss)(state.params)
  assert bool(out.finite)
  np.testing.assert_array_equal(out.grads["params"]["w"], [2.0, 2.0])
  np.testing.assert_array_equal(out.grads[OVERWRITE_WITH_GRADIENT]["amax"], [np.inf, np.inf])
  for finite in (out.finite, None):  # given, or computed by apply_gradients
    new = state.apply_gradients(grads=out.grads, finite=finite)
    assert int(new.step) == 1
    np.testing.assert_array_equal(new.params["params"]["w"], [-1.0, -1.0])
    np.testing.assert_array_equal(new.params[OVERWRITE_WITH_GRADIENT]["amax"], [np.inf] * 2)


def test_fp8_meta_is_combined_with_pmax_under_axis_name():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("d",))
  P = jax.sharding.PartitionSpec
  ds = jls.DynamicScaleState.create(init_scale=SCALE)

  def op(w, m):
    return w * 2.0

  op = jax.custom_vjp(op)
  # The new "amax" is this device's own value: devices disagree before the pmax.
  op.defvjp(lambda w, m: (w * 2.0, w), lambda w, g: (g * 2.0, w))

  def per_device(w, m):
    loss = lambda v: jnp.sum(op(v["params"]["w"], v[OVERWRITE_WITH_GRADIENT]["amax"]))
    v = {"params": {"w": w}, OVERWRITE_WITH_GRADIENT: {"amax": m}}
    out = jls.flax.value_and_grad(loss, ds, axis_name="d")(v)
    return out.grads["params"]["w"], out.grads[OVERWRITE_WITH_GRADIENT]["amax"]

  f = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P("d"), P("d")), out_specs=P("d")))
  w = jnp.asarray([1.0, 5.0, 3.0, 2.0], jnp.float32)
  g, amax = f(w, jnp.zeros(4, jnp.float32))
  np.testing.assert_array_equal(g, [2.0] * 4)
  np.testing.assert_array_equal(amax, [5.0] * 4)  # the largest, not 5 / SCALE, not a mean


def test_the_optax_wrappers_refuse_fp8_meta():
  grads = jax.grad(_meta_loss)(_meta_variables())
  for tx in (
    jls.dynamic_loss_scale(optax.sgd(1.0)),
    jls.static_loss_scale(optax.sgd(1.0), 4.0),
    jls.no_loss_scale(optax.sgd(1.0)),
  ):
    state = tx.init(_meta_variables())
    with pytest.raises(ValueError, match="fp8 meta-state"):
      tx.update(grads, state, _meta_variables())
