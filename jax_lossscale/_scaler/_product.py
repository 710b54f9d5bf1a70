"""Torch's scalar arithmetic on the scale, correctly rounded on every backend.

* :func:`scale_product`: ``float32(float64(scale) * factor)``, without float64.
* :func:`exact_reciprocal`: ``float32(2**k / float64(scale))``, with integers
  only: XLA:GPU's float32 division is not correctly rounded (``1 / s`` is one
  bit off there for some scales), while torch's reciprocal is
  (``tests/test_numerics.py`` checks it on 100k scales, on the GPU too).

Scale products:

Torch multiplies the float32 scale by a Python (float64) factor in double
precision and rounds the result to float32. Factors exactly representable in
float32 (2, 0.5, 3, 0.25, ...) give the same result with a float32 multiply.
Other factors (1.1, 0.3) are emulated here exactly with int32 arithmetic (no
``jax_enable_x64``): the 24-bit significand of the scale times the 53-bit
significand of the factor, rounded first to 53 bits (float64) and then to 24
bits (float32), as the two roundings of torch's computation do.

Checked by ``tests/test_numerics.py`` against NumPy's float64 -> float32 on
random, boundary and power-of-two scales.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

_LIMB = 12  # bits per limb of the integer product (12 x 12 bits fits int32).
_LIMB_MASK = (1 << _LIMB) - 1


def _limbs(value, count: int):
  return [(value >> (_LIMB * i)) & _LIMB_MASK for i in range(count)]


def _bits(limbs, lo: int, hi: int):
  """Bits [lo, hi) of the little-endian limb vector, as an int32 (hi-lo <= 30)."""
  acc = None
  for i, limb in enumerate(limbs):
    a, b = max(lo, _LIMB * i), min(hi, _LIMB * (i + 1))
    if a >= b:
      continue
    piece = (limb >> (a - _LIMB * i)) & ((1 << (b - a)) - 1)
    piece = piece << (a - lo)
    acc = piece if acc is None else acc + piece
  return acc


def _exact_product(scale: jax.Array, factor: float) -> jax.Array:
  """``float32(float64(scale) * factor)`` computed with int32 arithmetic only.

  Valid for positive normal float32 ``scale`` and positive finite ``factor``.
  Results that overflow float32 are ``inf``; results below the smallest normal
  float32 are returned as 0 (callers clamp them to ``min_scale``).
  """
  frac, exp = math.frexp(factor)  # factor = frac * 2**exp, frac in [0.5, 1)
  g_int = int(frac * 2.0**53)  # 53-bit integer significand, exact
  g_exp = exp - 53
  g_limbs = [(g_int >> (_LIMB * i)) & _LIMB_MASK for i in range(5)]

  bits = jax.lax.bitcast_convert_type(scale, jnp.int32)
  biased = (bits >> 23) & 0xFF
  s_int = (bits & 0x7FFFFF) | 0x800000  # 24-bit significand
  s_exp = biased - (127 + 23)
  s_limbs = _limbs(s_int, 2)

  # Schoolbook product of 2 x 5 limbs into 7 limbs, with carries.
  cols = [None] * 7
  for i, s in enumerate(s_limbs):
    for j, g in enumerate(g_limbs):
      if g == 0:
        continue
      term = s * np.int32(g)
      cols[i + j] = term if cols[i + j] is None else cols[i + j] + term
  limbs, carry = [], jnp.zeros([], jnp.int32)
  for col in cols:
    v = carry if col is None else col + carry
    limbs.append(v & _LIMB_MASK)
    carry = v >> _LIMB
  # The product P = s_int * g_int lies in [2**75, 2**77): 76 or 77 bits.
  top_bit = _bits(limbs, 76, 77)

  def rounded(n_bits: int):
    """float64-then-float32 round-to-nearest-even of P, given its bit length."""
    drop = n_bits - 53
    t = _bits(limbs, n_bits - 24, n_bits)  # the 24 bits float32 keeps
    mid = _bits(limbs, drop, n_bits - 24)  # the next 29 bits float64 keeps
    low = _bits(limbs, 0, drop)  # the bits float64 rounds away
    half = 1 << (drop - 1)
    up1 = (low > half) | ((low == half) & ((mid & 1) == 1))
    mid = mid + up1.astype(jnp.int32)
    t = t + (mid >> 29)  # carry out of the 29 bits
    mid = mid & ((1 << 29) - 1)
    up2 = (mid > (1 << 28)) | ((mid == (1 << 28)) & ((t & 1) == 1))
    t = t + up2.astype(jnp.int32)
    return t, n_bits - 24

  t76, sh76 = rounded(76)
  t77, sh77 = rounded(77)
  is77 = top_bit == 1
  t = jnp.where(is77, t77, t76)
  shift = jnp.where(is77, sh77, sh76) + s_exp + g_exp
  # t in [2**23, 2**24]; value = t * 2**shift.
  carry = t >> 24
  t = jnp.where(carry == 1, t >> 1, t)
  shift = shift + carry
  out_biased = shift + 23 + 127
  out_bits = (out_biased << 23) | (t & 0x7FFFFF)
  out = jax.lax.bitcast_convert_type(out_bits, jnp.float32)
  out = jnp.where(out_biased >= 255, jnp.float32(jnp.inf), out)
  return jnp.where(out_biased <= 0, jnp.float32(0), out)


def scale_product(scale: jax.Array, factor: float) -> jax.Array:
  """``float32(float64(scale) * factor)``, as torch's ``_amp_update_scale_``.

  Torch multiplies the float32 scale by a Python (float64) factor in double
  precision and rounds the result to float32. For factors exactly
  representable in float32 (2, 0.5, 3, 0.25, ...) a float32 multiply gives the
  same result; other factors (1.1, 0.3) use an exact integer emulation, so no
  ``jax_enable_x64`` is needed.

  Args:
    scale: float32 scalar, positive and normal.
    factor: positive Python float (static).

  Returns:
    float32 scalar; ``inf`` on float32 overflow; 0 for results below the
    smallest normal float32.

  Examples:
    >>> import jax.numpy as jnp
    >>> from jax_lossscale import scale_product
    >>> scale_product(jnp.float32(3.0), 1.1)  # torch's float32(3 * 1.1 in float64)
    Array(3.3, dtype=float32)
    >>> jnp.float32(3.0) * jnp.float32(1.1)  # a float32 product is one bit off
    Array(3.3000002, dtype=float32)
  """
  factor = float(factor)
  scale = jnp.asarray(scale, jnp.float32)
  if float(np.float32(factor)) == factor:
    out = scale * np.float32(factor)
  else:
    out = _exact_product(scale, factor)
  # Products just below 2**-126 round *up* to it in float64 -> float32, but
  # XLA:CPU flushes them to zero first: compare the scale with the host-computed
  # smallest scale whose product is normal instead.
  tiny = np.float32(_TINY)
  return jnp.where(scale >= _smallest_normal_result(factor), jnp.maximum(out, tiny), jnp.float32(0))


_TINY = float(np.finfo(np.float32).tiny)


@functools.cache
def _smallest_normal_result(factor: float) -> np.float32:
  """The smallest positive float32 ``s`` with ``float32(float64(s) * factor) >= 2**-126``."""
  lo, hi = 1, 0x7F7FFFFF  # bit patterns of positive finite float32s
  product = lambda bits: np.float32(np.float64(np.uint32(bits).view(np.float32)) * factor)
  with np.errstate(over="ignore"):
    if product(hi) < _TINY:
      return np.float32(np.inf)
    while lo < hi:  # the product is monotonic in s
      mid = (lo + hi) // 2
      if product(mid) >= _TINY:
        hi = mid
      else:
        lo = mid + 1
  return np.uint32(lo).view(np.float32)


def exact_reciprocal(scale: jax.Array, shift_exponent: jax.Array) -> jax.Array:
  """``float32(2**shift_exponent / float64(scale))``, correctly rounded, with int32 arithmetic.

  The 24-bit significand ``m`` of the scale divides ``2**48`` by restoring
  long division (25 quotient bits and a remainder), which is then rounded to
  24 bits, to nearest, ties to even. Rounding through float64 first (torch's
  ``float32(1 / float64(s))``) gives the same result, as double rounding is
  innocuous for division from 53 to 24 bits.

  Args:
    scale: float32 scalar, positive and normal.
    shift_exponent: int32 scalar ``k`` (0 or 64), such that the result is a
      normal float32.

  Returns:
    float32 scalar.
  """
  bits = jax.lax.bitcast_convert_type(jnp.asarray(scale, jnp.float32), jnp.int32)
  exponent = (bits >> 23) & 0xFF
  m = (bits & 0x7FFFFF) | 0x800000  # in [2**23, 2**24)
  rem = jnp.full_like(m, 1 << 23)
  q = (rem >= m).astype(jnp.int32)
  rem = rem - q * m
  for _ in range(25):  # q = floor(2**48 / m), in [2**24, 2**25]
    rem = rem * 2
    bit = (rem >= m).astype(jnp.int32)
    rem = rem - bit * m
    q = q * 2 + bit
  t, guard, sticky = q >> 1, q & 1, (rem != 0).astype(jnp.int32)
  t = t + (guard & (sticky | (t & 1)))
  carry = t >> 24
  t = jnp.where(carry == 1, t >> 1, t)
  biased = 253 - exponent + jnp.asarray(shift_exponent, jnp.int32) + carry
  return jax.lax.bitcast_convert_type((biased << 23) | (t & 0x7FFFFF), jnp.float32)
