"""One batch with an inf pixel, then training on: BatchNorm's running statistics with and without the skip guard.

A small linen ResNet (float16 compute, BatchNorm) on scikit-learn's digits, upscaled to 16x16,
trained with ``jax_lossscale.flax.TrainState``. After ``--clean-steps`` clean steps one batch gets
an inf pixel: its loss and gradients are NaN, so the step is skipped (params and optimizer state
unchanged). The two arms differ only in what happens to ``batch_stats`` on that skipped step:

* guard (the default of ``apply_gradients``): the statistics are kept, bit-identical;
* no guard (``replace_on_skip=("batch_stats",)``, what every release before did): the skipped
  batch's statistics are written, NaN.

Training then goes on for ``--after-steps`` clean steps, and the held-out accuracy is measured
with the running statistics (``use_running_average=True``), for each of ``--seeds`` seeds.

Usage: ``python benchmarks/inf_pixel_batchnorm.py [--seeds 3]``; results in
``benchmarks/results/inf-pixel-batchnorm.md``.
"""

from __future__ import annotations

import argparse
import functools
import time

from flax import struct
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_lossscale.flax import TrainState

F16 = jnp.float16


class Block(nn.Module):
  filters: int

  @nn.compact
  def __call__(self, x, train):
    norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9, dtype=F16)
    conv = functools.partial(nn.Conv, self.filters, (3, 3), use_bias=False, dtype=F16)
    y = nn.relu(norm()(conv()(x)))
    y = norm()(conv()(y))
    return nn.relu(x + y)


class ResNet(nn.Module):
  """A stem, two residual blocks, global average pooling: float16 compute, float32 params."""

  filters: int = 16

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Conv(self.filters, (3, 3), use_bias=False, dtype=F16)(x)
    x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9, dtype=F16)(x))
    x = Block(self.filters)(x, train)
    x = Block(self.filters)(x, train)
    return nn.Dense(10, dtype=F16)(jnp.mean(x, axis=(1, 2)))


class State(TrainState):
  batch_stats: dict = struct.field(default_factory=dict)


def digits(seed):
  from sklearn.datasets import load_digits
  from sklearn.model_selection import train_test_split

  x, y = load_digits(return_X_y=True)
  x = (x / 16.0).reshape(-1, 8, 8, 1).repeat(2, axis=1).repeat(2, axis=2).astype(np.float32)
  return train_test_split(x, y.astype(np.int32), test_size=0.25, random_state=seed, stratify=y)


def make_step(guard):
  replace_on_skip = () if guard else ("batch_stats",)

  @jax.jit
  def step(state, x, y):
    def loss_fn(params):
      logits, updates = state.apply_fn(
        {"params": params, "batch_stats": state.batch_stats}, x, mutable=["batch_stats"]
      )
      logp = jax.nn.log_softmax(logits.astype(jnp.float32))
      return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1)), updates["batch_stats"]

    out = state.value_and_grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(
      grads=out.grads, finite=out.finite, batch_stats=out.aux, replace_on_skip=replace_on_skip
    )

  return step


@jax.jit
def predict(state, x):
  return state.apply_fn(
    {"params": state.params, "batch_stats": state.batch_stats}, x, train=False
  ).argmax(-1)


def accuracy(state, x, y):
  return float(np.mean(np.asarray(predict(state, x)) == y))


def run(seed, guard, clean_steps, after_steps, batch):
  x_tr, x_te, y_tr, y_te = digits(seed)
  model = ResNet()
  variables = model.init(jax.random.key(seed), jnp.ones((1, 16, 16, 1)))
  state = State.create(
    apply_fn=model.apply,
    params=variables["params"],
    tx=optax.sgd(0.05, momentum=0.9),
    batch_stats=variables["batch_stats"],
  )
  rng = np.random.default_rng(seed)
  step = make_step(guard)
  for _ in range(clean_steps):
    idx = rng.choice(len(x_tr), batch, replace=False)
    state = step(state, x_tr[idx], y_tr[idx])
  before = accuracy(state, x_te, y_te)
  idx = rng.choice(len(x_tr), batch, replace=False)
  bad = x_tr[idx].copy()
  bad[0, 7, 7, 0] = np.inf  # one inf pixel
  skipped = step(state, bad, y_tr[idx])
  assert int(skipped.dynamic_scale.skipped_steps) == int(state.dynamic_scale.skipped_steps) + 1
  kept = all(
    np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True)
    for a, b in zip(jax.tree.leaves(skipped.batch_stats), jax.tree.leaves(state.batch_stats))
  )
  state = skipped
  for _ in range(after_steps):
    idx = rng.choice(len(x_tr), batch, replace=False)
    state = step(state, x_tr[idx], y_tr[idx])
  finite_stats = all(bool(jnp.all(jnp.isfinite(a))) for a in jax.tree.leaves(state.batch_stats))
  return {
    "before": before,
    "after": accuracy(state, x_te, y_te),
    "stats_kept": kept,
    "stats_finite": finite_stats,
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seeds", type=int, default=3)
  parser.add_argument("--clean-steps", type=int, default=150)
  parser.add_argument("--after-steps", type=int, default=12)
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--smoke", action="store_true", help="1 seed, 20 clean steps")
  args = parser.parse_args()
  if args.smoke:
    args.seeds, args.clean_steps = 1, 20
  t0 = time.time()
  print(
    "| seed | arm | held-out acc. before the inf batch | after +"
    f"{args.after_steps} steps | batch_stats kept on the skip | finite at the end |"
  )
  print("|---|---|---|---|---|---|")
  for seed in range(args.seeds):
    for guard in (True, False):
      r = run(seed, guard, args.clean_steps, args.after_steps, args.batch)
      arm = "guard (default)" if guard else "no guard (replace_on_skip)"
      print(
        f"| {seed} | {arm} | {r['before']:.1%} | {r['after']:.1%} | {r['stats_kept']} | "
        f"{r['stats_finite']} |",
        flush=True,
      )
  print(f"\n{time.time() - t0:.0f} s, jax {jax.__version__}, {jax.devices()[0].platform}")


if __name__ == "__main__":
  main()
