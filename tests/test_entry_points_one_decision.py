"""One skip decision on many devices, for every entry point that takes ``axis_name``.

Per-device code (``shard_map`` with per-device gradients, as under ``pmap``):
one device's data holds an inf. With ``axis_name`` every device skips the
step together and the replicas stay identical; without it (the control)
only that device skips, so the test can tell the two apart.
"""

from flax import nnx
from helpers import make_nnx_optimizer as make_optimizer
from helpers import nnx_update as _update
from helpers import standard_promotion
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import jax_lossscale as jls
from jax_lossscale.flax import TrainState

N_DEV = 8
BAD_DEVICE = 5

pytestmark = pytest.mark.skipif(jax.device_count() < N_DEV, reason="needs 8 devices (conftest)")


def _optax_entry(make_tx):
  """A per-device step with an Optax wrapper: (skipped_steps, new w) of this device."""

  def per_device(axis_name):
    tx = make_tx(axis_name)

    def step(w, x):
      params = {"w": w}
      state = tx.init(params)
      grads = jax.grad(lambda p: jls.scale_loss(jnp.sum(p["w"] * x), state))(params)
      with standard_promotion():  # optax.MultiSteps mixes int32 and floats
        updates, state = tx.update(grads, state, params)
      new = optax.apply_updates(params, updates)
      return jls.get_scale_state(state).skipped_steps[None], new["w"]

    return step

  return per_device


def _trainstate_entry(axis_name):
  def step(w, x):
    state = TrainState.create(apply_fn=None, params={"w": w}, tx=optax.sgd(1.0))
    out = state.value_and_grad(lambda p: jnp.sum(p["w"] * x), axis_name=axis_name)(state.params)
    new = state.apply_gradients(grads=out.grads, finite=out.finite)
    return new.dynamic_scale.skipped_steps[None], new.params["w"]

  return step


def _value_and_grad_entry(axis_name):
  ds = jls.DynamicScaleState.create(init_scale=4.0)

  def step(w, x):
    out = jls.flax.value_and_grad(lambda w: jnp.sum(w * x), ds, axis_name=axis_name)(w)
    skipped = jnp.where(out.finite, 0, 1).astype(jnp.int32)[None]
    return skipped, jnp.where(out.finite, w - out.grads, w)

  return step


class _Linear(nnx.Module):
  def __init__(self, w):
    self.w = nnx.Param(w)


def _nnx_entry(axis_name):
  tx = jls.dynamic_loss_scale(optax.sgd(1.0), init_scale=4.0, axis_name=axis_name)

  def step(w, x):
    model = _Linear(w)
    optimizer = make_optimizer(model, tx)
    loss = lambda m: jls.scale_loss(jnp.sum(m.w[...] * x), optimizer.opt_state)
    grads = nnx.grad(loss)(model)
    _update(optimizer, model, grads)
    return jls.get_scale_state(optimizer.opt_state).skipped_steps[None], model.w[...]

  return step


ENTRIES = {
  "dynamic_loss_scale": _optax_entry(
    lambda a: jls.dynamic_loss_scale(optax.sgd(1.0), init_scale=4.0, axis_name=a)
  ),
  "static_loss_scale": _optax_entry(
    lambda a: jls.static_loss_scale(optax.sgd(1.0), 4.0, axis_name=a)
  ),
  "no_loss_scale": _optax_entry(lambda a: jls.no_loss_scale(optax.sgd(1.0), axis_name=a)),
  "multi_steps": _optax_entry(
    lambda a: jls.multi_steps(jls.dynamic_loss_scale(optax.sgd(1.0), axis_name=a), 1)
  ),
  "flax.TrainState.value_and_grad": _trainstate_entry,
  "flax.value_and_grad": _value_and_grad_entry,
  "nnx.Optimizer": _nnx_entry,
}


def _run(entry, axis_name):
  mesh = jax.make_mesh((N_DEV,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
  f = jax.jit(
    jax.shard_map(
      entry(axis_name),
      mesh=mesh,
      in_specs=(P(), P("d")),
      out_specs=(P("d"), P("d")),
      check_vma=False,  # per-device gradients of the replicated w, as under pmap
    )
  )
  w = jnp.ones(2, jnp.float32)
  x = jnp.ones((N_DEV, 2), jnp.float32).at[BAD_DEVICE, 1].set(jnp.inf)
  with jax.set_mesh(mesh):
    skipped, new_w = f(w, jax.device_put(x, jax.NamedSharding(mesh, P("d"))))
  return np.asarray(skipped), np.asarray(new_w).reshape(N_DEV, 2)


@pytest.mark.parametrize("name", list(ENTRIES))
def test_every_device_skips_together_with_axis_name(name):
  skipped, new_w = _run(ENTRIES[name], "d")
  np.testing.assert_array_equal(skipped, [1] * N_DEV)
  np.testing.assert_array_equal(new_w, np.ones((N_DEV, 2), np.float32))  # nobody moved


@pytest.mark.parametrize("name", list(ENTRIES))
def test_without_axis_name_only_the_bad_device_skips(name):
  """The control: the test above can tell a combined decision from a local one."""
  skipped, new_w = _run(ENTRIES[name], None)
  want = np.zeros(N_DEV, np.int32)
  want[BAD_DEVICE] = 1
  np.testing.assert_array_equal(skipped, want)
  assert not np.array_equal(new_w[0], np.ones(2, np.float32))  # the others stepped
