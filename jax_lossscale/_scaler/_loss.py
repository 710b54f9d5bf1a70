"""The loss: scaled before the backward pass, and read from a loss function's output.

:func:`scale_loss` multiplies a loss (or a pytree of losses) by the current scale, in at
least float32; :func:`loss_and_aux` is the one reader of ``has_aux`` for every entry point
that differentiates a scaled loss (``jax_lossscale.flax.value_and_grad``,
:func:`jax_lossscale.retry_on_overflow` and the shared-model retry).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jax_lossscale._scaler._numerics import compute_dtype
from jax_lossscale._scaler._numerics import is_float
from jax_lossscale._scaler._signals import check_accumulation
from jax_lossscale._scaler._state import scale_of
from jax_lossscale._typing import PyTree
from jax_lossscale._typing import ScaleLike

__all__ = ("loss_and_aux", "scale_loss")


def loss_and_aux(out: Any, has_aux: bool) -> tuple[Any, Any]:
  """A loss function's output as ``(loss, aux)``: ``(out, None)``, or the pair with ``has_aux``.

  The one reader of ``has_aux`` for the entry points that differentiate a scaled loss
  (``jax_lossscale.flax.value_and_grad``, :func:`jax_lossscale.retry_on_overflow`).

  Raises:
    TypeError: with ``has_aux``, ``out`` is not a pair.
  """
  if not has_aux:
    return out, None
  if not (isinstance(out, tuple) and len(out) == 2):
    raise TypeError(
      f"with has_aux=True, fun must return a pair (loss, aux), got {type(out).__name__}."
    )
  return out


def _scale_one(path: str, loss: Any, scale: jax.Array) -> jax.Array:
  """One float leaf of a loss tree times the scale, in at least float32."""
  loss = jnp.asarray(loss)
  if not is_float(loss):
    where = f" (at loss{path})" if path else ""
    raise ValueError(
      f"loss must be a floating-point array, got dtype {loss.dtype}{where}. Scale only the "
      "float losses; keep counts, masks and other integer outputs out of scale_loss."
    )
  dt = compute_dtype(loss.dtype)
  return loss.astype(dt) * scale.astype(dt)


def scale_loss(loss: PyTree, state: ScaleLike) -> PyTree:
  """The loss multiplied by the current scale, in at least float32.

  A float16 loss is promoted to float32 first, so ``loss * 65536`` cannot
  overflow through weak typing; the gradients of the result are the scaled
  gradients :func:`dynamic_loss_scale` expects.

  Like torch's ``scaler.scale(outputs)``, ``loss`` may be any pytree of
  losses (a tuple of a generator's and a discriminator's loss, a list of
  heads): every leaf is scaled by the same scale with the single-loss rule
  above, and the tree comes back with the same structure. Every leaf must be
  floating-point.

  Args:
    loss: scalar (or array) loss, or a pytree of them.
    state: a :class:`DynamicScaleState`, or any tree containing exactly one
      (an optimizer state, a train state).

  Returns:
    ``loss * scale`` in ``promote_types(loss.dtype, float32)``, leaf by leaf
    for a tree.

  Raises:
    ValueError: for a non-float leaf (naming where it sits), or a ``state``
      holding no loss scaler or more than one (several wrappers inside one
      ``multi_transform``: use one wrapper over it).

  Examples:
    >>> import jax.numpy as jnp
    >>> import jax_lossscale as jls
    >>> s = jls.DynamicScaleState.create()
    >>> jls.scale_loss(jnp.float16(2.0), s)   # 2 * 65536 > float16 max
    Array(131072., dtype=float32)
    >>> jls.scale_loss((jnp.float32(1.0), [jnp.float16(0.5)]), s)
    (Array(65536., dtype=float32), [Array(32768., dtype=float32)])
  """
  check_accumulation(state)
  scale = scale_of(state)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(loss)
  if not leaves:
    raise ValueError(f"loss must hold at least one float array, got {loss!r}.")
  out = [_scale_one(jax.tree_util.keystr(p), x, scale) for p, x in leaves]
  return jax.tree_util.tree_unflatten(treedef, out)
