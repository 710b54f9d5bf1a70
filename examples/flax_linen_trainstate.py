"""Flax linen: the scaler as a ``TrainState`` field (``jax_lossscale.flax``).

``jax_lossscale.flax.TrainState`` adds a ``dynamic_scale`` field to Flax's
``TrainState``; ``state.value_and_grad`` differentiates the scaled loss and
returns the true gradients and a finiteness flag; ``apply_gradients`` skips
the step (``step``, ``params`` and ``opt_state`` unchanged) when the flag is
false and updates the scale. The optimizer is plain Optax.

(The alternative needs nothing from this module: Flax's stock ``TrainState``
with ``tx=jls.dynamic_loss_scale(optax.adam(...))`` and
``jls.scale_loss(loss, state)`` in the loss function.)

Run: python examples/flax_linen_trainstate.py [--smoke]
"""

import argparse
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_lossscale as jls
from jax_lossscale.flax import TrainState


class MLP(nn.Module):
  """float32 params, float16 compute."""

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(32, dtype=jnp.float16)(x))
    return nn.Dense(1, dtype=jnp.float16)(x).astype(jnp.float32)


def make_data(n=256, d=16, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, d)).astype(np.float32)
  y = np.tanh(x @ rng.normal(size=(d, 1))).astype(np.float32)
  return jnp.asarray(x), jnp.asarray(y)


@jax.jit
def train_step(state, x, y):
  def loss_fn(params):
    pred = state.apply_fn({"params": params}, x)
    return jnp.mean((pred - y) ** 2), pred

  out = state.value_and_grad(loss_fn, has_aux=True)(state.params)
  state = state.apply_gradients(grads=out.grads, finite=out.finite)
  return state, out.value, jls.metrics(state)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smoke", action="store_true", help="a few seconds on CPU")
  parser.add_argument("--steps", type=int, default=None)
  args = parser.parse_args(argv)
  steps = args.steps or (60 if args.smoke else 500)

  x, y = make_data()
  model = MLP()
  state = TrainState.create(
    apply_fn=model.apply,
    params=model.init(jax.random.key(0), x)["params"],
    tx=optax.adam(1e-2),
    # Too large on purpose: the first steps overflow float16 and are skipped.
    dynamic_scale=jls.DynamicScaleState.create(init_scale=2.0**24, growth_interval=20),
  )
  first = None
  for i in range(steps):
    state, loss, m = train_step(state, x, y)
    if i % max(1, steps // 10) == 0 or i == steps - 1:
      print(
        f"iter {i:4d}  step {int(state.step):4d}  loss {float(loss):.5f}  "
        f"scale {float(m['scale']):>10.0f}  skipped {int(m['skipped_steps'])}"
      )
    if first is None and not bool(m["last_step_skipped"]):
      first = float(loss)

  if first is None:  # every step was skipped
    first = float("nan")
  final = float(jnp.mean((state.apply_fn({"params": state.params}, x) - y) ** 2))
  skipped = int(m["skipped_steps"])
  print(
    f"final loss {final:.5f} (first applied step {first:.5f}), "
    f"applied steps {int(state.step)}, skipped steps {skipped}"
  )
  ok = (
    final < 0.5 * first
    and skipped > 0
    and int(state.step) + skipped == steps  # skipped steps do not advance `step`
    and all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree_util.tree_leaves(state.params))
  )
  if not ok:
    print("FAILED: the loss did not go down, or the step count is off", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
