"""Numerics: unscaling, the finiteness check, the float16 round trip."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_lossscale._scaler._product import exact_reciprocal
from jax_lossscale._scaler._state import scale_of
from jax_lossscale._typing import ArrayLike
from jax_lossscale._typing import PyTree
from jax_lossscale._typing import ScaleLike

# Scales above this have a subnormal float32 reciprocal, which XLA on CPU
# flushes to zero; such scales are unscaled in two exact steps instead.
_TWO_STEP_THRESHOLD = np.float32(2.0**126)
_TWO_STEP_SHIFT = np.float32(2.0**64)


def is_float(x: Any) -> bool:
  """Whether ``x`` (an array, a scalar or a Python number) has a floating dtype."""
  return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def compute_dtype(dtype) -> np.dtype:
  """The dtype gradients are unscaled in: ``promote_types(dtype, float32)``.

  Decided by width, not by ``jnp.promote_types``, which refuses float16 with
  float32 under ``jax_numpy_dtype_promotion="strict"``.
  """
  dtype = np.dtype(dtype)
  return np.dtype(np.float32) if dtype.itemsize < 4 else dtype


def promote_floats(tree: Any) -> Any:
  """Floating leaves promoted to at least float32 (half precision -> float32).

  ``None`` and non-floating leaves pass through unchanged.
  """

  def promote(x):
    if x is None or not is_float(x):
      return x
    return jnp.asarray(x).astype(compute_dtype(jnp.result_type(x)))

  return jax.tree_util.tree_map(promote, tree)


def reciprocal(scale: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The unscaling factors ``(inv, shift)``: ``g * inv / shift == g / scale``.

  ``inv`` is the correctly rounded float32 reciprocal (torch's
  ``float32(1 / float64(scale))``, computed by
  :func:`jax_lossscale._scaler._product.exact_reciprocal` on every backend) and
  ``shift`` is 1. For scales above 2**126 the reciprocal is
  subnormal and XLA on CPU flushes it to zero, which would silently zero every
  gradient; there ``inv`` is ``2**64 / scale`` and ``shift`` is ``2**64``.
  Dividing by a power of two is exact (up to the final rounding of a
  subnormal result, which multiplying by ``2**-64`` would round the same way).
  """
  scale = jnp.asarray(scale, jnp.float32)
  big = scale > _TWO_STEP_THRESHOLD
  shift = jnp.where(big, _TWO_STEP_SHIFT, np.float32(1))
  # Not ``1 / scale``: XLA:GPU's float32 division is not correctly rounded.
  inv = exact_reciprocal(scale, jnp.where(big, 64, 0).astype(jnp.int32))
  # ``inv / (1 + 0 * inv)`` is ``inv`` bit for bit (``inv`` is a finite normal
  # float32). It ends the scalar integer ops of the long division with an op
  # XLA:CPU counts as expensive, so its fusion pass does not copy the whole
  # division into every fusion that unscales a gradient: on a many-leaf model
  # that copying multiplied the optimized HLO and the step's compile time (the
  # shipped step's compile ratio on the 200-leaf models:
  # benchmarks/results/bench.md).
  inv = inv / (np.float32(1) + np.float32(0) * inv)
  return inv, shift


def refuse_complex(tree: PyTree) -> None:
  """Raises ``TypeError`` naming the first complex leaf of a gradient tree.

  The scaler unscales and checks real floating-point leaves; a complex leaf
  would otherwise pass through like an integer one, still scaled and never
  checked. torch's ``GradScaler`` does not unscale complex gradients either.
  """
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if jnp.issubdtype(jnp.result_type(x), jnp.complexfloating):
      raise TypeError(
        f"gradient leaf {jax.tree_util.keystr(path) or '(the root)'} is "
        f"{jnp.result_type(x)}: complex gradients are not supported by loss scaling "
        "(they would be neither unscaled nor checked). Keep a complex parameter as "
        "its real and imaginary parts."
      )


def all_finite(tree: PyTree) -> jax.Array:
  """``True`` iff every floating-point element of ``tree`` is finite.

  Integer, boolean and ``None`` leaves are ignored; an empty tree is finite.
  A complex leaf raises ``TypeError``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from jax_lossscale import all_finite
    >>> all_finite({"a": jnp.ones(3), "b": jnp.array([1.0, jnp.inf])})
    Array(False, dtype=bool)
  """
  refuse_complex(tree)
  leaves = [x for x in jax.tree_util.tree_leaves(tree) if is_float(x)]
  if not leaves:
    return jnp.asarray(True)
  return combine_flags([jnp.all(jnp.isfinite(x)) for x in leaves])


def combine_flags(flags) -> jax.Array:
  """ANDs per-leaf bool flags into one bool scalar that XLA computes once.

  The flags are counted as float32 and the count goes through ``sqrt``
  (``sqrt(n) == 0`` iff ``n == 0``), an operation XLA does not duplicate
  into its consumers. A plain ``jnp.all(jnp.stack(flags))`` is rewritten
  into a chain of scalar ``and``s that XLA copies into every fusion reading
  the flag (each ``jnp.where`` of a train step), which makes compilation
  quadratic in the number of leaves (``tests/test_numerics.py`` checks that
  the compiled step grows linearly; the compile times are in
  ``benchmarks/results/bench.md``).

  The alternative ``sum(x * 0)`` per leaf (NaN iff non-finite) is faster
  alone but, inside a train step on CPU, its float reduction over a matmul's
  output costs more than the boolean ``all(isfinite(x))``.
  """
  if len(flags) == 1:
    return flags[0]
  bad = jnp.sum(jnp.stack([~f for f in flags]).astype(jnp.float32))
  return jnp.sqrt(bad) == np.float32(0)


def unscale_and_check(grads: optax.Updates, scale: ScaleLike) -> tuple[optax.Updates, jax.Array]:
  """Unscales a gradient pytree and checks it for inf/NaN in one pass.

  Each floating-point leaf ``g`` becomes ``g * float32(1/scale)`` computed in
  ``promote_types(g.dtype, float32)`` (so float16/bfloat16 gradients come out
  as float32, float64 stays float64). Finiteness is judged on the unscaled
  values: a non-finite scaled gradient stays non-finite, and an overflow that
  unscaling itself creates (scale < 1) is caught too. Integer, boolean and
  ``None`` leaves pass through untouched and take no part in the check; a
  complex leaf raises ``TypeError``.

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
  refuse_complex(grads)
  inv, shift = reciprocal(scale_of(scale))

  def unscale(g):
    if not is_float(g):
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


def fp16_roundtrip(g: ArrayLike, scale: ArrayLike) -> jax.Array:
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
