"""Gradient accumulation that survives an overflowing micro-batch."""

from __future__ import annotations

from typing import Any
from typing import Callable

import jax
import jax.numpy as jnp
import optax

from jax_lossscale._scaler._sharding import place_like_params


class MultiStepsState(optax.MultiStepsState):
  """The state of :func:`multi_steps`: ``optax.MultiStepsState``'s fields and methods.

  A subclass only so that a loss scaler inside a *stock* ``optax.MultiSteps``
  can be told apart (and warned about, see :class:`LossScaleWarning`).
  """

  __slots__ = ()


def multi_steps(
  inner: optax.GradientTransformation,
  every_k_schedule: int | Callable[[jax.Array], jax.Array],
  **kwargs: Any,
) -> optax.GradientTransformationExtraArgs:
  """``optax.MultiSteps`` whose accumulator restarts from exact zeros.

  Put it *around* :func:`jax_lossscale.dynamic_loss_scale`: micro-batch
  gradients of the scaled loss are accumulated with one constant scale (the
  scaler only advances on the real step), unscaled once, and the whole
  accumulated step is skipped if any micro-batch overflowed.

  Stock ``optax.MultiSteps`` empties its accumulator as ``(1 - emit) * acc``:
  after an overflow that is ``0 * inf = NaN``, which stays in the accumulator,
  so every later step would be skipped and the scale would collapse. This
  wrapper zeroes the accumulator with ``jnp.where`` after each emitted step
  instead; otherwise it is ``optax.MultiSteps`` (same state, same arguments).

  Args:
    inner: the transformation to apply every ``every_k_schedule`` steps.
    every_k_schedule: int or schedule, as for ``optax.MultiSteps``.
    **kwargs: passed to ``optax.MultiSteps``.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs`.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import jax_lossscale as jls
    >>> tx = jls.multi_steps(jls.dynamic_loss_scale(optax.sgd(1.0), init_scale=4.0), 2)
    >>> p = jnp.zeros(1)
    >>> state = tx.init(p)
    >>> with jax.numpy_dtype_promotion("standard"):  # optax.MultiSteps mixes int32 and floats
    ...   for g in [jnp.inf, 4.0, 4.0, 8.0]:             # an overflow, then two clean steps
    ...     u, state = tx.update(jnp.array([g]), state, p)
    ...     p = optax.apply_updates(p, u)
    >>> p, float(jls.get_scale_state(state).scale)      # mean(4, 8) / scale 2 = 3
    (Array([-3.], dtype=float32), 2.0)
  """
  ms = optax.MultiSteps(inner, every_k_schedule, **kwargs)

  def init_fn(params):
    # mini_step and gradient_step are made here, like the scaler's own scalars:
    # replicated on the params' mesh (see place_like_params).
    return place_like_params(MultiStepsState(*ms.init(params)), params)

  def update_fn(updates, state, params=None, **extra_args):
    updates, state = ms.update(updates, optax.MultiStepsState(*state), params, **extra_args)
    fresh = state.mini_step == 0
    acc = jax.tree_util.tree_map(lambda a: jnp.where(fresh, jnp.zeros_like(a), a), state.acc_grads)
    return updates, MultiStepsState(*state._replace(acc_grads=acc))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
