"""Retry on overflow: an overflowing batch is recomputed at the backed-off scale, in the step.

torch decides on the host whether a step overflowed, so an overflowing batch
can only be skipped (apex #114 asked for a retry; it was never adopted). Here
the decision is a device value, so the same jitted step can recompute the
batch's gradients at the lower scale: a ``lax.cond`` whose branch runs only
after an overflow, up to ``max_retries`` times (inside it a loop of fixed trip
count of conds, or a ``lax.while_loop`` above :data:`UNROLLED_RETRIES`).

Every attempt is one step of the torch rule: an overflowing attempt backs the
scale off and counts as a skipped step (``skipped_steps``,
``consecutive_skips``, the growth tracker reset), exactly as if the batch had
been fed again by hand at the new scale; the attempt that comes out finite is
the clean step the optimizer applies. A retry is made only when the rule has
changed the scale (not while ``hysteresis`` still tolerates the overflow, not
at ``min_scale``, never for a static scaler): at the same scale a pure
function gives the same overflowing gradients again.

The first attempt is computed outside the cond, so a step that does not
overflow is the plain step plus the cond's test: a second finiteness check of
the gradients (the optimizer's ``update`` checks them again) and a barrier
between the backward pass and the update. On a GPU, XLA copies the test to
the host and waits for it, unless the step runs as a CUDA graph with
conditional nodes: that takes XLA options (``xla_gpu_enable_command_buffer``
with ``WHILE`` and ``CONDITIONAL``, ``xla_gpu_command_buffer_unroll_loops``)
and CUDA >= 12.3; the guide's "A step the host does not wait on" says which
and why the retries are not a ``lax.while_loop`` (XLA keeps a while loop of
unknown trip count around a scanned model out of CUDA graphs).
``max_retries=0`` builds no cond at all.

Checked by ``tests/test_retry.py``.
"""

from __future__ import annotations

from typing import Any
from typing import Callable
from typing import NamedTuple
from typing import Sequence

import jax
import jax.numpy as jnp
import optax

from jax_lossscale._scaler._fp8 import gradient_leaves
from jax_lossscale._scaler._loss import loss_and_aux
from jax_lossscale._scaler._loss import scale_loss
from jax_lossscale._scaler._numerics import refuse_complex
from jax_lossscale._scaler._numerics import unscale_and_check
from jax_lossscale._scaler._rule import update_scale
from jax_lossscale._scaler._sharding import all_devices_finite
from jax_lossscale._scaler._signals import check_accumulation
from jax_lossscale._scaler._state import DATA_FIELDS
from jax_lossscale._scaler._state import DynamicScaleState
from jax_lossscale._scaler._state import check_int
from jax_lossscale._scaler._state import get_scale_state
from jax_lossscale._scaler._state import is_scale_state
from jax_lossscale._scaler._state import scale_states
from jax_lossscale._typing import AxisName
from jax_lossscale._typing import ScaleSource

#: ``max_retries``' default: three halvings of the scale (a factor of 8).
DEFAULT_MAX_RETRIES = 3

#: Up to this many retries, those after the first are a loop of fixed trip count of
#: ``lax.cond``s (a CUDA graph can hold it: see the guide); more are a ``lax.while_loop``.
UNROLLED_RETRIES = 16


class RetriedGrads(NamedTuple):
  """What the function made by :func:`retry_on_overflow` returns, beside the new state.

  Attributes:
    value: the loss of the last attempt, as ``fun`` computed it (not scaled).
    aux: ``fun``'s auxiliary output of the last attempt (``None`` without
      ``has_aux``).
    grads: the gradients of the *scaled* loss of the last attempt, at the
      scale of the returned state: what the loss scaler's ``update`` takes.
      With ``argnums`` a sequence, a tuple of such pytrees.
    retries: int32 scalar, how many times the batch was recomputed (0 when
      the first attempt was finite).
  """

  value: jax.Array
  aux: Any
  grads: Any
  retries: jax.Array


def check_max_retries(max_retries: Any) -> int:
  """``max_retries`` as an int in ``[0, 2**31 - 1]`` (``TypeError``/``ValueError`` naming it)."""
  return check_int("max_retries", max_retries, 0)


def retry_loop(
  attempt: Callable[[DynamicScaleState], tuple[Any, jax.Array]],
  scale_state: DynamicScaleState,
  max_retries: int,
) -> tuple[DynamicScaleState, Any, jax.Array]:
  """Runs ``attempt`` at ``scale_state``, then again after each backoff, while it overflows.

  The first attempt is unconditional; the retries are one ``lax.cond`` taken only when it
  overflowed. Inside it, up to :data:`UNROLLED_RETRIES` retries are a loop of fixed trip
  count whose body is a ``lax.cond`` per retry (XLA:GPU can run both in a CUDA graph with
  conditional nodes, whatever the model's own loops); more are a ``lax.while_loop``.

  Args:
    attempt: maps a scale state to ``(result, finite)``: the batch's
      gradients (any pytree, same structure and dtypes at every scale) and
      whether they were all finite on every device.
    scale_state: the scaler state of the first attempt.
    max_retries: how many recomputations at most (a Python int).

  Returns:
    ``(state, result, retries)``: the state of the last attempt (advanced by
    :func:`update_scale` once per overflowing attempt before it), its result
    and the number of retries, an int32 scalar.
  """
  result, finite = attempt(scale_state)
  retries = jnp.zeros([], jnp.int32)
  if max_retries == 0:
    return scale_state, result, retries

  needed, again = retry_steps(attempt, max_retries)

  def keep(carry):
    return carry

  def retry_all(carry):
    carry = again(carry)  # the cond around this runs it only when a retry is needed
    if max_retries <= UNROLLED_RETRIES:
      one = lambda _, c: jax.lax.cond(needed(c), again, keep, c)
      return jax.lax.fori_loop(0, max_retries - 1, one, carry)
    return jax.lax.while_loop(needed, again, carry)

  carry = (retries, scale_state, result, finite)
  retries, state, result, _ = jax.lax.cond(needed(carry), retry_all, keep, carry)
  return state, result, retries


def retry_steps(attempt: Callable[[DynamicScaleState], tuple[Any, jax.Array]], max_retries: int):
  """The two steps of a retry loop on the carry ``(retries, state, result, finite)``.

  ``needed(carry)``: the last attempt overflowed, fewer than ``max_retries`` retries ran
  and a backoff still changes the scale. ``again(carry)``: back off once and run
  ``attempt`` at the new scale. :func:`retry_loop` arranges them; the benchmarks of its
  other forms (``benchmarks/retry_plan.py``) arrange the same two.
  """

  def needed(carry):
    retries, state, _, finite = carry
    backed_off = update_scale(state, jnp.asarray(False))
    return (~finite) & (retries < max_retries) & (backed_off.scale != state.scale)

  def again(carry):
    retries, state, _, _ = carry
    state = update_scale(state, jnp.asarray(False))
    result, finite = attempt(state)
    return retries + 1, state, result, finite

  return needed, again


def _is_accumulator(x: Any) -> bool:
  return isinstance(x, optax.MultiStepsState)


def replace_scale_state(tree: Any, old: DynamicScaleState, new: DynamicScaleState) -> Any:
  """``tree`` with its one :class:`DynamicScaleState` replaced by ``new``.

  An accumulator (``multi_steps``, an ``optax.MultiStepsState``) around the
  scaler holds gradients of the loss scaled by ``old.scale``: it is multiplied
  by ``new.scale / old.scale`` (exact when both are powers of two), so that
  the accumulated and the coming micro-batches share one scale. It is left
  untouched, bit for bit, when the scale did not change. ``new``'s leaves are
  wrapped as the replaced state's are (an ``nnx.Optimizer``'s variables).
  """
  changed = new.scale != old.scale
  ratio = new.scale / old.scale

  def rescale(acc):
    def one(a):
      if not jnp.issubdtype(jnp.result_type(a), jnp.floating):
        return a
      r = ratio.astype(jnp.result_type(a))
      return jnp.where(changed, a * r, a)

    return jax.tree_util.tree_map(one, acc)

  def visit(node):
    if is_scale_state(node):
      return _like(new, node)
    if _is_accumulator(node) and scale_states(node.inner_opt_state):
      return node._replace(
        acc_grads=rescale(node.acc_grads),
        inner_opt_state=replace_scale_state(node.inner_opt_state, old, new),
      )
    return node

  is_leaf = lambda x: is_scale_state(x) or _is_accumulator(x)
  return jax.tree_util.tree_map(visit, tree, is_leaf=is_leaf)


def _plain(state: DynamicScaleState) -> DynamicScaleState:
  """``state`` with array leaves (an ``nnx.Optimizer`` wraps each one in a variable)."""
  return state.replace(
    **{f: jnp.asarray(getattr(state, f)) for f in DATA_FIELDS},
  )


def _like(new: DynamicScaleState, found: DynamicScaleState) -> DynamicScaleState:
  """``new`` in ``found``'s pytree structure (its leaves wrapped as ``found``'s are)."""
  leaves = jax.tree_util.tree_leaves(new)
  return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(found), leaves)


def retry_on_overflow(
  fun: Callable[..., Any],
  state: ScaleSource,
  *,
  max_retries: int = DEFAULT_MAX_RETRIES,
  argnums: int | Sequence[int] = 0,
  has_aux: bool = False,
  axis_name: AxisName | None = None,
) -> Callable[..., tuple[Any, RetriedGrads]]:
  """Gradients of the scaled loss that are recomputed at a lower scale instead of lost.

  The returned function computes the gradients of ``scale_loss(fun(...),
  state)``, like ``jax.grad``. If any is inf/NaN it backs the scale off by the
  torch rule and computes the same batch's gradients again at the new scale,
  up to ``max_retries`` times, inside the same jitted step (a ``lax.cond``
  whose branch runs only after an overflow; no host control flow).
  It returns ``state`` with its scaler advanced past the overflowing attempts,
  and the last attempt's gradients, which the loss scaler's ``update`` then
  applies once (or skips, if the last retry overflowed too).

  The scale, growth tracker and skip counts are those the torch rule gives
  for the sequence of gradients computed: each overflowing attempt counts as
  a skipped step. A retry is made only when the rule changed the scale (not
  while ``hysteresis`` tolerates the overflow, nor at ``min_scale``, nor for
  a static scaler). ``max_retries=0`` is :func:`scale_loss` and ``jax.grad``,
  bit for bit.

  On a GPU, XLA reads the cond's predicate on the host (one wait a step)
  unless the step is compiled with XLA's CUDA graph options for ``while``
  and ``conditional`` (CUDA >= 12.3), which a library cannot set: pass them
  to ``jax.jit(...).lower(...).compile(compiler_options=...)`` or in
  ``XLA_FLAGS``, as the retry guide shows ("A step the host does not wait
  on").

  Inside :func:`jax_lossscale.multi_steps` (the scaler inside the
  accumulator), the gradients accumulated so far are rescaled to the new scale
  with the retry (exact for powers of two).

  Args:
    fun: the loss function; returns a float scalar loss, or ``(loss, aux)``
      with ``has_aux``. It must
      be a pure function of its arguments: with randomness, pass the key.
    state: what holds the scaler: an optimizer state of
      :func:`dynamic_loss_scale`, any tree around one (``multi_steps``, a
      train state, an ``nnx.Optimizer``'s ``opt_state``), or a
      :class:`DynamicScaleState`.
    max_retries: how many recomputations at most, ``>= 0``.
    argnums: as in ``jax.grad``.
    has_aux: as in ``jax.grad``.
    axis_name: inside ``shard_map``/``pmap``, the axis over which the
      overflow flag is combined, so that every device retries together (the
      gradients are not averaged: as for :func:`dynamic_loss_scale`, that is
      ``fun``'s or the optimizer's business). Not needed under ``jit``.

  Returns:
    A function with ``fun``'s signature returning ``(new_state,
    RetriedGrads(value, aux, grads, retries))``; ``new_state`` has
    ``state``'s structure, with plain arrays in its scaler.

  Raises:
    TypeError: ``fun`` is not callable, ``max_retries`` is not an integer, or
      ``state`` is not a state (``None``, a number, a string).
    ValueError: ``max_retries`` is negative, or ``state`` holds no loss
      scaler or several.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import jax_lossscale as jls
    >>> tx = jls.dynamic_loss_scale(optax.sgd(0.1))
    >>> w = jnp.ones(2)
    >>> opt_state = tx.init(w)
    >>> loss_fn = lambda w: jnp.sum(w.astype(jnp.float16))  # 65536 overflows its backward
    >>> opt_state, out = jls.retry_on_overflow(loss_fn, opt_state)(w)
    >>> int(out.retries), float(jls.get_scale_state(opt_state).scale)
    (1, 32768.0)
    >>> updates, opt_state = tx.update(out.grads, opt_state, w)  # applied once
    >>> optax.apply_updates(w, updates), int(jls.get_scale_state(opt_state).skipped_steps)
    (Array([0.9, 0.9], dtype=float32), 1)
  """
  if not callable(fun):
    raise TypeError(f"fun must be callable, got {type(fun).__name__}.")
  max_retries = check_max_retries(max_retries)
  if state is None or isinstance(state, (str, bytes, int, float)):
    raise TypeError(
      "state must be an optimizer state, train state or DynamicScaleState holding one "
      f"loss scaler, got {type(state).__name__}."
    )
  check_accumulation(state)
  found = get_scale_state(state)

  def scaled_fun(scale, *args, **kwargs):
    loss, aux = loss_and_aux(fun(*args, **kwargs), has_aux)
    return scale_loss(loss, scale), (loss, aux)

  shifted = (argnums + 1) if isinstance(argnums, int) else tuple(a + 1 for a in argnums)
  grad_fn = jax.grad(scaled_fun, argnums=shifted, has_aux=True)

  def wrapped(*args, **kwargs) -> tuple[Any, RetriedGrads]:
    first = _plain(found)

    def attempt(scale_state):
      grads, (loss, aux) = grad_fn(scale_state.scale, *args, **kwargs)
      refuse_complex(grads)
      _, finite = unscale_and_check(gradient_leaves(grads), scale_state.scale)
      return (grads, loss, aux), all_devices_finite(finite, axis_name)

    last, (grads, loss, aux), retries = retry_loop(attempt, first, max_retries)
    new_state = replace_scale_state(state, first, last)
    return new_state, RetriedGrads(value=loss, aux=aux, grads=grads, retries=retries)

  return wrapped
