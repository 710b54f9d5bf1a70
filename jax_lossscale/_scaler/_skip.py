"""Skipping a step: one ``jnp.where`` function, exact bit for bit, copy-free on XLA:CPU.

A skipped step must leave the params (or the updates that reach them) and the
optimizer state bit-identical, so both are selected with ``jnp.where`` (no
``lax.cond``, no host control flow). :func:`skip_step` does both selects; the
Optax wrapper and :class:`jax_lossscale.flax.TrainState` call it and nothing
else.

Why the state select is ordered: written naively, XLA on CPU (which has no
multi-output fusion) recomputes the new optimizer state inside each consumer,
so the parameter update would read the *old* state after the state select has
overwritten it in place (its buffers are donated); XLA then copies the whole
old optimizer state at the start of every step. :func:`skip_step` therefore
selects each leaf of a state subtree shaped like the outputs (Adam's ``mu``
and ``nu``, a momentum trace) with a predicate that has a data dependency on
one element of the matching output leaf: ``(bits | 1) != 0`` is always true,
so the predicate's value is exactly ``finite``, and XLA schedules the reads of
the old moment before it is replaced. Leaf by leaf, so the outputs need not
all stay alive at once (one combined predicate over every leaf did keep them alive, with
more temporaries and a slower step on a many-leaf model). Other state (counts,
schedules) is selected with ``finite``. This changes the compiled schedule only, never a
value; it is applied to leaves of at least ``LARGE`` elements that
are not sharded by an explicit mesh axis, in steps compiled for XLA:CPU. The
platform is the one the step is lowered for (``jax.lax.platform_dependent``),
not ``jax.default_backend()``: a step jitted onto CPU devices on a GPU host
is ordered, a GPU step is not. Other backends fuse the selects with their
producers and get plain ``jnp.where``s.

Checked by ``tests/test_skip.py`` (bit-exactness, including subnormals and
-0.0, in small and large leaves) and ``tests/test_compiled.py`` (no state
copies in the compiled step).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jax_lossscale._scaler._numerics import is_float

_BITS = {2: jnp.int16, 4: jnp.int32, 8: jnp.int64}
# Smaller leaves are left to XLA: copying them is cheap, and the extra
# dependencies would cost compile time (benchmarks/bench_compile.py compares
# the threshold with a flag on every leaf and with none).
LARGE = 1 << 16


def skipped_updates(updates: Any) -> Any:
  """The updates of a skipped step: ``-0.0``, so that ``p + u`` is ``p`` bit for bit.

  Built with ``full_like``, so each leaf keeps the dtype and the sharding of
  the update it stands for (under explicit mesh axes ``jnp.where`` refuses
  operands of different shardings).
  """

  def skip(u):
    if u is None:
      return None
    if is_float(u):
      return jnp.full_like(u, -0.0)
    return jnp.zeros_like(u)

  return jax.tree_util.tree_map(skip, updates, is_leaf=lambda x: x is None)


def _explicitly_sharded(x: Any) -> bool:
  """Whether ``x`` is split along an explicit mesh axis (its one-element slice would reshard)."""
  try:
    spec = jax.typeof(x).sharding.spec
  except (AttributeError, TypeError):
    return False
  return any(axis is not None for axis in spec)


def _orderable(x: Any) -> bool:
  """Whether ``x`` gets an ordering flag on XLA:CPU: a large float leaf, not explicitly sharded."""
  return (
    is_float(x)
    and jnp.size(x) >= LARGE
    and jnp.result_type(x).itemsize in _BITS
    and not _explicitly_sharded(x)
  )


def _order_flag(x: Any) -> jax.Array:
  """An always-true bool scalar computed from the first element of ``x``."""
  first = jnp.asarray(x)[(0,) * jnp.ndim(x)]  # a static slice: no reshape
  bits = jax.lax.bitcast_convert_type(first, _BITS[jnp.result_type(x).itemsize])
  return (bits | 1) != 0


def _predicates(finite: jax.Array, leaves: list[Any]) -> list[jax.Array]:
  """One predicate per output leaf: ``finite``, made to wait for large leaves on XLA:CPU.

  The backend is the one the step is *compiled* for, not
  ``jax.default_backend()``: ``jax.lax.platform_dependent`` stages both
  variants and keeps one when lowering (a step jitted onto CPU devices on a
  GPU host gets the flags, a GPU step on any host does not), so the compiled
  code holds no conditional.
  """
  large = [i for i, x in enumerate(leaves) if _orderable(x)]
  if not large:
    return [finite] * len(leaves)

  def cpu(finite, outs):
    return [jnp.logical_and(finite, _order_flag(x)) for x in outs]

  def other(finite, outs):
    return [finite for _ in outs]

  flagged = jax.lax.platform_dependent(finite, [leaves[i] for i in large], cpu=cpu, default=other)
  preds = [finite] * len(leaves)
  for i, p in zip(large, flagged):
    preds[i] = p
  return preds


def _where(pred: jax.Array, new: Any, old: Any) -> Any:
  return jax.tree_util.tree_map(
    lambda a, b: None if a is None else jnp.where(pred, a, b),
    new,
    old,
    is_leaf=lambda x: x is None,
  )


def skip_step(
  finite: jax.Array, new_out: Any, old_out: Any, new_state: Any, old_state: Any
) -> tuple[Any, Any]:
  """Selects a step's outputs and state: the new ones if ``finite``, else the old ones.

  Every leaf is a ``jnp.where``, so the result is bit for bit the selected
  value, for every dtype and value (subnormals, -0.0, NaN payloads), on every
  backend. On CPU, the state select is ordered after the outputs (see the
  module docstring) so that the step needs no copy of the old state.

  Args:
    finite: bool scalar: take the new outputs and state?
    new_out: the step's outputs (new params, or updates).
    old_out: what a skipped step outputs instead (the old params, or
      :func:`skipped_updates`); same structure as ``new_out``.
    new_state: the new optimizer state.
    old_state: the old optimizer state (same structure).

  Returns:
    ``(out, state)``, each selected leaf by leaf.

  Examples:
    >>> import jax.numpy as jnp
    >>> from jax_lossscale._scaler._skip import skip_step
    >>> out, state = skip_step(jnp.array(False), jnp.ones(2), jnp.array([-0.0, 1e-40]),
    ...                        {"n": jnp.int32(1)}, {"n": jnp.int32(0)})
    >>> out, state["n"]
    (Array([-0.e+00,  1.e-40], dtype=float32), Array(0, dtype=int32))
  """
  out = _where(finite, new_out, old_out)
  leaves, out_def = jax.tree_util.tree_flatten(out)
  # One predicate per output leaf: ``finite``, made to wait for that leaf
  # when it is large (always true, so the value is exactly ``finite``).
  preds = _predicates(finite, leaves)
  shaped_like_out = lambda x: jax.tree_util.tree_structure(x) == out_def

  def select(new, old):
    # A state subtree shaped like the outputs (Adam's mu and nu, a momentum
    # trace) is selected leaf by leaf after its own output leaf: the old
    # moment is read by the output's computation before it is overwritten,
    # and the outputs need not all stay alive at once.
    if not shaped_like_out(new):
      return _where(finite, new, old)
    pairs = zip(preds, jax.tree_util.tree_leaves(new), jax.tree_util.tree_leaves(old))
    return jax.tree_util.tree_unflatten(out_def, [jnp.where(p, a, b) for p, a, b in pairs])

  return out, jax.tree_util.tree_map(select, new_state, old_state, is_leaf=shaped_like_out)
