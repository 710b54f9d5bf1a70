"""The rule (``update_scale``) at its bounds and in overflow storms: the scale stays a normal float32, nothing leaks."""

from helpers import assert_bits_equal
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_lossscale as jls

TINY = np.float32(np.finfo(np.float32).tiny)
F32_MAX = np.float32(np.finfo(np.float32).max)


@jax.jit
def _scales(state, flags):
  def step(s, finite):
    s = jls.update_scale(s, finite)
    return s, s.scale

  return jax.lax.scan(step, state, flags)


def _assert_normal_in_bounds(scales, config):
  scales = np.asarray(scales)
  assert scales.dtype == np.float32
  assert np.all(np.isfinite(scales)), "inf/NaN scale"
  assert np.all(scales >= TINY), "zero or subnormal scale"
  assert np.all(scales >= np.float32(config.min_scale))
  assert np.all(scales <= np.float32(config.max_scale))


@pytest.mark.parametrize(
  "kwargs",
  [
    {},  # torch defaults, floor = smallest normal float32
    {"backoff_factor": 0.3, "growth_factor": 1.7},  # exact-product path
    {"backoff_factor": 1e-3, "min_scale": 1.0},  # floor of jmp/Megatron
    {"backoff_factor": 0.5, "min_scale": 3.0, "init_scale": 3.0 * 2**20},
  ],
)
def test_downward_storm_stops_exactly_at_the_floor(kwargs):
  state = jls.DynamicScaleState.create(**kwargs)
  final, scales = _scales(state, jnp.zeros(400, bool))  # 400 overflows in a row
  _assert_normal_in_bounds(scales, state.config)
  assert float(final.scale) == np.float32(state.config.min_scale)
  assert np.asarray(scales)[-1] == np.float32(state.config.min_scale)
  assert int(final.skipped_steps) == 400 and int(final.consecutive_skips) == 400


@pytest.mark.parametrize(
  "kwargs, ceiling",
  [
    ({}, None),  # default max: growth past float32 is blocked (torch): 2**127
    ({"growth_factor": 1.7}, None),
    ({"growth_factor": 3.0, "init_scale": 5.0}, None),
    ({"max_scale": 2.0**20}, np.float32(2.0**20)),  # capped exactly
    ({"max_scale": 1e6, "growth_factor": 3.0}, np.float32(1e6)),
  ],
)
def test_upward_storm_never_reaches_inf(kwargs, ceiling):
  state = jls.DynamicScaleState.create(growth_interval=1, **kwargs)
  final, scales = _scales(state, jnp.ones(300, bool))  # 300 growths in a row
  _assert_normal_in_bounds(scales, state.config)
  top = np.asarray(scales).max()
  if ceiling is None:
    # The last growth that stayed finite, float32(float64(s) * g) as torch
    # computes it; the next one would overflow, so it is blocked (scale kept,
    # not capped at the float32 maximum).
    want = np.float32(state.config.init_scale)
    with np.errstate(over="ignore"):
      while np.isfinite(np.float32(np.float64(want) * state.config.growth_factor)):
        want = np.float32(np.float64(want) * state.config.growth_factor)
    assert top == want and top < F32_MAX
    # Reached well before the end, then kept on every later (blocked) growth.
    assert np.count_nonzero(np.asarray(scales) == want) > 100
  else:
    assert top == ceiling
  assert float(final.scale) == top
  assert int(final.growth_tracker) == 0  # a blocked growth still resets the tracker


def test_floor_then_recovery():
  state = jls.DynamicScaleState.create(init_scale=4.0, min_scale=1.0, growth_interval=2)
  flags = jnp.asarray([False] * 10 + [True] * 4)
  final, scales = _scales(state, flags)
  assert np.asarray(scales).tolist() == [2.0, 1.0] + [1.0] * 8 + [1.0, 2.0, 2.0, 4.0]
  assert int(final.consecutive_skips) == 0 and int(final.skipped_steps) == 10


def _nonfinite_grads(i, like):
  """inf, NaN or -inf in one element, by step; the rest finite."""
  bad = jnp.stack([jnp.float32(jnp.inf), jnp.float32(jnp.nan), jnp.float32(-jnp.inf)])[i % 3]
  return jax.tree_util.tree_map(lambda p: jnp.ones_like(p).at[0].set(bad), like)


def test_ten_thousand_nonfinite_steps_in_one_jitted_scan():
  params = {"w": jnp.linspace(-1.0, 1.0, 6, dtype=jnp.float32), "b": jnp.zeros([2], jnp.float32)}
  tx = jls.dynamic_loss_scale(
    optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1, momentum=0.9)),
    init_scale=2.0**16,
    growth_interval=3,
  )
  state = tx.init(params)

  def train(params, state, n, bad):
    def step(carry, i):
      params, state = carry
      grads = jax.tree_util.tree_map(lambda p: p * jls.get_scale_state(state).scale, params)
      grads = jax.lax.cond(bad, lambda: _nonfinite_grads(i, params), lambda: grads)
      updates, state = tx.update(grads, state, params)
      return (optax.apply_updates(params, updates), state), None

    (params, state), _ = jax.lax.scan(step, (params, state), jnp.arange(n))
    return params, state

  train = jax.jit(train, static_argnums=(2, 3))
  # A few clean steps first, so the inner state (momentum) is not trivial.
  params, state = train(params, state, 4, False)
  assert int(state.loss_scale.growth_tracker) == 1 and float(state.loss_scale.scale) == 2.0**17
  # A -0.0 param right before the storm: only -0.0 updates keep its sign.
  params = {**params, "b": params["b"].at[0].set(-0.0)}
  before_params, before_inner = params, state.inner_state
  params, state = train(params, state, 10_000, True)
  assert np.signbit(np.asarray(params["b"])[0]) and params["b"][0] == 0.0
  assert_bits_equal(params, before_params)
  assert_bits_equal(state.inner_state, before_inner)
  ls = state.loss_scale
  assert float(ls.scale) == TINY  # at its floor (default: smallest normal float32)
  assert int(ls.skipped_steps) == 10_000 and int(ls.consecutive_skips) == 10_000
  assert int(ls.growth_tracker) == 0 and int(ls.hysteresis_tracker) == 0
  # The scaler never gave up: clean steps still apply and reset the run.
  params, state = train(params, state, 3, False)
  assert int(state.loss_scale.consecutive_skips) == 0
  assert float(state.loss_scale.scale) == TINY * 2
  assert all(np.all(np.isfinite(x)) for x in jax.tree_util.tree_leaves(params))
  assert not np.array_equal(np.asarray(params["w"]), np.asarray(before_params["w"]))


def test_counters_saturate_instead_of_wrapping():
  big = np.iinfo(np.int32).max
  s = jls.DynamicScaleState.create().replace(
    skipped_steps=jnp.asarray(big - 1, jnp.int32),
    consecutive_skips=jnp.asarray(big - 1, jnp.int32),
  )
  for _ in range(3):
    s = jls.update_scale(s, False)
  assert int(s.skipped_steps) == big and int(s.consecutive_skips) == big
  s = jls.update_scale(s, True)
  assert int(s.skipped_steps) == big and int(s.consecutive_skips) == 0
