"""Trace-time warnings about set-ups that run but do not do what the user wants.

Each warning is raised at most once per process and kind, while a function is
traced (never from a running step), as a :class:`LossScaleWarning`. Silence
them with the standard filter::

  warnings.filterwarnings("ignore", category=jax_lossscale.LossScaleWarning)
"""

from __future__ import annotations

from typing import Any
import warnings

import jax
import jax.numpy as jnp
import optax

from jax_lossscale._scaler._numerics import is_float
from jax_lossscale._scaler._state import scale_states


class LossScaleWarning(UserWarning):
  """A loss-scaling set-up that runs, but probably not as intended."""


LossScaleWarning.__module__ = "jax_lossscale"

_WARNED: set[str] = set()


def warn_once(kind: str, message: str) -> None:
  """Warns with ``message`` unless a warning of this ``kind`` was already raised."""
  if kind in _WARNED:
    return
  _WARNED.add(kind)
  warnings.warn(message, LossScaleWarning, stacklevel=4)


def check_gradient_dtypes(grads: Any) -> None:
  """Warns if the gradients are bfloat16 and none is float16: dynamic scaling does nothing there."""
  dtypes = {jnp.result_type(g) for g in jax.tree_util.tree_leaves(grads) if is_float(g)}
  if jnp.dtype(jnp.bfloat16) in dtypes and jnp.dtype(jnp.float16) not in dtypes:
    warn_once(
      "bfloat16",
      "dynamic_loss_scale got bfloat16 gradients and no float16 gradient. "
      "bfloat16 has float32's range: nothing underflows that scaling would "
      "save, and the scale only climbs (towards 2**127). Use "
      "jax_lossscale.no_loss_scale(inner) for bfloat16 training (same state "
      "and API, scale fixed at 1, non-finite steps still skipped).",
    )


def in_stock_multisteps(tree: Any) -> bool:
  """Whether a loss scaler's state sits inside a stock ``optax.MultiSteps``'s in ``tree``."""
  is_ms = lambda x: isinstance(x, optax.MultiStepsState)
  return any(
    # jax_lossscale.multi_steps keeps its state in a subclass.
    type(node) is optax.MultiStepsState and bool(scale_states(node.inner_opt_state))
    for node in jax.tree_util.tree_leaves(tree, is_leaf=is_ms)
  )


def check_accumulation(tree: Any) -> None:
  """Warns if a loss scaler sits inside a stock ``optax.MultiSteps``."""
  if in_stock_multisteps(tree):
    warn_once(
      "multisteps",
      "A loss scaler sits inside optax.MultiSteps. After one overflowing "
      "micro-batch its accumulator holds NaN (it is reset as (1 - emit) * "
      "acc), so every later step is skipped and the scale collapses. Use "
      "jax_lossscale.multi_steps (same arguments, same state) instead.",
    )
