"""Hysteresis, checked against a plain-Python model of Megatron-LM's rule.

The reference is ``DynamicGradScaler.update`` of Megatron-LM
(``megatron/core/optimizer/grad_scaler.py``), transcribed below. Megatron keeps
its scale and factors as float32 tensors and has no ``max_scale``; its
hysteresis tracker goes negative on repeated overflows while ours stops at 0
(both back off whenever it is <= 0, so the scales agree).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_lossscale as jls


class MegatronDynamicGradScaler:
  """Megatron-LM's ``DynamicGradScaler`` (update rule only), in plain Python."""

  def __init__(
    self, initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis
  ):
    self.scale = np.float32(initial_scale)
    self.min_scale = np.float32(min_scale)
    self.growth_factor = np.float32(growth_factor)
    self.backoff_factor = np.float32(backoff_factor)
    self.growth_interval = growth_interval
    self.hysteresis = hysteresis
    self.growth_tracker = 0
    self.hysteresis_tracker = hysteresis

  def update(self, found_inf):
    if found_inf:
      self.growth_tracker = 0
      self.hysteresis_tracker -= 1
      if self.hysteresis_tracker <= 0:
        self.scale = max(np.float32(self.scale * self.backoff_factor), self.min_scale)
    else:
      self.growth_tracker += 1
      if self.growth_tracker == self.growth_interval:
        self.growth_tracker = 0
        self.hysteresis_tracker = self.hysteresis
        self.scale = np.float32(self.scale * self.growth_factor)


@jax.jit
def _run(state, finite_flags):
  def step(s, finite):
    s = jls.update_scale(s, finite)
    return s, (s.scale, s.growth_tracker, s.hysteresis_tracker)

  return jax.lax.scan(step, state, finite_flags)


def _flags(seed, n, p_overflow):
  """A random flag sequence with bursts of overflows (True = finite)."""
  rng = np.random.default_rng(seed)
  flags = rng.random(n) >= p_overflow
  for start in rng.integers(0, n - 8, size=3):  # a few overflow storms
    flags[start : start + rng.integers(2, 8)] = False
  return flags


@pytest.mark.parametrize("hysteresis", [1, 2, 3, 5])
@pytest.mark.parametrize("growth_interval", [1, 3, 7])
def test_trajectory_matches_megatron_reference(hysteresis, growth_interval):
  init, floor = 2.0**10, 1.0  # Megatron's default min_loss_scale is 1.0
  state = jls.DynamicScaleState.create(
    init_scale=init,
    min_scale=floor,
    growth_interval=growth_interval,
    hysteresis=hysteresis,
  )
  ref = MegatronDynamicGradScaler(init, floor, 2.0, 0.5, growth_interval, hysteresis)
  # Megatron has no ceiling: overflow often enough that its scale stays finite.
  p_overflow = 0.75 if growth_interval == 1 else 0.3
  flags = _flags(seed=hysteresis * 100 + growth_interval, n=300, p_overflow=p_overflow)
  final, (scales, trackers, hysts) = _run(state, jnp.asarray(flags))
  scales, trackers, hysts = np.asarray(scales), np.asarray(trackers), np.asarray(hysts)
  reached_floor = False
  for i, finite in enumerate(flags):
    ref.update(not finite)
    assert np.isfinite(ref.scale), "test precondition: the reference overflowed"
    assert scales[i] == ref.scale, f"step {i}"
    assert trackers[i] == ref.growth_tracker, f"step {i}"
    assert hysts[i] == max(ref.hysteresis_tracker, 0), f"step {i}"
    reached_floor |= bool(ref.scale == ref.min_scale)
  assert final.scale.dtype == jnp.float32 and final.hysteresis_tracker.dtype == jnp.int32
  # The sequences exercise growth, hysteresis-held overflows and backoff.
  assert len(set(scales.tolist())) > 3
  if hysteresis > 1:
    held = [i for i in range(1, len(flags)) if not flags[i] and scales[i] == scales[i - 1]]
    assert held, "no overflow was absorbed by hysteresis"


def test_first_n_minus_1_overflows_keep_the_scale(maybe_jit):
  update = maybe_jit(jls.update_scale)
  s = jls.DynamicScaleState.create(init_scale=64.0, growth_interval=3, hysteresis=3)
  seen = []
  for finite in [False, False, False, False, True, True, False, True, True, True, False]:
    s = update(s, jnp.asarray(finite))
    seen.append((float(s.scale), int(s.hysteresis_tracker), int(s.growth_tracker)))
  assert seen == [
    (64.0, 2, 0),  # 1st overflow: held
    (64.0, 1, 0),  # 2nd overflow: held
    (32.0, 0, 0),  # 3rd overflow: backs off
    (16.0, 0, 0),  # the budget stays empty: every further overflow backs off
    (16.0, 0, 1),  # clean steps do not refill the budget ...
    (16.0, 0, 2),
    (8.0, 0, 0),  # ... so this overflow backs off at once
    (8.0, 0, 1),
    (8.0, 0, 2),
    (16.0, 3, 0),  # growth refills it (as Megatron)
    (16.0, 2, 0),  # held again
  ]
  assert int(s.skipped_steps) == 6 and int(s.consecutive_skips) == 1


def test_default_hysteresis_is_torch():
  s = jls.DynamicScaleState.create(init_scale=8.0)
  assert s.config.hysteresis == 1
  s = jls.update_scale(s, False)
  assert float(s.scale) == 4.0  # the first overflow backs off, as torch


def test_held_overflow_still_skips_the_step(maybe_jit):
  """With hysteresis the scale is kept on an overflow, but the step is skipped."""
  tx = jls.dynamic_loss_scale(optax.sgd(0.1, momentum=0.9), init_scale=16.0, hysteresis=2)
  params = {"w": jnp.arange(3, dtype=jnp.float32)}
  state = tx.init(params)
  update = maybe_jit(tx.update)
  updates, state = update({"w": jnp.ones(3, jnp.float32)}, state, params)
  params = optax.apply_updates(params, updates)
  before_params, before_inner = params, state.inner_state
  bad = {"w": jnp.array([1.0, jnp.nan, 1.0], jnp.float32)}
  updates, state = update(bad, state, params)
  new_params = optax.apply_updates(params, updates)
  assert float(state.loss_scale.scale) == 16.0  # held by hysteresis
  assert int(state.loss_scale.hysteresis_tracker) == 1
  np.testing.assert_array_equal(
    np.asarray(new_params["w"]).view(np.uint32), np.asarray(before_params["w"]).view(np.uint32)
  )
  for a, b in zip(
    jax.tree_util.tree_leaves(state.inner_state), jax.tree_util.tree_leaves(before_inner)
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  updates, state = update(bad, state, params)
  assert float(state.loss_scale.scale) == 8.0  # second overflow backs off
  assert int(state.loss_scale.skipped_steps) == 2


def test_hysteresis_with_min_scale_floor():
  s = jls.DynamicScaleState.create(init_scale=4.0, min_scale=2.0, hysteresis=2)
  for _ in range(10):
    s = jls.update_scale(s, False)
  assert float(s.scale) == 2.0 and int(s.hysteresis_tracker) == 0


@pytest.mark.parametrize("bad", [0, -1])
def test_invalid_hysteresis_is_rejected(bad):
  with pytest.raises(ValueError, match="hysteresis"):
    jls.dynamic_loss_scale(optax.sgd(1.0), hysteresis=bad)


@pytest.mark.parametrize("bad", [2.0, True])
def test_non_integer_hysteresis_is_a_type_error(bad):
  with pytest.raises(TypeError, match="hysteresis"):
    jls.dynamic_loss_scale(optax.sgd(1.0), hysteresis=bad)
