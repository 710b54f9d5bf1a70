"""The dtype and configuration guarantees, checked at every entry point.

The entry points: the Optax wrappers (``dynamic_loss_scale``,
``static_loss_scale``, ``no_loss_scale``), ``multi_steps`` around a wrapper,
``jax_lossscale.flax.TrainState`` with its ``value_and_grad``, and a stock
``nnx.Optimizer`` around a wrapper. (One decision on many devices:
``tests/test_entry_points_one_decision.py``; the bit-exact skip: ``tests/test_skip.py`` and
``tests/test_sharding.py``.)
"""

from flax import nnx
from helpers import make_nnx_optimizer as make_optimizer
from helpers import nnx_update as _update
from helpers import standard_promotion
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_lossscale as jls
from jax_lossscale.flax import TrainState

SCALE = 2.0**8
OPTAX = {
  "dynamic_loss_scale": lambda **kw: jls.dynamic_loss_scale(
    optax.sgd(0.5, momentum=0.9), init_scale=SCALE, **kw
  ),
  "static_loss_scale": lambda **kw: jls.static_loss_scale(
    optax.sgd(0.5, momentum=0.9), kw.pop("scale", SCALE), **kw
  ),
  "no_loss_scale": lambda **kw: jls.no_loss_scale(optax.sgd(0.5, momentum=0.9), **kw),
  "multi_steps": lambda **kw: jls.multi_steps(
    jls.dynamic_loss_scale(optax.sgd(0.5, momentum=0.9), init_scale=SCALE, **kw), 1
  ),
}


def _params():
  return {"h": jnp.asarray([1.5, -2.0], jnp.float16), "f": jnp.asarray([0.25, 3.0], jnp.float32)}


def _assert_scale_state_dtypes(s):
  assert s.scale.dtype == jnp.float32 and s.scale.shape == ()
  for name in ("growth_tracker", "hysteresis_tracker", "skipped_steps", "consecutive_skips"):
    assert getattr(s, name).dtype == jnp.int32, name


def _loss(p):
  return jnp.sum(p["h"].astype(jnp.float32) ** 2) + jnp.sum(p["f"] ** 2)


@pytest.mark.parametrize("name", list(OPTAX))
def test_optax_entry_points_keep_dtypes(name):
  tx = OPTAX[name]()
  params = _params()
  state = tx.init(params)
  with standard_promotion():  # optax.MultiSteps mixes int32 and floats
    for bad in (False, True):
      grads = jax.grad(lambda p, s=state: jls.scale_loss(_loss(p), s))(params)
      if bad:
        grads = {**grads, "f": grads["f"].at[0].set(jnp.inf)}
      updates, state = jax.jit(tx.update)(grads, state, params)
      assert {k: u.dtype for k, u in updates.items()} == {"h": jnp.float16, "f": jnp.float32}
      params = optax.apply_updates(params, updates)
      assert {k: p.dtype for k, p in params.items()} == {"h": jnp.float16, "f": jnp.float32}
  _assert_scale_state_dtypes(jls.get_scale_state(state))
  assert int(jls.get_scale_state(state).skipped_steps) == 1
  momentum = jax.tree_util.tree_leaves(jls.get_inner_state(state))
  assert momentum and all(m.dtype == jnp.float32 for m in momentum)  # float32 for float16 params


def test_trainstate_keeps_dtypes():
  ts = TrainState.create(
    apply_fn=None,
    params=_params(),
    tx=optax.sgd(0.5, momentum=0.9),
    dynamic_scale=jls.DynamicScaleState.create(init_scale=SCALE),
  )

  @jax.jit
  def step(ts):
    out = ts.value_and_grad(_loss)(ts.params)
    assert all(g.dtype == jnp.float32 for g in jax.tree_util.tree_leaves(out.grads))
    return ts.apply_gradients(grads=out.grads, finite=out.finite)

  ts = step(ts)
  assert {k: p.dtype for k, p in ts.params.items()} == {"h": jnp.float16, "f": jnp.float32}
  assert all(m.dtype == jnp.float32 for m in jax.tree_util.tree_leaves(ts.opt_state))
  assert ts.step.dtype == jnp.int32
  _assert_scale_state_dtypes(ts.dynamic_scale)


class _Model(nnx.Module):
  def __init__(self):
    p = _params()
    self.h, self.f = nnx.Param(p["h"]), nnx.Param(p["f"])


def test_nnx_optimizer_keeps_dtypes():
  model = _Model()
  optimizer = make_optimizer(model, OPTAX["dynamic_loss_scale"]())

  @nnx.jit
  def step(model, optimizer):
    loss = lambda m: jls.scale_loss(_loss({"h": m.h[...], "f": m.f[...]}), optimizer.opt_state)
    _update(optimizer, model, nnx.grad(loss)(model))

  step(model, optimizer)
  assert model.h[...].dtype == jnp.float16 and model.f[...].dtype == jnp.float32
  assert not np.array_equal(np.asarray(model.f[...]), np.asarray(_params()["f"]))  # it stepped
  _assert_scale_state_dtypes(jls.get_scale_state(optimizer.opt_state))
  inner = jax.tree_util.tree_leaves(jls.get_inner_state(optimizer.opt_state))
  assert all(m.dtype == jnp.float32 for m in inner)


# -- a state of another configuration is refused -------------------------------------------

OTHER = {  # (the transformation that made the state, the one it is handed to)
  "dynamic_loss_scale": (dict(growth_interval=7), {}),
  "static_loss_scale": (dict(scale=4.0), {}),  # a static scaler's scale is its config
  "no_loss_scale": None,  # built with a dynamic scaler's state below
  "multi_steps": (dict(hysteresis=2), {}),
}


@pytest.mark.parametrize("name", list(OPTAX))
def test_optax_entry_points_refuse_a_state_of_another_config(name):
  params = _params()
  if OTHER[name] is None:
    state = OPTAX["dynamic_loss_scale"]().init(params)
    tx = OPTAX[name]()
  else:
    made_by, given_to = OTHER[name]
    state, tx = OPTAX[name](**made_by).init(params), OPTAX[name](**given_to)
  grads = jax.tree_util.tree_map(jnp.ones_like, params)
  with standard_promotion():  # optax.MultiSteps mixes int32 and floats
    with pytest.raises(ValueError, match="another configuration"):
      tx.update(grads, state, params)
    OPTAX[name]().update(grads, OPTAX[name]().init(params), params)  # its own state: accepted


def test_nnx_optimizer_refuses_a_state_of_another_config():
  model = _Model()
  optimizer = make_optimizer(model, OPTAX["dynamic_loss_scale"]())
  other = make_optimizer(_Model(), OPTAX["dynamic_loss_scale"](growth_interval=7))
  optimizer.opt_state = other.opt_state  # e.g. restored from another run's checkpoint
  grads = nnx.grad(lambda m: jnp.sum(m.f[...]))(model)
  with pytest.raises(ValueError, match="another configuration"):
    _update(optimizer, model, grads)


def test_trainstate_refuses_a_scaler_in_tx_and_a_foreign_dynamic_scale():
  with pytest.raises(ValueError, match="already holds a loss scaler"):
    TrainState.create(apply_fn=None, params=_params(), tx=OPTAX["static_loss_scale"]())
  with pytest.raises(TypeError, match="dynamic_scale must be a DynamicScaleState"):
    TrainState.create(apply_fn=None, params=_params(), tx=optax.sgd(1.0), dynamic_scale=SCALE)
