"""Flax NNX: a stock ``nnx.Optimizer`` around ``jls.dynamic_loss_scale``.

Nothing NNX-specific is needed: build the optimizer with the wrapped Optax
transformation, multiply the loss by the current scale with
``jls.scale_loss(loss, optimizer.opt_state)`` and pass the gradients of the
scaled loss to ``optimizer.update``. Steps whose gradients overflow are
skipped inside the optimizer (params and optimizer state unchanged; note that
``optimizer.step`` still counts every call).

Run: python examples/flax_nnx.py [--smoke]
"""

import argparse
import inspect
import sys

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_lossscale as jls


class MLP(nnx.Module):
  """float32 params, float16 compute."""

  def __init__(self, d, rngs):
    self.l1 = nnx.Linear(d, 32, dtype=jnp.float16, rngs=rngs)
    self.l2 = nnx.Linear(32, 1, dtype=jnp.float16, rngs=rngs)

  def __call__(self, x):
    return self.l2(nnx.relu(self.l1(x))).astype(jnp.float32)


def make_data(n=256, d=16, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, d)).astype(np.float32)
  y = np.tanh(x @ rng.normal(size=(d, 1))).astype(np.float32)
  return jnp.asarray(x), jnp.asarray(y)


def make_optimizer(model, tx):
  # Flax >= 0.11 requires `wrt`; older versions do not accept it.
  if "wrt" in inspect.signature(nnx.Optimizer.__init__).parameters:
    return nnx.Optimizer(model, tx, wrt=nnx.Param)
  return nnx.Optimizer(model, tx)


@nnx.jit
def train_step(model, optimizer, x, y):
  def loss_fn(model):
    loss = jnp.mean((model(x) - y) ** 2)
    return jls.scale_loss(loss, optimizer.opt_state), loss

  (_, loss), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
  optimizer.update(model, grads)
  return loss, jls.metrics(optimizer.opt_state)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smoke", action="store_true", help="a few seconds on CPU")
  parser.add_argument("--steps", type=int, default=None)
  args = parser.parse_args(argv)
  steps = args.steps or (60 if args.smoke else 500)

  x, y = make_data()
  model = MLP(x.shape[1], nnx.Rngs(0))
  # Too large on purpose: the first steps overflow float16 and are skipped.
  tx = jls.dynamic_loss_scale(optax.adam(1e-2), init_scale=2.0**24, growth_interval=20)
  optimizer = make_optimizer(model, tx)
  first = None
  for i in range(steps):
    loss, m = train_step(model, optimizer, x, y)
    if i % max(1, steps // 10) == 0 or i == steps - 1:
      print(
        f"step {i:4d}  loss {float(loss):.5f}  scale {float(m['scale']):>10.0f}  "
        f"skipped {int(m['skipped_steps'])}"
      )
    if first is None and not bool(m["last_step_skipped"]):
      first = float(loss)

  if first is None:  # every step was skipped
    first = float("nan")
  final = float(jnp.mean((model(x) - y) ** 2))
  params = jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))
  print(
    f"final loss {final:.5f} (first applied step {first:.5f}), "
    f"skipped steps {int(m['skipped_steps'])}"
  )
  if not (
    final < 0.5 * first
    and int(m["skipped_steps"]) > 0
    and all(bool(jnp.all(jnp.isfinite(p))) for p in params)
  ):
    print("FAILED: the loss did not go down, or no overflow was handled", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
