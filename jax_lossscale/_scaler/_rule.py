"""The scale update rule: torch's ``_amp_update_scale_`` plus bounds and hysteresis."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax

from jax_lossscale._scaler._product import scale_product
from jax_lossscale._scaler._state import DynamicScaleState
from jax_lossscale._typing import ArrayLike


def update_scale(state: DynamicScaleState, grads_finite: ArrayLike) -> DynamicScaleState:
  """Advances the scaler by one step, given whether its gradients were finite.

  The rule, with ``c = state.config`` (torch's ``_amp_update_scale_`` when
  ``hysteresis == 1``, ``min_scale`` is not reached and ``max_scale`` is the
  float32 maximum)::

    if grads_finite:
      tracker += 1
      if tracker >= c.growth_interval:           # growth on the N-th clean step
        new = float32(float64(scale) * c.growth_factor)
        if isfinite(new): scale = min(new, c.max_scale)   # else growth blocked
        tracker = 0; hysteresis_tracker = c.hysteresis
    else:                                        # the step is skipped
      tracker = 0; hysteresis_tracker -= 1
      if hysteresis_tracker <= 0:
        scale = max(float32(float64(scale) * c.backoff_factor), c.min_scale)

  Skip counters advance too (``skipped_steps``, ``consecutive_skips``). With
  ``c.dynamic == False`` only the counters change. Pure ``jnp`` code: no host
  control flow, usable under ``jit``, ``vmap`` and in any traced context.

  Args:
    state: the current :class:`DynamicScaleState`.
    grads_finite: bool scalar (array or Python bool): were all gradients of
      this step finite?

  Returns:
    The new :class:`DynamicScaleState` (same dtypes, same config).

  Examples:
    >>> import jax_lossscale as jls
    >>> s = jls.DynamicScaleState.create(init_scale=8.0, growth_interval=2)
    >>> for finite in [True, False, True, True]:
    ...   s = jls.update_scale(s, finite)
    ...   print(float(s.scale), int(s.growth_tracker))
    8.0 1
    4.0 0
    4.0 1
    8.0 0
  """
  if not isinstance(state, DynamicScaleState):
    raise TypeError(f"state must be a DynamicScaleState, got {type(state).__name__}.")
  c = state.config
  finite = jnp.asarray(grads_finite)
  if finite.dtype != jnp.bool_ or finite.shape != ():
    raise ValueError(
      f"grads_finite must be a boolean scalar, got dtype={finite.dtype}, shape={finite.shape}."
    )
  # Saturating at the int32 maximum instead of wrapping (optax's own increment).
  skipped = optax.safe_int32_increment(state.skipped_steps)
  consecutive = optax.safe_int32_increment(state.consecutive_skips)
  new = state.replace(
    skipped_steps=jnp.where(finite, state.skipped_steps, skipped),
    consecutive_skips=jnp.where(finite, jnp.zeros_like(consecutive), consecutive),
  )
  if not c.dynamic:
    return new

  scale = state.scale
  one = jnp.ones([], jnp.int32)
  # Clean step.
  tracker = state.growth_tracker + one
  grow = tracker >= c.growth_interval
  grown = scale_product(scale, c.growth_factor)
  grown = jnp.where(jnp.isfinite(grown), jnp.minimum(grown, np.float32(c.max_scale)), scale)
  clean_scale = jnp.where(grow, grown, scale)
  clean_tracker = jnp.where(grow, jnp.zeros_like(tracker), tracker)
  full = jnp.asarray(c.hysteresis, jnp.int32)
  clean_hysteresis = jnp.where(grow, full, state.hysteresis_tracker)
  # Overflow.
  hysteresis = jnp.maximum(state.hysteresis_tracker - one, jnp.zeros_like(one))
  backed = jnp.maximum(scale_product(scale, c.backoff_factor), np.float32(c.min_scale))
  overflow_scale = jnp.where(hysteresis <= 0, backed, scale)

  return new.replace(
    scale=jnp.where(finite, clean_scale, overflow_scale),
    growth_tracker=jnp.where(finite, clean_tracker, jnp.zeros_like(tracker)),
    hysteresis_tracker=jnp.where(finite, clean_hysteresis, hysteresis),
  )
