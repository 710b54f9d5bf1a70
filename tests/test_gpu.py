"""CUDA checks: the float16 comparison against ``torch.amp.GradScaler("cuda")``.

Run with ``make gpu-check`` on a machine with a CUDA GPU (JAX with its CUDA
plugin and a CUDA build of torch). Skipped cleanly everywhere else.
"""

import zlib

from helpers import has_cuda
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch_side_by_side as sbs

import jax_lossscale as jls

pytestmark = pytest.mark.gpu


def _cuda_or_skip():
  if not has_cuda():
    pytest.skip("no CUDA device visible to JAX")
  try:
    import torch
  except ImportError:
    pytest.skip("torch is not installed")
  if not torch.cuda.is_available():
    pytest.skip("torch has no CUDA device")
  return jax.devices("gpu")[0]


@pytest.mark.parametrize(
  "config",
  [
    {},
    dict(init_scale=8.0, growth_interval=2),
    dict(growth_factor=1.1, backoff_factor=0.3, growth_interval=3),
  ],
  ids=["defaults", "init8_interval2", "growth1.1_backoff0.3"],
)
def test_cuda_trajectory_matches_torch_cuda(config):
  device = _cuda_or_skip()
  name = repr(sorted(config.items()))
  seq = sbs.make_sequence(seed=zlib.crc32(name.encode()), steps=300, overflow_runs=10)
  tr = sbs.run_torch(seq, config, device="cuda")
  jx = sbs.run_jax(seq, config, jit=True, device=device)
  # GPUs keep subnormals (no flush), like torch: compare exactly.
  assert sbs.compare(jx, tr) == 300


def test_cuda_float16_training_step_skips_on_overflow():
  device = _cuda_or_skip()
  params = jax.device_put({"w": jnp.ones((64, 64), jnp.float32)}, device)
  import optax

  tx = jls.dynamic_loss_scale(optax.sgd(0.1), init_scale=2.0**16)
  state = tx.init(params)

  @jax.jit
  def step(params, state, x):
    def loss(p):
      y = (x.astype(jnp.float16) @ p["w"].astype(jnp.float16)).astype(jnp.float32)
      return jls.scale_loss(jnp.mean(y**2), state)

    grads = jax.grad(loss)(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  x = jax.device_put(jnp.full((8, 64), 100.0, jnp.float32), device)  # overflows float16 at 2**16
  new_params, state = step(params, state, x)
  assert int(state.loss_scale.skipped_steps) == 1
  np.testing.assert_array_equal(np.asarray(new_params["w"]), np.asarray(params["w"]))
