"""Bit-for-bit conformance with the real ``torch.amp.GradScaler("cpu")``.

Every step compares: the skip decision, the scale, the growth tracker, the
unscaled gradients (from float32 copies of the float16 gradients, and from the
float16 arrays themselves), the updates (= minus the unscaled gradients under SGD(lr=1),
-0.0 on skipped steps) and the parameters. Torch must be installed in CI
(``conftest.import_torch`` fails there instead of skipping).
"""

import zlib

from helpers import import_torch
import numpy as np
import pytest
import torch_side_by_side as sbs

pytestmark = pytest.mark.torch

# (name, torch/jax config, steps, sequence options, flush subnormals)
CONFIGS = [
  ("defaults", {}, 2300, dict(quiet=(40, 2200), overflow_runs=8), False),
  ("init8_interval2", dict(init_scale=8.0, growth_interval=2), 400, {}, False),
  (
    "growth3_backoff025_interval5",
    dict(growth_factor=3.0, backoff_factor=0.25, growth_interval=5),
    400,
    dict(overflow_runs=25),
    False,
  ),
  # Growth from 2**127 would overflow float32: torch blocks it (scale kept).
  # Unscaled values below 2**-126 are subnormal: torch keeps them, XLA on CPU
  # flushes them, so torch's are flushed before comparing; positive gradients
  # keep the parameters themselves away from subnormals.
  (
    "init2p127_interval1",
    dict(init_scale=2.0**127, growth_interval=1),
    300,
    dict(magnitudes=(1e-36, 1e-33), positive=True, overflow_runs=12),
    True,
  ),
  # Factors not representable in float32: torch multiplies in float64.
  (
    "growth1.1_backoff0.3_interval3",
    dict(growth_factor=1.1, backoff_factor=0.3, growth_interval=3),
    600,
    dict(overflow_runs=12),
    False,
  ),
]


@pytest.mark.parametrize("name,config,steps,opts,flush", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_trajectory_matches_torch_bit_for_bit(name, config, steps, opts, flush):
  import_torch()
  seq = sbs.make_sequence(seed=zlib.crc32(name.encode()), steps=steps, **opts)
  tr = sbs.run_torch(seq, config)
  jx = sbs.run_jax(seq, config, jit=True)
  n = sbs.compare(jx, tr, flush=flush)
  assert n == steps
  # The sequence really exercised both branches and growth.
  assert 0 < sum(tr.skipped) < steps
  assert len(set(map(float, tr.scale))) > 2


@pytest.mark.parametrize("name,config,steps,opts,flush", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_float16_gradient_arrays_match_torch(name, config, steps, opts, flush):
  """The jax side gets the float16 arrays a float16 backward pass returns (torch,
  which refuses to unscale float16 gradients, gets their float32 copies): the
  skips, scales, trackers, unscaled values, updates and params are the same bits."""
  import_torch()
  seq = sbs.make_sequence(seed=zlib.crc32(name.encode()), steps=steps, **opts)
  if name == "defaults":
    seq = seq[:400]  # the growth at step 2000 is covered by the float32 run
  tr = sbs.run_torch(seq, config)
  jx = sbs.run_jax(seq, config, jit=True, grad_dtype=np.float16)
  assert sbs.compare(jx, tr, flush=flush) == len(seq)
  assert all(u.dtype == np.float32 for step in jx.unscaled for u in step)
  assert all(u.dtype == np.float32 for step in jx.updates for u in step)
  assert 0 < sum(tr.skipped) < len(seq)


@pytest.mark.parametrize("name,config,steps,opts,flush", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_eager_matches_torch(name, config, steps, opts, flush):
  """The same comparison without jit, on a prefix of each sequence."""
  import_torch()
  seq = sbs.make_sequence(seed=zlib.crc32(name.encode()), steps=steps, **opts)[:40]
  sbs.compare(sbs.run_jax(seq, config, jit=False), sbs.run_torch(seq, config), flush=flush)


def test_growth_blocked_at_float32_limit_like_torch():
  import_torch()
  tiny = [np.full(s, 2.0**-120, np.float32) for s in sbs.SHAPES]  # scaled: 128
  seq = [sbs.Step(tiny, []) for _ in range(5)]
  config = dict(init_scale=2.0**127, growth_interval=1)
  tr = sbs.run_torch(seq, config)
  jx = sbs.run_jax(seq, config)
  sbs.compare(jx, tr, flush=True)
  assert [float(s) for s in jx.scale] == [2.0**127] * 5
  assert jx.tracker == [0] * 5


def test_float16_gradients_unscale_like_torchs_float32_copies():
  """float16 leaves are unscaled in float32 arithmetic, as torch's kernel does."""
  import jax.numpy as jnp

  import jax_lossscale as jls

  import_torch()
  seq = sbs.make_sequence(seed=7, steps=30, overflow_runs=0)
  config = dict(growth_factor=1.1, backoff_factor=0.3, growth_interval=3, init_scale=12345.0)
  tr = sbs.run_torch(seq, config)
  scales = [np.float32(12345.0)] + tr.scale[:-1]  # the scale each step used
  for t, step in enumerate(seq):
    leaves = step.scaled(scales[t])
    out, ok = jls.unscale_and_check([jnp.asarray(g) for g in leaves], scales[t])
    assert bool(ok) == (not tr.skipped[t])
    for u, v in zip(out, tr.unscaled[t]):
      assert u.dtype == jnp.float32
      sbs.assert_same_bits(u, v, f"step {t}")
