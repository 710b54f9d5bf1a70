"""Numerics: torch-exact scale products, one-pass unscale-and-check, fp16 round trip."""

from __future__ import annotations

import math
from typing import Any, Tuple

import jax
import jax.numpy as jnp
import numpy as np

# Scales above this have a subnormal float32 reciprocal, which XLA on CPU
# flushes to zero; such scales are unscaled in two exact steps instead.
_TWO_STEP_THRESHOLD = np.float32(2.0**126)
_TWO_STEP_SHIFT = np.float32(2.0**64)

_LIMB = 12  # bits per limb of the integer product (12 x 12 bits fits int32).
_LIMB_MASK = (1 << _LIMB) - 1


def _is_float(x: Any) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def compute_dtype(dtype) -> np.dtype:
  """The dtype gradients are unscaled in: ``promote_types(dtype, float32)``.

  Decided by width, not by ``jnp.promote_types``, which refuses float16 with
  float32 under ``jax_numpy_dtype_promotion="strict"``.
  """
  dtype = np.dtype(dtype)
  return np.dtype(np.float32) if dtype.itemsize < 4 else dtype


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
    return jnp.where(out < np.float32(np.finfo(np.float32).tiny), jnp.float32(0), out)
  return _exact_product(scale, factor)


def reciprocal(scale: jax.Array) -> Tuple[jax.Array, jax.Array]:
  """The unscaling factors ``(inv, shift)``: ``g * inv / shift == g / scale``.

  ``inv`` is the correctly rounded float32 reciprocal (torch's
  ``float32(1 / float64(scale))``; double rounding through float64 is exact for
  division) and ``shift`` is 1. For scales above 2**126 the reciprocal is
  subnormal and XLA on CPU flushes it to zero, which would silently zero every
  gradient; there ``inv`` is ``2**64 / scale`` and ``shift`` is ``2**64``.
  Dividing by a power of two is exact (up to the final rounding of a
  subnormal result, which multiplying by ``2**-64`` would round the same way).
  """
  scale = jnp.asarray(scale, jnp.float32)
  big = scale > _TWO_STEP_THRESHOLD
  shift = jnp.where(big, _TWO_STEP_SHIFT, np.float32(1))
  inv = np.float32(1) / (scale / shift)
  return inv, shift


def all_finite(tree: Any) -> jax.Array:
  """``True`` iff every floating-point element of ``tree`` is finite.

  Integer, boolean and ``None`` leaves are ignored; an empty tree is finite.

  Examples:
    >>> import jax.numpy as jnp
    >>> from jax_lossscale import all_finite
    >>> all_finite({"a": jnp.ones(3), "b": jnp.array([1.0, jnp.inf])})
    Array(False, dtype=bool)
  """
  leaves = [x for x in jax.tree_util.tree_leaves(tree) if _is_float(x)]
  if not leaves:
    return jnp.asarray(True)
  return _combine_flags([jnp.all(jnp.isfinite(x)) for x in leaves])


def _combine_flags(flags) -> jax.Array:
  """ANDs per-leaf bool flags into one bool scalar that XLA computes once.

  The flags are counted as float32 and the count goes through ``sqrt``
  (``sqrt(n) == 0`` iff ``n == 0``), an operation XLA does not duplicate
  into its consumers. A plain ``jnp.all(jnp.stack(flags))`` is rewritten
  into a chain of scalar ``and``s that XLA copies into every fusion reading
  the flag (each ``jnp.where`` of a train step), which makes compilation
  quadratic in the number of leaves (~100x the plain step's compile time at
  200 leaves on CPU).

  Measured alternatives: ``sum(x * 0)`` per leaf (NaN iff non-finite) is
  faster alone but, inside a train step on CPU, its float reduction over a
  matmul's output costs ~8x more than the boolean ``all(isfinite(x))``.
  """
  if len(flags) == 1:
    return flags[0]
  bad = jnp.sum(jnp.stack([~f for f in flags]).astype(jnp.float32))
  return jnp.sqrt(bad) == np.float32(0)


def unscale_and_check(grads: Any, scale: Any) -> Tuple[Any, jax.Array]:
  """Unscales a gradient pytree and checks it for inf/NaN in one pass.

  Each floating-point leaf ``g`` becomes ``g * float32(1/scale)`` computed in
  ``promote_types(g.dtype, float32)`` (so float16/bfloat16 gradients come out
  as float32, float64 stays float64). Finiteness is judged on the unscaled
  values: a non-finite scaled gradient stays non-finite, and an overflow that
  unscaling itself creates (scale < 1) is caught too. Integer, boolean and
  ``None`` leaves pass through untouched and take no part in the check.

  Args:
    grads: pytree of gradients of the scaled loss.
    scale: float32 scalar, or a :class:`DynamicScaleState`.

  Returns:
    ``(unscaled_grads, grads_finite)`` with ``grads_finite`` a bool scalar.

  Examples:
    >>> import jax.numpy as jnp
    >>> from jax_lossscale import unscale_and_check
    >>> g, ok = unscale_and_check([jnp.array([2.0, 4.0]), jnp.array([8.0])], 2.0)
    >>> g, ok
    ([Array([1., 2.], dtype=float32), Array([4.], dtype=float32)], Array(True, dtype=bool))
  """
  scale = getattr(scale, "scale", scale)
  inv, shift = reciprocal(jnp.asarray(scale, jnp.float32))

  def unscale(g):
    if not _is_float(g):
      return g
    dt = compute_dtype(jnp.result_type(g))  # g may be a Python float
    # The division by ``shift`` (1, or 2**64 for huge scales) is exact. It is
    # a division, not a multiply by 2**-64, on purpose: XLA does not copy an
    # expensive op into each consumer, so on CPU every gradient is read once
    # (often transposed, straight out of its weight-gradient matmul) instead
    # of once by the check and once by each optimizer fusion. (XLA:GPU counts
    # a float32 division as cheap and fuses it as before.)
    return (jnp.asarray(g).astype(dt) * inv.astype(dt)) / shift.astype(dt)

  unscaled = jax.tree_util.tree_map(unscale, grads)
  return unscaled, all_finite(unscaled)


def fp16_roundtrip(g: Any, scale: Any) -> jax.Array:
  """Simulates a float16 backward pass: ``float32(float16(g * scale)) / scale``.

  Shows what loss scaling saves: values below float16's smallest subnormal
  (~6e-8) come back as 0 unless scaled up first, and values pushed above
  65504 come back as ``inf``.

  Args:
    g: float32 array (or array-like) of true gradient values.
    scale: the loss scale.

  Returns:
    float32 array of the values as they survive the round trip.

  Examples:
    >>> from jax_lossscale import fp16_roundtrip
    >>> fp16_roundtrip([1e-8, 1e-3, 1.0], 1.0)
    Array([0.       , 0.0010004, 1.       ], dtype=float32)
    >>> fp16_roundtrip([1e-8, 1e-3, 1.0], 65536.0)
    Array([9.9971658e-09, 1.0004044e-03,           inf], dtype=float32)
  """
  g = jnp.asarray(g, jnp.float32)
  scale = jnp.asarray(scale, jnp.float32)
  return (g * scale).astype(jnp.float16).astype(jnp.float32) / scale
