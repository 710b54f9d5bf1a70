"""An opt-in host-side check on the skip counters, for use between steps."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jax_lossscale._scaler._state import get_scale_state
from jax_lossscale._typing import ScaleSource


class LossScaleError(RuntimeError):
  """Raised by :func:`check_skips` when a user-set skip limit is passed."""


LossScaleError.__module__ = "jax_lossscale"


def _check_limit(name: str, value: Any) -> int | None:
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be a non-negative integer or None, got {value!r}.")
  if value < 0:
    raise ValueError(f"{name} must be a non-negative integer or None, got {value!r}.")
  return int(value)


def check_skips(
  state: ScaleSource,
  *,
  max_consecutive_skips: int | None = None,
  max_skipped_steps: int | None = None,
) -> int:
  """Raises :class:`LossScaleError` if the scaler skipped more steps than allowed.

  The scaler itself never gives up: it skips every non-finite step (params and
  inner state untouched) and backs off down to ``min_scale`` for as long as it
  takes. Long runs of skips usually mean the model has diverged (a NaN loss, a
  NaN parameter written by code outside the scaler) rather than a scale that is
  too high. Call this check from the training loop, between steps, to stop
  such a run with a clear message instead of skipping forever.

  It reads the counters from the device, so it waits for the step that
  produced ``state`` to finish (a host sync): call it outside ``jit``, every
  step or every N steps. It never changes the state. With a batch of states
  (``vmap``), the largest count is checked.

  Args:
    state: a :class:`DynamicScaleState`, or any tree containing exactly one
      (an optimizer state, a train state).
    max_consecutive_skips: raise when more than this many steps in a row were
      skipped (``consecutive_skips > max_consecutive_skips``); ``None``: no
      limit.
    max_skipped_steps: raise when more than this many steps were skipped in
      total; ``None``: no limit.

  Returns:
    The number of consecutive skipped steps (a Python ``int``).

  Raises:
    LossScaleError: a limit was passed; the message names the count, the limit
      and the current scale.
    TypeError: a limit is not an integer (or None).
    ValueError: a limit is negative, ``state`` holds no
      (or more than one) :class:`DynamicScaleState`, or it is called on
      traced values (inside ``jit``).

  Examples:
    >>> import jax_lossscale as jls
    >>> s = jls.DynamicScaleState.create(init_scale=4.0)
    >>> for _ in range(3):
    ...   s = jls.update_scale(s, False)
    >>> jls.check_skips(s, max_consecutive_skips=5)
    3
    >>> jls.check_skips(s, max_consecutive_skips=2)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
      ...
    jax_lossscale.LossScaleError: 3 consecutive steps skipped (limit 2): the gradients were non-finite on every step; loss scale is now 0.5 (min_scale 1.1754944e-38). ...
  """
  max_consecutive = _check_limit("max_consecutive_skips", max_consecutive_skips)
  max_total = _check_limit("max_skipped_steps", max_skipped_steps)
  scale_state = get_scale_state(state)
  leaves = (scale_state.consecutive_skips, scale_state.skipped_steps, scale_state.scale)
  if any(isinstance(x, jax.core.Tracer) for x in leaves):
    raise ValueError(
      "check_skips reads the counters on the host; call it outside jit/vmap, "
      "on the state a step returned."
    )
  consecutive, total, scale = jax.device_get(leaves)
  consecutive = int(np.max(consecutive))
  total = int(np.max(total))
  scale_text = np.array2string(np.asarray(scale, np.float32), separator=", ")
  floor = str(np.float32(scale_state.config.min_scale))
  hint = (
    "Check the loss and the parameters for NaN/inf (a diverged model "
    "overflows at any scale), or lower init_scale."
  )
  if max_consecutive is not None and consecutive > max_consecutive:
    raise LossScaleError(
      f"{consecutive} consecutive steps skipped (limit {max_consecutive}): the "
      "gradients were non-finite on every step; loss scale is now "
      f"{scale_text} (min_scale {floor}). {hint}"
    )
  if max_total is not None and total > max_total:
    raise LossScaleError(
      f"{total} steps skipped in total (limit {max_total}); loss scale is now "
      f"{scale_text} (min_scale {floor}), {consecutive} consecutive skips. {hint}"
    )
  return consecutive
