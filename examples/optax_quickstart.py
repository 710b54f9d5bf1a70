"""Plain JAX + Optax: float16 compute with dynamic loss scaling.

The float32 master params are cast to float16 for the forward and backward
pass; the loss is multiplied by the current scale (``jls.scale_loss``) and the
optimizer, wrapped by ``jls.dynamic_loss_scale``, unscales the gradients,
skips steps that overflowed and adjusts the scale.

Run: python examples/optax_quickstart.py [--smoke]
"""

import argparse
import sys

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


def init_params(key, d=16, hidden=32):
  k1, k2 = jax.random.split(key)
  return {
    "w1": jax.random.normal(k1, (d, hidden), jnp.float32) / np.sqrt(d),
    "b1": jnp.zeros(hidden, jnp.float32),
    "w2": jax.random.normal(k2, (hidden, 1), jnp.float32) / np.sqrt(hidden),
    "b2": jnp.zeros(1, jnp.float32),
  }


def loss_fn(params, x, y):
  p = jax.tree_util.tree_map(lambda a: a.astype(jnp.float16), params)  # float16 compute
  h = jax.nn.relu(x.astype(jnp.float16) @ p["w1"] + p["b1"])
  pred = (h @ p["w2"] + p["b2"]).astype(jnp.float32)
  return jnp.mean((pred - y) ** 2)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smoke", action="store_true", help="a few seconds on CPU")
  parser.add_argument("--steps", type=int, default=None)
  args = parser.parse_args(argv)
  steps = args.steps or (60 if args.smoke else 500)

  x, y = make_data()
  params = init_params(jax.random.key(0))
  # init_scale 2**24 is too large on purpose: the first steps overflow float16 and
  # are skipped while the scale backs off; then it grows every 20 clean steps.
  tx = jls.dynamic_loss_scale(optax.adam(1e-2), init_scale=2.0**24, growth_interval=20)
  opt_state = tx.init(params)

  @jax.jit
  def train_step(params, opt_state, x, y):
    def scaled_loss(params):
      loss = loss_fn(params, x, y)
      return jls.scale_loss(loss, opt_state), loss

    (_, loss), grads = jax.value_and_grad(scaled_loss, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, jls.metrics(opt_state)

  first = None
  for step in range(steps):
    params, opt_state, loss, m = train_step(params, opt_state, x, y)
    if step % max(1, steps // 10) == 0 or step == steps - 1:
      print(
        f"step {step:4d}  loss {float(loss):.5f}  scale {float(m['scale']):>10.0f}  "
        f"skipped {int(m['skipped_steps'])}"
      )
    if first is None and not bool(m["last_step_skipped"]):
      first = float(loss)

  if first is None:  # every step was skipped
    first = float("nan")
  final = float(loss_fn(params, x, y))
  finite = all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree_util.tree_leaves(params))
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
