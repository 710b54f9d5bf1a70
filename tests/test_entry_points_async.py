"""No host syncs: every train-step path dispatches asynchronously.

On CPU ``jax.transfer_guard_device_to_host("disallow")`` never fires for
computations that stay on the device, so asynchrony is also proven directly:
a long-running jitted computation produces the batch of the first step, so
every step depends on it; a Python loop of steps that returns while that
computation (and therefore the final state) is still running cannot have
waited for any device value.
"""

import time

import flax.linen as nn
from helpers import calibrated_iterations
from helpers import slow_batch
import jax
import jax.numpy as jnp
import optax
import pytest

import jax_lossscale as jls
from jax_lossscale.flax import TrainState

N_STEPS = 5
WIDTH = 16


class _MLP(nn.Module):
  """A float16-compute MLP with float32 params (linen)."""

  @nn.compact
  def __call__(self, x):
    x = nn.tanh(nn.Dense(WIDTH, dtype=jnp.float16, param_dtype=jnp.float32)(x))
    return nn.Dense(1, dtype=jnp.float16, param_dtype=jnp.float32)(x)


def _loss(y):
  return jnp.mean(jnp.square(y.astype(jnp.float32)))


def _optax_path():
  """``dynamic_loss_scale`` as an Optax transformation in a jitted step."""
  tx = jls.dynamic_loss_scale(optax.sgd(1e-3, momentum=0.9), init_scale=2.0**10)
  params = {
    "w": jnp.full((WIDTH, 1), 0.1, jnp.float32),
    "b": jnp.zeros((1,), jnp.float32),
  }

  def step(state, x):
    params, opt_state = state

    def scaled(p):
      y = x.astype(jnp.float16) @ p["w"].astype(jnp.float16) + p["b"].astype(jnp.float16)
      return jls.scale_loss(_loss(y), opt_state)

    grads = jax.grad(scaled)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return (params, tx.init(params)), step


def _linen_trainstate_path():
  """Flax's stock ``TrainState`` with ``dynamic_loss_scale`` as ``tx``."""
  from flax.training import train_state

  model = _MLP()
  params = model.init(jax.random.key(0), jnp.zeros((4, WIDTH), jnp.float16))
  state = train_state.TrainState.create(
    apply_fn=model.apply,
    params=params,
    tx=jls.dynamic_loss_scale(optax.sgd(1e-3, momentum=0.9), init_scale=2.0**10),
  )
  # Flax starts `step` as a Python int; an array keeps the jitted signature fixed.
  state = state.replace(step=jnp.zeros([], jnp.int32))

  def step(state, x):
    def scaled(p):
      return jls.scale_loss(_loss(state.apply_fn(p, x.astype(jnp.float16))), state)

    grads = jax.grad(scaled)(state.params)
    return state.apply_gradients(grads=grads)

  return state, step


def _linen_scaler_field_path():
  """``jax_lossscale.flax.TrainState``: the scaler as a TrainState field."""
  model = _MLP()
  params = model.init(jax.random.key(0), jnp.zeros((4, WIDTH), jnp.float16))
  state = TrainState.create(
    apply_fn=model.apply,
    params=params,
    tx=optax.sgd(1e-3, momentum=0.9),
    dynamic_scale=jls.DynamicScaleState.create(init_scale=2.0**10),
  )

  def step(state, x):
    out = state.value_and_grad(lambda p: _loss(state.apply_fn(p, x.astype(jnp.float16))))(
      state.params
    )
    return state.apply_gradients(grads=out.grads, finite=out.finite)

  return state, step


PATHS = {
  "optax": _optax_path,
  "linen_trainstate": _linen_trainstate_path,
  "linen_scaler_field": _linen_scaler_field_path,
}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_step_loop_does_not_wait_for_the_device(path):
  state, step = PATHS[path]()
  step = jax.jit(step, donate_argnums=(0,))
  x = jnp.ones((4, WIDTH), jnp.float32)
  # Compile and run once outside the measured loop.
  state = step(state, x)
  jax.block_until_ready(state)
  n = calibrated_iterations(x)

  t0 = time.perf_counter()
  slow = slow_batch(x, n)
  with jax.transfer_guard_device_to_host("disallow"):
    for _ in range(N_STEPS):
      state = step(state, slow)
  loop_s = time.perf_counter() - t0
  # Every step depends on `slow`: had any of them waited for a device value,
  # the loop could only have returned after `slow` was computed.
  leaf = jax.tree_util.tree_leaves(state)[0]
  still_running = not slow.is_ready() and not leaf.is_ready()
  jax.block_until_ready(state)
  total_s = time.perf_counter() - t0
  assert still_running, (loop_s, total_s)
  assert loop_s < total_s / 2, (loop_s, total_s)
  # The steps did run (and computed something finite) once `slow` finished.
  assert all(bool(jnp.all(jnp.isfinite(v))) for v in jax.tree_util.tree_leaves(state))
  assert int(jls.get_scale_state(state).skipped_steps) == 0


@pytest.mark.parametrize("path", sorted(PATHS))
def test_donated_state_buffers_are_consumed(path):
  """The whole train state can be donated (no buffer is shared by two leaves)."""
  state, step = PATHS[path]()
  step = jax.jit(step, donate_argnums=(0,))
  x = jnp.ones((4, WIDTH), jnp.float32)
  old_leaves = jax.tree_util.tree_leaves(state)
  new = step(state, x)
  jax.block_until_ready(new)
  assert all(leaf.is_deleted() for leaf in old_leaves)
  assert jax.tree_util.tree_structure(new) == jax.tree_util.tree_structure(state)
