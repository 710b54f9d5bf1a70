"""The Optax wrappers: dynamic, static and disabled loss scaling."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_lossscale._numerics import _is_float, compute_dtype, unscale_and_check
from jax_lossscale._rule import update_scale
from jax_lossscale._skip import exact_one, ordered_after, select_once, select_state, skip_update
from jax_lossscale._state import (
    MAX_F32,
    MIN_NORMAL_F32,
    DynamicScaleConfig,
    DynamicScaleState,
)


class LossScaleState(NamedTuple):
  """Optimizer state of the loss-scaling wrappers.

  Attributes:
    loss_scale: the :class:`DynamicScaleState` (scale, trackers, counters).
    inner_state: the wrapped transformation's state; float16/bfloat16 leaves
      of ``params`` are promoted to float32 before ``inner.init`` sees them.
  """

  loss_scale: DynamicScaleState
  inner_state: optax.OptState


def _promote(tree: Any) -> Any:
  """Promotes floating leaves to at least float32 (half precision -> float32)."""

  def promote(x):
    if x is None or not _is_float(x):
      return x
    return jnp.asarray(x).astype(compute_dtype(jnp.result_type(x)))

  return jax.tree_util.tree_map(promote, tree)


def _combine_across(finite: jax.Array, axis_name) -> jax.Array:
  if axis_name is None:
    return finite
  bad = jax.lax.psum((~finite).astype(jnp.int32), axis_name)
  return bad == 0


def _loss_scale_transform(
    inner: optax.GradientTransformation,
    config: DynamicScaleConfig,
    axis_name: Optional[Any],
) -> optax.GradientTransformationExtraArgs:
  if not isinstance(inner, optax.GradientTransformation):
    raise ValueError(
        "inner must be an optax.GradientTransformation, got "
        f"{type(inner).__name__}."
    )
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    return LossScaleState(
        loss_scale=DynamicScaleState.from_config(config),
        inner_state=inner.init(_promote(params)),
    )

  def update_fn(updates, state, params=None, **extra_args):
    if not isinstance(state, LossScaleState):
      raise ValueError(
          "state must be the LossScaleState made by this transformation's init, "
          f"got {type(state).__name__}."
      )
    grads, finite = unscale_and_check(updates, state.loss_scale.scale)
    finite = _combine_across(finite, axis_name)
    new_updates, new_inner = inner.update(
        grads, state.inner_state, _promote(params), **extra_args
    )
    # Back to each gradient's own dtype (optax convention; MultiSteps needs it).
    new_updates = jax.tree_util.tree_map(
        lambda n, u: n if u is None else jnp.asarray(n).astype(jnp.result_type(u)),
        new_updates,
        updates,
        is_leaf=lambda x: x is None,
    )
    # See _skip.py: updates computed once, old state read before it is replaced.
    skipped = jax.tree_util.tree_map(skip_update, new_updates)
    one = exact_one(state.loss_scale.scale)
    new_updates = select_once(finite, new_updates, skipped, one)
    new_inner = select_state(
        ordered_after(finite, new_updates), new_inner, state.inner_state
    )
    new_scale = update_scale(state.loss_scale, finite)
    return new_updates, LossScaleState(loss_scale=new_scale, inner_state=new_inner)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def dynamic_loss_scale(
    inner: optax.GradientTransformation,
    *,
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    min_scale: float = MIN_NORMAL_F32,
    max_scale: float = MAX_F32,
    hysteresis: int = 1,
    axis_name: Optional[Any] = None,
) -> optax.GradientTransformationExtraArgs:
  """Wraps ``inner`` with ``torch.amp.GradScaler``'s dynamic loss scaling.

  ``update`` receives the gradients of the *scaled* loss (see
  :func:`scale_loss`). It unscales them by multiplying with the float32
  reciprocal of the scale, checks them for inf/NaN in the same pass, runs
  ``inner`` on the true gradients and adjusts the scale. When any gradient is
  non-finite the whole step is skipped with ``jnp.where`` (no ``lax.cond``, no
  host control flow, no host sync): the returned updates are zeros (``-0.0``,
  so ``optax.apply_updates`` leaves params bit-identical) and ``inner``'s state
  is returned unchanged, so its step count and schedules do not advance.

  Float16/bfloat16 leaves are promoted to float32 for ``inner`` (gradients,
  params and therefore ``inner``'s state); updates come back in each
  gradient's own dtype.

  Args:
    inner: the transformation to apply to the unscaled gradients.
    init_scale: initial scale (torch: 2**16).
    growth_factor: growth multiplier, > 1 (torch: 2.0).
    backoff_factor: backoff multiplier, in (0, 1) (torch: 0.5).
    growth_interval: clean steps in a row before growing (torch: 2000).
    min_scale: floor of the scale (default: smallest normal float32).
    max_scale: ceiling of the scale (default: largest float32).
    hysteresis: overflows tolerated before backing off (1 = torch).
    axis_name: inside ``pmap``/``shard_map``, the axis over which the
      overflow flag is combined, so that every device skips together. Not
      needed under ``jit`` with sharded arrays.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs`; extra keyword
    arguments of ``update`` are passed through to ``inner``.

  Raises:
    ValueError: naming the argument, for invalid configuration.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import jax_lossscale as jls
    >>> params = {"w": jnp.ones(3)}
    >>> tx = jls.dynamic_loss_scale(optax.sgd(0.1))
    >>> opt_state = tx.init(params)
    >>> loss_fn = lambda p: jnp.sum(p["w"] ** 2)
    >>> scaled_loss = lambda p: jls.scale_loss(loss_fn(p), opt_state)
    >>> grads = jax.grad(scaled_loss)(params)        # gradients of the scaled loss
    >>> updates, opt_state = tx.update(grads, opt_state, params)
    >>> optax.apply_updates(params, updates)["w"]    # 1 - 0.1 * 2
    Array([0.8, 0.8, 0.8], dtype=float32)
  """
  config = DynamicScaleConfig(
      init_scale=init_scale,
      growth_factor=growth_factor,
      backoff_factor=backoff_factor,
      growth_interval=growth_interval,
      min_scale=min_scale,
      max_scale=max_scale,
      hysteresis=hysteresis,
  )
  return _loss_scale_transform(inner, config, axis_name)


def static_loss_scale(
    inner: optax.GradientTransformation,
    scale: float,
    *,
    axis_name: Optional[Any] = None,
) -> optax.GradientTransformationExtraArgs:
  """Wraps ``inner`` with a fixed loss scale.

  Like :func:`dynamic_loss_scale` but the scale never changes: gradients are
  unscaled by ``scale``, and a step with non-finite gradients is still skipped
  (and counted), never applied.

  Args:
    inner: the transformation to apply to the unscaled gradients.
    scale: the fixed loss scale, positive and finite.
    axis_name: see :func:`dynamic_loss_scale`.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs`.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import jax_lossscale as jls
    >>> tx = jls.static_loss_scale(optax.sgd(1.0), 128.0)
    >>> state = tx.init({"w": jnp.zeros(2)})
    >>> updates, state = tx.update({"w": jnp.array([128.0, 256.0])}, state)
    >>> updates["w"], float(jls.get_scale_state(state).scale)
    (Array([-1., -2.], dtype=float32), 128.0)
  """
  if isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)):
    raise ValueError(f"scale must be a Python float, got {scale!r}.")
  if not MIN_NORMAL_F32 <= float(scale) <= MAX_F32:
    raise ValueError(
        f"scale must be positive, finite and a normal float32, got {scale!r}."
    )
  config = DynamicScaleConfig(init_scale=float(scale), dynamic=False)
  return _loss_scale_transform(inner, config, axis_name)


def no_loss_scale(
    inner: optax.GradientTransformation,
    *,
    axis_name: Optional[Any] = None,
) -> optax.GradientTransformationExtraArgs:
  """Loss scaling switched off: scale 1, with the same state and API.

  For bfloat16 and float32 training, which need no loss scaling: the same
  training code (``scale_loss``, ``get_scale_state``, metrics) keeps working.
  Multiplying by 1 is exact, so updates equal ``inner``'s bit for bit; steps
  with non-finite gradients are still skipped, as by ``optax.apply_if_finite``
  (but never given up on).

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import jax_lossscale as jls
    >>> tx = jls.no_loss_scale(optax.sgd(1.0))
    >>> state = tx.init({"w": jnp.zeros(2)})
    >>> tx.update({"w": jnp.array([1.0, 2.0])}, state)[0]["w"]
    Array([-1., -2.], dtype=float32)
  """
  return static_loss_scale(inner, 1.0, axis_name=axis_name)


def get_scale_state(tree: Any) -> DynamicScaleState:
  """Finds the :class:`DynamicScaleState` in an optimizer state or train state.

  Searches any nesting of Optax states (``chain``, ``MultiSteps``,
  ``inject_hyperparams``, ``masked``, ``partition``, ...) and any pytree
  holding one (a Flax ``TrainState``, an ``nnx.Optimizer``'s state). Pure
  structure inspection: fine inside ``jit``.

  Args:
    tree: a :class:`DynamicScaleState`, or a pytree containing exactly one.

  Returns:
    The :class:`DynamicScaleState`.

  Raises:
    ValueError: if there is none, or more than one.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import jax_lossscale as jls
    >>> tx = optax.MultiSteps(jls.dynamic_loss_scale(optax.adam(1e-3)), 4)
    >>> jls.get_scale_state(tx.init({"w": jnp.zeros(2)})).scale
    Array(65536., dtype=float32)
  """
  if isinstance(tree, DynamicScaleState):
    return tree
  found = [
      x
      for x in jax.tree_util.tree_leaves(
          tree, is_leaf=lambda x: isinstance(x, DynamicScaleState)
      )
      if isinstance(x, DynamicScaleState)
  ]
  if len(found) == 1:
    return found[0]
  if not found:
    raise ValueError(
        "No DynamicScaleState found in the given tree "
        f"({type(tree).__name__}); was the optimizer built with "
        "jax_lossscale.dynamic_loss_scale?"
    )
  raise ValueError(
      f"Found {len(found)} DynamicScaleStates in the given tree; pass the one "
      "you mean (e.g. the sub-state of one partition)."
  )


def scale_loss(loss: Any, state: Any) -> jax.Array:
  """The loss multiplied by the current scale, in at least float32.

  A float16 loss is promoted to float32 first, so ``loss * 65536`` cannot
  overflow through weak typing; the gradients of the result are the scaled
  gradients :func:`dynamic_loss_scale` expects.

  Args:
    loss: scalar (or array) loss.
    state: a :class:`DynamicScaleState`, or any tree containing one (an
      optimizer state, a train state).

  Returns:
    ``loss * scale`` in ``promote_types(loss.dtype, float32)``.

  Examples:
    >>> import jax.numpy as jnp
    >>> import jax_lossscale as jls
    >>> s = jls.DynamicScaleState.create()
    >>> jls.scale_loss(jnp.float16(2.0), s)   # 2 * 65536 > float16 max
    Array(131072., dtype=float32)
  """
  scale = get_scale_state(state).scale
  loss = jnp.asarray(loss)
  if not _is_float(loss):
    raise ValueError(f"loss must be a floating-point array, got dtype {loss.dtype}.")
  dt = compute_dtype(loss.dtype)
  return loss.astype(dt) * scale.astype(dt)
