"""Flax NNX: a stock ``nnx.Optimizer`` around ``dynamic_loss_scale``."""

from flax import nnx
from helpers import make_nnx_optimizer as make_optimizer
from helpers import nnx_update as _update
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_lossscale as jls

#: ``nnx.as_pure`` (Flax >= 0.12.7), ``nnx.pure`` before it: the values out of a state.
_as_pure = getattr(nnx, "as_pure", None) or nnx.pure


class Model(nnx.Module):
  def __init__(self, rngs, dtype=jnp.float32):
    self.l1 = nnx.Linear(4, 8, dtype=dtype, param_dtype=dtype, rngs=rngs)
    self.l2 = nnx.Linear(8, 1, dtype=dtype, param_dtype=dtype, rngs=rngs)

  def __call__(self, x):
    return self.l2(nnx.relu(self.l1(x.astype(self.l1.kernel[...].dtype))))


def _data():
  x = jnp.asarray(np.random.default_rng(1).normal(size=(16, 4)), jnp.float32)
  return x, jnp.sum(x, axis=1, keepdims=True)


@nnx.jit
def train_step(model, optimizer, x, y):
  def loss_fn(model):
    loss = jnp.mean((model(x).astype(jnp.float32) - y) ** 2)
    return jls.scale_loss(loss, optimizer.opt_state), loss  # reads the current scale

  (_, loss), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
  _update(optimizer, model, grads)
  return loss, jls.metrics(optimizer.opt_state)


def _params(model):
  return [np.asarray(x) for x in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))]


def test_nnx_optimizer_trains_and_reads_the_scale():
  model = Model(nnx.Rngs(0))
  optimizer = make_optimizer(
    model, jls.dynamic_loss_scale(optax.sgd(0.05), init_scale=2.0**10, growth_interval=3)
  )
  assert float(jls.get_scale_state(optimizer.opt_state).scale) == 2.0**10
  assert float(jls.scale_loss(jnp.float32(0.5), optimizer.opt_state)) == 2.0**9
  x, y = _data()
  losses = []
  for _ in range(6):
    loss, m = train_step(model, optimizer, x, y)
    losses.append(float(loss))
  assert losses[-1] < losses[0]
  assert float(m["scale"]) == 2.0**12 and int(m["skipped_steps"]) == 0
  assert jls.torch.to_torch_state_dict(optimizer.opt_state)["scale"] == 2.0**12


def test_nnx_same_updates_as_unscaled_optimizer():
  model, ref_model = Model(nnx.Rngs(0)), Model(nnx.Rngs(0))
  optimizer = make_optimizer(model, jls.dynamic_loss_scale(optax.sgd(0.05), init_scale=2.0**8))
  ref_opt = make_optimizer(ref_model, optax.sgd(0.05))
  x, y = _data()
  train_step(model, optimizer, x, y)
  grads = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(ref_model)
  _update(ref_opt, ref_model, grads)
  for a, b in zip(_params(model), _params(ref_model)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_nnx_float16_overflow_skips_and_recovers():
  # float16 params and compute: 2**20 * loss overflows the float16 backward pass.
  model = Model(nnx.Rngs(0), dtype=jnp.float16)
  optimizer = make_optimizer(
    model, jls.dynamic_loss_scale(optax.sgd(0.01, momentum=0.9), init_scale=2.0**20)
  )
  inner_before = jax.tree_util.tree_leaves(_as_pure(optimizer.opt_state.inner_state))
  assert all(s.dtype == jnp.float32 for s in inner_before)  # promoted inner state
  x, y = _data()
  before = _params(model)
  _, m = train_step(model, optimizer, x, y)
  assert bool(m["last_step_skipped"]) and float(m["scale"]) == 2.0**19
  for a, b in zip(_params(model), before):
    assert a.dtype == np.float16 and a.tobytes() == b.tobytes()
  inner_after = jax.tree_util.tree_leaves(_as_pure(optimizer.opt_state.inner_state))
  for a, b in zip(inner_after, inner_before):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
  for _ in range(10):
    _, m = train_step(model, optimizer, x, y)
  assert not bool(m["last_step_skipped"])
  assert 0 < int(m["skipped_steps"]) < 11
  changed = [a.tobytes() != b.tobytes() for a, b in zip(_params(model), before)]
  assert all(changed)
  assert all(a.dtype == np.float16 for a in _params(model))
