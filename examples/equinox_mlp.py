"""Equinox: float16 compute with dynamic loss scaling, nothing Equinox-specific needed.

The model is an ``eqx.nn.MLP`` with float32 master params; the loss casts its
arrays to float16 for the forward and backward pass. The optimizer is
``jls.dynamic_loss_scale(optax.adam(...))`` initialised on
``eqx.filter(model, eqx.is_array)``; the train step (under ``eqx.filter_jit``)
takes ``eqx.filter_value_and_grad`` of a loss multiplied by the current scale
(``jls.scale_loss``) and applies the updates with ``eqx.apply_updates``. Steps
whose gradients overflow float16 are skipped inside the optimizer: the updates
are ``-0.0``, so model and Adam state stay bit for bit what they were.

Run: python examples/equinox_mlp.py [--smoke]
"""

import argparse
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_lossscale as jls


def make_data(n=256, d=16, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, d)).astype(np.float32)
  y = np.tanh(x @ rng.normal(size=(d, 1))).astype(np.float32)
  return jnp.asarray(x), jnp.asarray(y)


def make_model(key, d=16, hidden=32):
  return eqx.nn.MLP(d, 1, hidden, depth=2, activation=jax.nn.relu, key=key)


def to_half(model):
  """The model with every floating-point array cast to float16 (compute copy)."""
  return jax.tree_util.tree_map(
    lambda a: a.astype(jnp.float16) if eqx.is_inexact_array(a) else a, model
  )


def loss_fn(model, x, y):
  pred = jax.vmap(to_half(model))(x.astype(jnp.float16)).astype(jnp.float32)
  return jnp.mean((pred - y) ** 2)  # loss in float32


def make_train_step(tx):
  @eqx.filter_jit
  def train_step(model, opt_state, x, y):
    def scaled_loss(model):
      loss = loss_fn(model, x, y)
      return jls.scale_loss(loss, opt_state), loss

    (_, loss), grads = eqx.filter_value_and_grad(scaled_loss, has_aux=True)(model)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    model = eqx.apply_updates(model, updates)
    return model, opt_state, loss, jls.metrics(opt_state)

  return train_step


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smoke", action="store_true", help="a few seconds on CPU")
  parser.add_argument("--steps", type=int, default=None)
  args = parser.parse_args(argv)
  steps = args.steps or (60 if args.smoke else 500)

  x, y = make_data()
  model = make_model(jax.random.key(0))
  # init_scale 2**24 is too large on purpose: the first steps overflow float16
  # and are skipped while the scale backs off; then it grows every 20 clean steps.
  tx = jls.dynamic_loss_scale(optax.adam(1e-2), init_scale=2.0**24, growth_interval=20)
  opt_state = tx.init(eqx.filter(model, eqx.is_array))
  train_step = make_train_step(tx)

  first = None
  for step in range(steps):
    model, opt_state, loss, m = train_step(model, opt_state, x, y)
    if step % max(1, steps // 10) == 0 or step == steps - 1:
      print(
        f"step {step:4d}  loss {float(loss):.5f}  scale {float(m['scale']):>10.0f}  "
        f"skipped {int(m['skipped_steps'])}"
      )
    if first is None and not bool(m["last_step_skipped"]):
      first = float(loss)

  if first is None:  # every step was skipped
    first = float("nan")
  final = float(loss_fn(model, x, y))
  leaves = jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))
  finite = all(bool(jnp.all(jnp.isfinite(p))) for p in leaves)
  print(
    f"final loss {final:.5f} (first applied step {first:.5f}), "
    f"skipped steps {int(m['skipped_steps'])}"
  )
  if not (finite and final < 0.5 * first and int(m["skipped_steps"]) > 0):
    print("FAILED: the loss did not go down, or no overflow was handled", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
