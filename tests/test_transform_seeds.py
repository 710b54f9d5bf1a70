"""The worked examples of the documents the project grew from, as tests."""

import jax.numpy as jnp
import numpy as np
import optax

import jax_lossscale as jls


def test_seed_000_unscale_and_grow_every_step(maybe_jit):
  """grads [2, 4], [8] at scale 2 -> [1, 2], [4]; scale 4 (growth every step)."""
  state = jls.DynamicScaleState.create(init_scale=2.0, growth_interval=1)
  grads = [jnp.array([2.0, 4.0]), jnp.array([8.0])]

  def step(grads, state):
    unscaled, finite = jls.unscale_and_check(grads, state)
    return unscaled, finite, jls.update_scale(state, finite)

  unscaled, finite, state = maybe_jit(step)(grads, state)
  assert bool(finite)
  np.testing.assert_array_equal(unscaled[0], [1.0, 2.0])
  np.testing.assert_array_equal(unscaled[1], [4.0])
  assert float(state.scale) == 4.0


def test_seed_000_overflow_skips_and_backs_off(maybe_jit):
  state = jls.DynamicScaleState.create(init_scale=2.0, growth_interval=1)
  tx = jls.dynamic_loss_scale(optax.sgd(1.0), init_scale=2.0, growth_interval=1)
  params = [jnp.zeros(2), jnp.zeros(1)]
  opt_state = tx.init(params)
  grads = [jnp.array([2.0, jnp.inf]), jnp.array([8.0])]
  updates, opt_state = maybe_jit(tx.update)(grads, opt_state, params)
  assert float(jls.get_scale_state(opt_state).scale) == 1.0  # 2 * 0.5
  assert int(opt_state.loss_scale.skipped_steps) == 1
  for u in updates:  # "None": nothing is applied (-0.0, so p + u == p bit for bit)
    assert not np.any(np.asarray(u)) and np.all(np.signbit(np.asarray(u)))
  del state


def test_seed_001_roundtrip_values():
  g = np.array([1e-8, 1e-3, 1.0], np.float32)
  at_1 = np.asarray(jls.fp16_roundtrip(g, 1.0))
  assert at_1[0] == 0.0  # 1e-8 is lost
  np.testing.assert_allclose(at_1[1], 0.0010004, rtol=1e-4)  # slightly rounded
  assert at_1[2] == 1.0
  at_65536 = np.asarray(jls.fp16_roundtrip(g, 65536.0))  # (1.0 overflows)
  # saved: the seed prints "0.99997e-8"; float16 keeps 11 significant bits,
  # so the value is 0.99972e-8 (equal to NumPy's round trip below).
  np.testing.assert_allclose(at_65536[0], 1e-8, rtol=5e-4)
  np.testing.assert_allclose(at_65536[1], 0.0010004, rtol=1e-4)
  assert np.isinf(at_65536[2])  # 65536 > 65504: overflow
  # Same values as NumPy's float16 round trip.
  for scale in (1.0, 65536.0):
    with np.errstate(over="ignore"):
      ref = (g * np.float32(scale)).astype(np.float16).astype(np.float32) / np.float32(scale)
    np.testing.assert_array_equal(np.asarray(jls.fp16_roundtrip(g, scale)), ref)


def test_seed_001_four_step_table(maybe_jit):
  """init 8, interval 2: [8,16]->[1,2] 8; [inf]->None 4; [4]->[1] 4; [4]->[1] 8."""
  table = [
    ([8.0, 16.0], [1.0, 2.0], 8.0),
    ([np.inf], None, 4.0),
    ([4.0], [1.0], 4.0),
    ([4.0], [1.0], 8.0),  # divided by 4, the scale used; only then doubled
  ]

  @maybe_jit
  def step(g, state):
    unscaled, finite = jls.unscale_and_check(g, state)
    return unscaled, finite, jls.update_scale(state, finite)

  state = jls.DynamicScaleState.create(init_scale=8.0, growth_interval=2)
  for received, returned, scale_after in table:
    g = jnp.asarray(received, jnp.float16)  # float16 gradients, as in the seed
    unscaled, finite, state = step(g, state)
    assert unscaled.dtype == jnp.float32  # returned in float32
    if returned is None:
      assert not bool(finite)
    else:
      assert bool(finite)
      np.testing.assert_array_equal(unscaled, returned)
    assert float(state.scale) == scale_after


def test_seed_001_defaults_are_torchs():
  c = jls.DynamicScaleConfig()
  assert (c.init_scale, c.growth_factor, c.backoff_factor, c.growth_interval) == (
    2.0**16,
    2.0,
    0.5,
    2000,
  )
