"""Retry on overflow for a model linked to its optimizer (:func:`link_loss_scale`).

:func:`jax_lossscale.retry_on_overflow` scales the loss itself, so its function must see
the optimizer state. A linked :class:`LossScaledModel` reads the scale from the
optimizer's variable instead; :func:`retry_value_and_grad` is ``nnx.value_and_grad`` for
it, with the same retry: an overflowing batch (a rollout, in RL) is recomputed at the
backed-off scale inside the step (``retry_loop``: a ``lax.cond`` whose branch runs only
after an overflow) instead of being thrown away.
"""

from __future__ import annotations

from typing import Any
from typing import Callable

from flax import nnx
import jax
import optax

from jax_lossscale._integrations._shared_scale import LossScaledModel
from jax_lossscale._scaler._loss import loss_and_aux
from jax_lossscale._scaler._numerics import unscale_and_check
from jax_lossscale._scaler._retry import DEFAULT_MAX_RETRIES
from jax_lossscale._scaler._retry import RetriedGrads
from jax_lossscale._scaler._retry import check_max_retries
from jax_lossscale._scaler._retry import retry_loop
from jax_lossscale._scaler._state import DATA_FIELDS
from jax_lossscale._scaler._state import get_scale_state


def _wrappers(model: nnx.Module) -> list[LossScaledModel]:
  return [m for _, m in nnx.iter_graph(model) if isinstance(m, LossScaledModel)]


def retry_value_and_grad(
  loss_fn: Callable[..., Any],
  *,
  max_retries: int = DEFAULT_MAX_RETRIES,
  has_aux: bool = False,
) -> Callable[..., RetriedGrads]:
  """``nnx.value_and_grad(loss_fn)`` for a linked model, retried at a lower scale on overflow.

  The returned function takes ``(model, optimizer, *args, **kwargs)``, where ``model`` holds
  a model linked to ``optimizer`` by :func:`link_loss_scale` (a :class:`LossScaledModel`), and calls
  ``loss_fn(model, *args, **kwargs)`` under ``nnx.value_and_grad``. If any gradient is
  inf/NaN it backs the scale off by the torch rule and computes the same batch's
  gradients again, up to ``max_retries`` times, inside the same jitted step. The
  optimizer's scaler is advanced past the overflowing attempts (each counts as a skipped
  step, exactly as if the batch had been fed again); the returned gradients are those of
  the last attempt, at the optimizer's new scale, for ``optimizer.update(model, grads)``.
  State that the forward pass changes (RNG counts, batch statistics) is that of the last
  attempt. ``max_retries=0`` is ``nnx.value_and_grad``.

  Args:
    loss_fn: ``loss_fn(model, *args, **kwargs)`` returning a float scalar loss (not
      scaled), or ``(loss, aux)`` with ``has_aux``.
    max_retries: how many recomputations at most, ``>= 0``.
    has_aux: as in ``nnx.value_and_grad``.

  Returns:
    A function of ``(model, optimizer, *args, **kwargs)`` returning
    :class:`~jax_lossscale.RetriedGrads` ``(value, aux, grads, retries)``.

  Raises:
    TypeError: ``loss_fn`` is not callable, or ``max_retries`` not an integer.
    ValueError: ``max_retries`` is negative; (when called) ``model`` is not linked to
      ``optimizer``, or the scaler sits inside a gradient accumulator.
  """
  if not callable(loss_fn):
    raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}.")
  max_retries = check_max_retries(max_retries)

  def wrapped(model: nnx.Module, optimizer: nnx.Optimizer, *args: Any, **kwargs: Any):
    found = get_scale_state(optimizer.opt_state)
    wrappers = _wrappers(model)
    if not wrappers or any(w.loss_scale is not found.scale for w in wrappers):
      raise ValueError(
        "model must be (or hold) a LossScaledModel linked to optimizer: call "
        "jax_lossscale.flax.link_loss_scale(model, optimizer) first."
      )
    is_acc = lambda x: isinstance(x, optax.MultiStepsState)
    if any(is_acc(x) for x in jax.tree_util.tree_leaves(optimizer.opt_state, is_leaf=is_acc)):
      raise ValueError(
        "retry_value_and_grad does not support a scaler inside a gradient accumulator "
        "(multi_steps): use jax_lossscale.retry_on_overflow on the accumulated step."
      )
    first = found.replace(**{f: getattr(found, f)[...] for f in DATA_FIELDS})
    # The wrappers' scale apart from the rest, so that each attempt merges a copy of the model
    # at its own scale (variables made outside the loop cannot be set inside it).
    graphdef, scale_vars, rest = nnx.split(model, nnx.PathContains("loss_scale"), ...)  # type: ignore[misc, unused-ignore]
    rest = nnx.as_pure(rest)  # values only: each attempt makes its own variables

    def attempt(scale_state):
      at_scale = jax.tree_util.tree_map(lambda _: scale_state.scale, nnx.as_pure(scale_vars))
      copy = nnx.merge(graphdef, at_scale, rest)
      out, grads = nnx.value_and_grad(loss_fn, has_aux=has_aux)(copy, *args, **kwargs)
      _, finite = unscale_and_check(nnx.as_pure(grads), scale_state.scale)
      return (out, grads, nnx.state(copy)), finite

    last, (out, grads, new_state), retries = retry_loop(attempt, first, max_retries)
    nnx.update(model, new_state)  # the forward pass's state changes, and the scale
    for f in DATA_FIELDS:
      getattr(found, f)[...] = getattr(last, f)
    value, aux = loss_and_aux(out, has_aux)
    return RetriedGrads(value=value, aux=aux, grads=grads, retries=retries)

  return wrapped
