"""``scale_product`` at its edges: ties (float64 then float32, each to even) and the normal floor.

Random pairs (``tests/test_numerics.py``) almost never land on an exact tie, so
these products are built to: each is the exact product of a float32 scale and
a float64 factor, found with exact rational arithmetic.
"""

from fractions import Fraction

import jax.numpy as jnp
import numpy as np
import pytest

from jax_lossscale import scale_product


def _torch_reference(scale: float, factor: float) -> float:
  return float(np.float32(np.float64(np.float32(scale)) * factor))


def _float64_tie_cases():
  """Products exactly half a float64 ulp below a float32 midpoint with an odd last bit.

  Rounded to float64 (ties to even) they go *up* to the midpoint, which float32 then
  rounds up again: rounding the float64 tie down instead gives the float32 below.
  """
  cases = []
  for s in (3, 5, 7, 11):
    for m32 in range(2**23 + 1, 2**23 + 4000, 2):
      midpoint = Fraction(2 * m32 + 1, 2**24)
      factor = (midpoint - Fraction(1, 2**53)) / s
      if Fraction(float(factor)) == factor and float(np.float32(float(factor))) != float(factor):
        cases.append((float(s), float(factor)))
        break
  return cases


def _float32_tie_cases():
  """Products exactly on a float32 midpoint (float64-exact): float32 ties go to even.

  A midpoint has 25 significant bits, so its factor is not a float32 (the exact
  integer emulation computes it), and a power-of-two scale keeps it exact.
  """
  cases = []
  for s in (1.0, 4.0, 0.5):
    for m32 in (2**23 + 2, 2**23 + 3):  # an even and an odd last bit below the midpoint
      midpoint = Fraction(2 * m32 + 1, 2**24)
      cases.append((s, float(midpoint / Fraction(s))))
  return cases


@pytest.mark.parametrize("scale, factor", _float64_tie_cases())
def test_a_float64_tie_rounds_to_even_before_the_float32_rounding(scale, factor):
  want = _torch_reference(scale, factor)
  exact = Fraction(scale) * Fraction(factor)
  assert Fraction(want) > exact  # rounded up twice
  got = scale_product(jnp.float32(scale), factor)
  assert got.dtype == jnp.float32 and float(got) == want


@pytest.mark.parametrize("scale, factor", _float32_tie_cases())
def test_a_float32_tie_rounds_to_even(scale, factor):
  want = _torch_reference(scale, factor)
  assert np.frombuffer(np.float32(want).tobytes(), np.uint32)[0] % 2 == 0  # the even one
  got = scale_product(jnp.float32(scale), factor)
  assert float(got) == want


def test_there_are_tie_cases_of_both_kinds():
  assert len(_float64_tie_cases()) == 4
  assert len(_float32_tie_cases()) == 6


_TINY = float(np.finfo(np.float32).tiny)
_MAX = float(np.finfo(np.float32).max)


def _smallest_scale_with_a_normal_product(factor: float) -> float:
  """By bisection over float32 bit patterns, with the float64 reference."""
  lo, hi = 1, 0x7F7FFFFF
  while lo < hi:
    mid = (lo + hi) // 2
    if _torch_reference(float(np.uint32(mid).view(np.float32)), factor) >= _TINY:
      hi = mid
    else:
      lo = mid + 1
  return float(np.uint32(lo).view(np.float32))


@pytest.mark.parametrize("factor", [0.5, 0.3, 0.9, 0.7])  # backoff: the boundary scale is normal
def test_products_at_the_smallest_normal_boundary(factor):
  """The smallest scale whose product is normal gets that product (2**-126 for a product
  that float64 rounds up to it, which XLA:CPU would flush); the float32 below it gets 0."""
  s0 = _smallest_scale_with_a_normal_product(factor)
  below = float(np.nextafter(np.float32(s0), np.float32(0)))
  assert float(scale_product(jnp.float32(s0), factor)) == _torch_reference(s0, factor) >= _TINY
  assert float(scale_product(jnp.float32(below), factor)) == 0.0


def test_a_factor_so_small_that_no_scale_gives_a_normal_product():
  assert float(scale_product(jnp.float32(_MAX), 1e-300)) == 0.0
  # ... and one whose product with the largest float32 is exactly the smallest normal.
  factor = _TINY / _MAX
  assert _torch_reference(_MAX, factor) == _TINY
  assert float(scale_product(jnp.float32(_MAX), factor)) == _TINY
