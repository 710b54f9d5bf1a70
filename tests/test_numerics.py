"""Numerics in the open: torch's scale products, the reciprocal near 2**126, linear compile size."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_lossscale as jls
from jax_lossscale._scaler._numerics import reciprocal

F32 = np.finfo(np.float32)
FACTORS = [
  2.0,
  0.5,
  3.0,
  0.25,
  1.1,
  0.3,
  1.5,
  0.9,
  1.0001,
  0.999,
  10.0,
  0.1,
  1.0 + 2.0**-30,
  1.0 - 2.0**-30,
  7.0 / 3.0,
  0.7,
  65536.0,
  1e-5,
  4.2,
  0.123456789,
]
N_PER_FACTOR = 5000  # 20 factors x 5000 scales = 100,000 pairs


def _scales(rng) -> np.ndarray:
  """Normal float32 scales: random bit patterns, near 2**-126, near float32 max, powers of two."""
  n = N_PER_FACTOR
  random_bits = rng.integers(0x00800000, 0x7F7FFFFF, size=n - 1200, dtype=np.int64)
  near_min = 0x00800000 + rng.integers(0, 1 << 20, size=300, dtype=np.int64)
  near_max = 0x7F7FFFFF - rng.integers(0, 1 << 20, size=300, dtype=np.int64)
  powers = rng.integers(1, 255, size=300, dtype=np.int64) << 23
  neighbours = powers + rng.choice([-1, 1], size=300)
  bits = np.concatenate([random_bits, near_min, near_max, powers, neighbours])
  bits = np.clip(bits, 0x00800000, 0x7F7FFFFF).astype(np.uint32)
  return bits.view(np.float32)


def _torch_product(scales: np.ndarray, factor: float) -> np.ndarray:
  """What torch computes, with the documented edges: inf on overflow, 0 below 2**-126."""
  out = (scales.astype(np.float64) * factor).astype(np.float32)  # may overflow to inf
  return np.where(out < F32.tiny, np.float32(0), out)


@pytest.mark.parametrize("factor", FACTORS)
def test_scale_product_matches_float64_then_float32(factor):
  rng = np.random.default_rng(abs(hash(factor)) % 2**32)
  scales = _scales(rng)
  with np.errstate(over="ignore"):
    want = _torch_product(scales, factor)
  got = np.asarray(jax.jit(jax.vmap(lambda s: jls.scale_product(s, factor)))(jnp.asarray(scales)))
  mismatch = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
  assert mismatch.size == 0, (
    f"{mismatch.size} of {scales.size} differ, e.g. scale={scales[mismatch[0]]!r}: "
    f"{got[mismatch[0]]!r} vs {want[mismatch[0]]!r}"
  )


def test_scale_product_covers_both_edges():
  """The sample reaches overflow and underflow for the large and small factors."""
  scales = _scales(np.random.default_rng(0))
  with np.errstate(over="ignore"):
    assert np.isinf(_torch_product(scales, 1.1)).any()
    assert (_torch_product(scales, 0.3) == 0).any()


def _around_threshold():
  base = np.float32(2.0**126).view(np.uint32)
  bits = np.array([base - 2, base - 1, base, base + 1, base + 2], np.uint32)
  top = np.array([0x7F7FFFFF, np.float32(2.0**127).view(np.uint32)], np.uint32)
  return np.concatenate([bits, top, np.float32([2.0**125, 3.0 * 2.0**125]).view(np.uint32)]).view(
    np.float32
  )


@pytest.mark.parametrize("scale", _around_threshold())
def test_reciprocal_around_2_to_126(scale):
  inv, shift = (np.float32(x) for x in jax.jit(reciprocal)(jnp.float32(scale)))
  if scale <= np.float32(2.0**126):
    assert shift == 1
    assert inv == np.float32(1.0 / np.float64(scale))  # torch's float32(1 / float64(scale))
  else:
    assert shift == np.float32(2.0**64)
    assert inv == np.float32(2.0**64 / np.float64(scale))
  assert inv >= F32.tiny  # never the subnormal that XLA:CPU would flush to 0
  # Unscaling g = scale gives 1 (to float32 rounding), never 0.
  g, finite = jls.unscale_and_check(jnp.float32(scale), jnp.float32(scale))
  assert bool(finite) and abs(float(g) - 1.0) <= 2 * float(F32.eps)


def _step_hlo_size(n_leaves: int) -> int:
  params = {f"l{i:03d}": jnp.zeros((4,), jnp.float32) for i in range(n_leaves)}
  tx = jls.dynamic_loss_scale(optax.sgd(0.1))

  def step(params, opt_state, grads):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  compiled = jax.jit(step).lower(params, tx.init(params), params).compile()
  return len(compiled.as_text().splitlines())


def test_compiled_step_grows_linearly_with_the_leaf_count():
  """A flag combine that XLA copies into every select makes the step quadratic in leaves.

  With 4x the leaves the compiled step must stay within ~4x the size (linear);
  a chain of ``and``s copied into each of the 200 selects gives ~10x or more.
  """
  small, large = _step_hlo_size(50), _step_hlo_size(200)
  assert large <= 5 * small, (small, large)


def test_reciprocal_is_correctly_rounded_on_100k_scales():
  """torch's float32(1 / float64(s)) (or 2**64 / s above 2**126), on every backend.

  XLA:GPU's own float32 division is one bit off for ~13% of scales.
  """
  rng = np.random.default_rng(7)
  bits = rng.integers(0x00800000, 0x7F7FFFFF, size=100_000, dtype=np.int64)
  bits = np.concatenate([bits, np.arange(1, 255, dtype=np.int64) << 23]).astype(np.uint32)
  scales = bits.view(np.float32)
  inv, shift = jax.jit(jax.vmap(reciprocal))(jnp.asarray(scales))
  big = scales > np.float32(2.0**126)
  want = np.where(big, 2.0**64, 1.0) / scales.astype(np.float64)
  np.testing.assert_array_equal(
    np.asarray(shift), np.where(big, np.float32(2.0**64), np.float32(1))
  )
  got, want = np.asarray(inv), want.astype(np.float32)
  mismatch = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
  assert mismatch.size == 0, f"{mismatch.size} differ, e.g. 1/{scales[mismatch[0]]!r}"
