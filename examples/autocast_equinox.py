"""Equinox with autocast: the float16 forward and backward without a single hand cast.

The same regression as ``equinox_mlp.py``, but the loss is written in plain float32 and
``autocast`` applies torch's CUDA autocast policy to it: the MLP's matmuls (and their
biases) run in float16, the mean squared error in float32 (``square`` and ``reduce_sum``
are on the float32 list). ``jls.dynamic_loss_scale`` handles the float16 gradients as
before. ``equinox_mlp.py`` casts the whole model to float16 by hand (``to_half``);
here the float32 master params are cast only where a matmul reads them, and the
gradients come back float32.

Run: python examples/autocast_equinox.py [--smoke]
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


def loss_fn(model, x, y):
  """Plain float32 code: no dtype anywhere."""
  pred = jax.vmap(model)(x)
  return jnp.mean((pred - y) ** 2)


def make_train_step(tx):
  amp_loss = jls.autocast(loss_fn)

  @eqx.filter_jit
  def train_step(model, opt_state, x, y):
    def scaled_loss(model):
      loss = amp_loss(model, x, y)
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
  pred = jls.autocast(lambda m, x: jax.vmap(m)(x))(model, x)
  print(f"autocast: predictions {pred.dtype}, loss {jls.autocast(loss_fn)(model, x, y).dtype}")
  # init_scale 2**24 is too large on purpose: the first steps overflow float16.
  tx = jls.dynamic_loss_scale(optax.adam(1e-2), init_scale=2.0**24, growth_interval=20)
  opt_state = tx.init(eqx.filter(model, eqx.is_array))
  train_step = make_train_step(tx)

  first = None
  with jax.numpy_dtype_promotion("standard"):  # optax.adam is not strict-clean
    for step in range(steps):
      model, opt_state, loss, m = train_step(model, opt_state, x, y)
      if step % max(1, steps // 10) == 0 or step == steps - 1:
        print(
          f"step {step:4d}  loss {float(loss):.5f}  scale {float(m['scale']):>10.0f}  "
          f"skipped {int(m['skipped_steps'])}"
        )
      if first is None and not bool(m["last_step_skipped"]):
        first = float(loss)

  if first is None:
    first = float("nan")
  final = float(loss_fn(model, x, y))
  leaves = jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))
  finite = all(bool(jnp.all(jnp.isfinite(p))) for p in leaves)
  f32 = all(p.dtype == jnp.float32 for p in leaves)
  print(
    f"final loss {final:.5f} (first applied step {first:.5f}), "
    f"skipped steps {int(m['skipped_steps'])}, params float32: {f32}"
  )
  if not (finite and f32 and final < 0.5 * first and int(m["skipped_steps"]) > 0):
    print("FAILED: the loss did not go down, or no overflow was handled", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
