"""What code coming from Flax's ``DynamicScale`` meets in :mod:`jax_lossscale.flax`.

Flax's ``DynamicScale.value_and_grad`` returns ``(dynamic_scale, is_fin, aux, grads)`` and
leaves the skip to the caller (a ``new_state.replace(params=jnp.where(is_fin, ...), ...,
dynamic_scale=dynamic_scale)`` block after ``apply_gradients``). Here the result is read by
name and :meth:`TrainState.apply_gradients` skips the step and advances the scale itself. What
a half-done migration keeps of the old code is refused with directions, or made harmless:

* the result unpacked or indexed by position (Flax's order or its own): refused;
* the ``finite`` flag passed as ``grads``, a loss passed as ``dynamic_scale``: refused;
* the skip block writing the scale state of before the step back: refused;
* the skip block merging the scale with ``jnp.where(is_fin, new, old)``: the old scale state it
  selects on a skipped step is replaced by the backed-off one.
"""

from __future__ import annotations

from typing import Any
from typing import cast

import jax
import jax.numpy as jnp

from jax_lossscale._scaler._state import DynamicScaleState

#: What changed from Flax's ``DynamicScale.value_and_grad``, for the errors that meet its
#: unpacking.
UNPACKING_CHANGED = (
  "Flax's DynamicScale.value_and_grad returns (dynamic_scale, is_fin, aux, grads); "
  "jax_lossscale.flax's value_and_grad returns ScaledValueAndGrad(value, aux, grads, "
  "finite), in another order and without a new scale state (apply_gradients advances it). "
  "Read it by name: out = state.value_and_grad(loss_fn, has_aux=True)(state.params); "
  "aux is out.aux (not Flax's (loss, aux): the loss is out.value); "
  "state = state.apply_gradients(grads=out.grads, finite=out.finite, ...). See the guide "
  "'Coming from Flax's DynamicScale'."
)

#: Why the old scale state must not be written back.
WRITE_BACK = (
  "dynamic_scale: this writes back the scale state from before apply_gradients, "
  "which would undo its update (the scale would never back off). "
  "jax_lossscale.flax.TrainState.apply_gradients already skips a non-finite step "
  "and advances dynamic_scale: delete Flax's `new_state.replace(opt_state=jnp.where"
  "(is_fin, ...), params=..., dynamic_scale=...)` block (see the guide 'Coming from "
  "Flax's DynamicScale')."
)


def refuse_positional(how: str) -> TypeError:
  """The error for reading :class:`ScaledValueAndGrad` by position (``how``: what was done)."""
  return TypeError(f"ScaledValueAndGrad cannot be {how}: read it by name. " + UNPACKING_CHANGED)


def is_finite_flag(x: Any) -> bool:
  """Whether ``x`` is a lone boolean scalar (a ``finite`` flag, not gradients)."""
  return hasattr(x, "dtype") and x.dtype == jnp.bool_ and jnp.shape(x) == ()


def _same_leaves(a: DynamicScaleState, b: DynamicScaleState) -> bool:
  """Whether two scale states hold the very same leaf objects (one is the other's copy)."""
  la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
  return len(la) == len(lb) and all(x is y for x, y in zip(la, lb))


def checked_scale_state(
  ds: Any, before: DynamicScaleState | None, after: DynamicScaleState
) -> DynamicScaleState:
  """The ``dynamic_scale`` that ``replace`` may store, on a state whose scale state is ``after``.

  ``before`` is the scale state the step that made this state started from (``None`` if this
  state was not made by ``apply_gradients`` in this trace). Writing ``before`` itself back is
  refused. A scale state with ``before``'s config and ``before``'s values, leaf for leaf (what
  ``jnp.where(is_fin, after, before)`` selects on a skipped step), is taken as ``before``
  written back, and ``after`` is stored instead: one ``jnp.where`` per leaf, no host sync. Any
  other scale state (a fresh one, another config) is stored as given.

  Raises:
    TypeError: ``ds`` is not a :class:`DynamicScaleState`.
    ValueError: ``ds`` holds ``before``'s very leaves.
  """
  if not isinstance(ds, DynamicScaleState):
    hint = " " + UNPACKING_CHANGED if hasattr(ds, "dtype") else ""
    raise TypeError(
      f"dynamic_scale must be a jax_lossscale.DynamicScaleState, got {type(ds).__name__}." + hint
    )
  if before is None or _same_leaves(ds, after):
    return ds
  if _same_leaves(ds, before):
    raise ValueError(WRITE_BACK)
  leaves, treedef = jax.tree_util.tree_flatten(ds)
  before_leaves, before_def = jax.tree_util.tree_flatten(before)
  if cast(Any, treedef) != before_def:  # another config: a deliberate change
    return ds
  old = jnp.all(jnp.stack([jnp.all(a == b) for a, b in zip(leaves, before_leaves)]))
  after_leaves = jax.tree_util.tree_leaves(after)
  return jax.tree_util.tree_unflatten(
    treedef, [jnp.where(old, b, a) for a, b in zip(leaves, after_leaves)]
  )
