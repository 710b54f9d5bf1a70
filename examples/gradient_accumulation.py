"""Gradient accumulation: ``optax.MultiSteps`` around ``jls.dynamic_loss_scale``.

Each micro-batch's gradient of the *scaled* loss is accumulated; the scale is
constant while accumulating (the scaler only advances on the real step), and
the wrapper unscales the accumulated gradient once. If any micro-batch
overflowed, the whole accumulated step is skipped and the scale backs off.

Stock ``optax.MultiSteps`` resets its accumulator as ``(1 - emit) * acc``,
which stays NaN after an overflow (``0 * inf``), so every later step would be
skipped too; ``jls.multi_steps`` zeroes it with ``jnp.where`` instead.

Run: python examples/gradient_accumulation.py [--smoke]
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


def loss_fn(params, x, y):
  p = jax.tree_util.tree_map(lambda a: a.astype(jnp.float16), params)  # float16 compute
  h = jax.nn.relu(x.astype(jnp.float16) @ p["w1"])
  return jnp.mean(((h @ p["w2"]).astype(jnp.float32) - y) ** 2)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smoke", action="store_true", help="a few seconds on CPU")
  parser.add_argument("--steps", type=int, default=None, help="accumulated steps")
  parser.add_argument("--k", type=int, default=4, help="micro-batches per step")
  args = parser.parse_args(argv)
  steps = args.steps or (25 if args.smoke else 200)
  k = args.k

  x, y = make_data()
  micro_x, micro_y = jnp.split(x, k), jnp.split(y, k)
  k1, k2 = jax.random.split(jax.random.key(0))
  params = {
    "w1": jax.random.normal(k1, (16, 32), jnp.float32) / 4.0,
    "w2": jax.random.normal(k2, (32, 1), jnp.float32) / np.sqrt(32.0),
  }
  tx = jls.multi_steps(
    jls.dynamic_loss_scale(optax.adam(1e-2), init_scale=2.0**12, growth_interval=10),
    every_k_schedule=k,
  )
  opt_state = tx.init(params)

  @jax.jit
  def micro_step(params, opt_state, x, y, poison):
    def scaled_loss(params):
      loss = loss_fn(params, x, y)
      return jls.scale_loss(loss, opt_state), loss

    (_, loss), grads = jax.value_and_grad(scaled_loss, has_aux=True)(params)
    # For the demonstration: an overflow in one micro-batch.
    grads = jax.tree_util.tree_map(lambda g: jnp.where(poison, jnp.float32(jnp.inf), g), grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  first = None
  scales_seen = []
  for step in range(steps):
    before = params
    for i in range(k):
      poison = jnp.asarray(step == 3 and i == 1)
      params, opt_state, loss = micro_step(params, opt_state, micro_x[i], micro_y[i], poison)
      scales_seen.append(float(jls.get_scale_state(opt_state).scale))
    m = jls.metrics(opt_state)
    if step == 3:  # the whole accumulated step was skipped
      same = all(
        bool(jnp.all(a == b))
        for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(before))
      )
      if not (same and bool(m["last_step_skipped"])):
        print("FAILED: the overflowing accumulated step was applied", file=sys.stderr)
        return 1
    if step % max(1, steps // 10) == 0 or step == steps - 1:
      print(
        f"step {step:4d}  loss {float(loss):.5f}  scale {float(m['scale']):>8.0f}  "
        f"skipped {int(m['skipped_steps'])}"
      )
    if first is None:
      first = float(loss_fn(before, x, y))

  final = float(loss_fn(params, x, y))
  skipped = int(m["skipped_steps"])
  # The scale only changes at accumulated-step boundaries.
  constant = all(len(set(scales_seen[j : j + k - 1])) == 1 for j in range(0, len(scales_seen), k))
  print(f"final loss {final:.5f} (initial {first:.5f}), skipped accumulated steps {skipped}")
  if not (final < 0.5 * first and skipped >= 1 and not bool(m["last_step_skipped"]) and constant):
    print("FAILED: no recovery after the overflow, or the loss did not go down", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
