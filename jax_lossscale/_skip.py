"""Skipping a step with ``jnp.where``, in a form XLA compiles without copies.

A skipped step must leave the optimizer state (and the params) bit-identical,
so the new state is ``where(finite, new, old)``. Written naively, XLA on CPU
(which has no multi-output fusion) recomputes the new state inside every
consumer, so the parameter update reads the *old* state after the state
select has already overwritten it in place (its buffers are donated); XLA
then copies the whole old optimizer state at the start of the step. Two
rules avoid that for every leaf of at least ``LARGE`` elements, both exact:

* :func:`select_once`: the selected values are divided by :func:`exact_one`.
  Dividing by 1.0 is an identity bit for bit, but XLA counts a division as
  expensive and does not duplicate it into consumers, so each value is
  computed once and written once.
* :func:`ordered_after`: the predicate of the state select is given a data
  dependency on one element of every leaf selected by :func:`select_once`,
  so everything that reads the old state runs before it is overwritten.

Both rules work around XLA:CPU. Other backends have multi-output fusion,
which can put the select in the same kernel as the update, so they get a
plain ``jnp.where`` (the rules are unmeasured there and could only add work).
The choice is made at trace time from ``jax.default_backend()``; it changes
no value, only the compiled schedule.

No ``lax.cond`` and no host control flow: every branch is a ``jnp.where``.
Measured by ``benchmarks/bench.py``; checked by ``tests/test_compiled.py``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jax_lossscale._numerics import _combine_flags, _is_float, reciprocal

_BITS = {2: jnp.int16, 4: jnp.int32, 8: jnp.int64}
# Leaves with fewer elements are left to XLA: copying them is cheap, and the
# extra fusions would cost more than they save (measured on a 200-leaf model
# of 100x100 layers: step 1.32x -> 1.25x, compile 2.3x -> 2.0x the plain step).
LARGE = 1 << 16


def _rules_apply(x: Any) -> bool:
  """Whether leaf ``x`` gets the two rules: on CPU, for large float leaves."""
  return jax.default_backend() == "cpu" and _is_float(x) and jnp.size(x) >= LARGE


def exact_one(scale: jax.Array) -> jax.Array:
  """A float32 1.0 that XLA cannot fold: ``shift / shift`` for the scale's shift.

  ``shift`` (see :func:`jax_lossscale._numerics.reciprocal`) is 1 or 2**64
  whatever the scale holds, so the quotient is exactly 1.
  """
  _, shift = reciprocal(scale)
  return shift / shift


def skip_update(u: Any) -> Any:
  """The update of a skipped step: -0.0, so that ``p + u`` is ``p`` bit for bit."""
  if _is_float(u):
    return jnp.full(jnp.shape(u), -0.0, jnp.result_type(u))
  return jnp.zeros_like(u)


def select_once(pred: jax.Array, new: Any, old: Any, one: jax.Array) -> Any:
  """``where(pred, new, old)`` per leaf, each float leaf computed exactly once.

  Args:
    pred: bool scalar.
    new: pytree of values used where ``pred``.
    old: pytree of the same structure, used where not.
    one: :func:`exact_one`.

  Returns:
    The selected pytree (bit-identical to a plain ``jnp.where``).
  """

  def select(a, b):
    out = jnp.where(pred, a, b)
    if not _rules_apply(out):
      return out
    return out / one.astype(out.dtype)

  return jax.tree_util.tree_map(select, new, old)


def ordered_after(pred: jax.Array, tree: Any) -> jax.Array:
  """``pred``, with a data dependency on one element of every float leaf of ``tree``.

  ``(bits | 1) != 0`` is always true, so the value is exactly ``pred``; XLA
  does not see through it and orders whatever consumes the result after the
  computations that produced ``tree``.
  """
  flags = []
  for x in jax.tree_util.tree_leaves(tree):
    if not _rules_apply(x):
      continue
    width = jnp.result_type(x).itemsize
    if width not in _BITS:
      continue
    # A static one-element slice: no reshape, so no resharding of a sharded leaf.
    first = jnp.asarray(x)[(0,) * jnp.ndim(x)]
    bits = jax.lax.bitcast_convert_type(first, _BITS[width])
    flags.append((bits | 1) != 0)
  if not flags:
    return pred
  # Combined as all_finite combines its flags: a plain chain of 200 ``and``s
  # would be copied into every select and make compilation quadratic.
  return _combine_flags([jnp.asarray(pred)] + flags)


def select_state(pred: jax.Array, new: Any, old: Any) -> Any:
  """``where(pred, new, old)`` per leaf (a plain select; order it with :func:`ordered_after`)."""
  return jax.tree_util.tree_map(lambda a, b: jnp.where(pred, a, b), new, old)
