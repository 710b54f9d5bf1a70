"""Data parallelism with ``jax.sharding``: one skip decision for all devices.

The batch is sharded over a 1-D device mesh with ``NamedSharding``; params and
optimizer state are replicated. Under ``jit`` the gradients of sharded data
are already reduced across devices, so the overflow check (and the skip) is
global: no ``axis_name`` is needed. (Inside ``shard_map`` or ``pmap`` pass
``axis_name`` to ``dynamic_loss_scale`` instead.) On CPU this script asks
XLA for 8 host devices.

Run: python examples/data_parallel.py [--smoke]
"""

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()

import argparse
import sys

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

import jax_lossscale as jls


def make_data(n=256, d=16, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, d)).astype(np.float32)
  y = np.tanh(x @ rng.normal(size=(d, 1))).astype(np.float32)
  return x, y


def loss_fn(params, x, y):
  p = jax.tree_util.tree_map(lambda a: a.astype(jnp.float16), params)  # float16 compute
  h = jax.nn.relu(x.astype(jnp.float16) @ p["w1"])
  return jnp.mean(((h @ p["w2"]).astype(jnp.float32) - y) ** 2)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smoke", action="store_true", help="a few seconds on CPU")
  parser.add_argument("--steps", type=int, default=None)
  args = parser.parse_args(argv)
  steps = args.steps or (60 if args.smoke else 500)

  devices = np.array(jax.devices())
  mesh = Mesh(devices, ("data",))
  data_sharding = NamedSharding(mesh, P("data"))
  replicated = NamedSharding(mesh, P())
  print(f"{len(devices)} devices: {devices[0].platform}")

  x, y = make_data(n=32 * len(devices))
  x, y = jax.device_put(x, data_sharding), jax.device_put(y, data_sharding)
  k1, k2 = jax.random.split(jax.random.key(0))
  params = {
    "w1": jax.random.normal(k1, (16, 32), jnp.float32) / 4.0,
    "w2": jax.random.normal(k2, (32, 1), jnp.float32) / np.sqrt(32.0),
  }
  tx = jls.dynamic_loss_scale(optax.adam(1e-2), init_scale=2.0**24, growth_interval=20)
  params = jax.device_put(params, replicated)
  opt_state = jax.device_put(tx.init(params), replicated)

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
  replicated_ok = all(p.sharding.is_fully_replicated for p in jax.tree_util.tree_leaves(params))
  print(
    f"final loss {final:.5f} (first applied step {first:.5f}), "
    f"skipped steps {int(m['skipped_steps'])}, params replicated: {replicated_ok}"
  )
  if not (
    final < 0.5 * first and int(m["skipped_steps"]) > 0 and replicated_ok and len(devices) > 1
  ):
    print("FAILED: the loss did not go down, or no overflow was handled", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
