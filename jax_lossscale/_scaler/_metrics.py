"""Metrics for loggers: the scaler's scalars, and which gradients overflowed."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_lossscale._scaler._numerics import is_float
from jax_lossscale._scaler._state import get_scale_state
from jax_lossscale._typing import PyTree
from jax_lossscale._typing import ScaleSource


def metrics(state: ScaleSource) -> dict[str, jax.Array]:
  """The loss scaler's state as a flat dict of scalars, for a logger.

  Works on anything :func:`get_scale_state` finds a scaler in: an Optax
  optimizer state (any nesting), a Flax ``TrainState`` (stock, holding the
  optimizer state, or :class:`jax_lossscale.flax.TrainState`), an
  ``nnx.Optimizer``'s ``opt_state`` or a :class:`DynamicScaleState`. Every
  value is a JAX scalar array: no host sync, fine inside ``jit`` (return the
  dict from the train step, convert on the host when logging).

  A skipped step is an event, not a failure: the update was not applied and
  the scale backed off, which is how dynamic loss scaling finds its scale.
  Worry only when ``consecutive_skips`` keeps growing.

  Args:
    state: a :class:`DynamicScaleState` or any tree holding exactly one.

  Returns:
    dict: ``{"scale": float32[], "growth_tracker": int32[],
    "last_step_skipped": bool[], "skipped_steps": int32[],
    "consecutive_skips": int32[]}``.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import jax_lossscale as jls
    >>> tx = jls.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0)
    >>> opt_state = tx.init({"w": jnp.zeros(2)})
    >>> _, opt_state = tx.update({"w": jnp.array([1.0, jnp.inf])}, opt_state)
    >>> {k: v.item() for k, v in jls.metrics(opt_state).items()}
    {'scale': 4.0, 'growth_tracker': 0, 'last_step_skipped': True, 'skipped_steps': 1, 'consecutive_skips': 1}
  """
  s = get_scale_state(state)
  # jnp.asarray also reads nnx.Variable leaves (an nnx.Optimizer's opt_state).
  consecutive = jnp.asarray(s.consecutive_skips, jnp.int32)
  return {
    "scale": jnp.asarray(s.scale, jnp.float32),
    "growth_tracker": jnp.asarray(s.growth_tracker, jnp.int32),
    "last_step_skipped": consecutive > 0,
    "skipped_steps": jnp.asarray(s.skipped_steps, jnp.int32),
    "consecutive_skips": consecutive,
  }


def nonfinite_leaves(grads: PyTree) -> PyTree:
  """Which gradient leaves hold an inf or NaN: a pytree of bool scalars.

  Tells which layer overflowed, without a host sync: compute it inside the
  train step (on the scaled gradients, before the optimizer) and return it
  with the metrics. Non-floating leaves are reported as ``False``; ``None``
  leaves stay ``None``. Use ``jax.tree_util.tree_flatten_with_path`` (or
  ``optax.tree_utils``) on the host to turn it into names.

  Args:
    grads: a pytree of gradients (scaled or unscaled).

  Returns:
    A pytree of the same structure with a ``bool[]`` per leaf.

  Examples:
    >>> import jax.numpy as jnp
    >>> import jax_lossscale as jls
    >>> jls.diagnostics.nonfinite_leaves({"dense": jnp.array([1.0, jnp.inf]), "bias": jnp.zeros(2)})
    {'bias': Array(False, dtype=bool), 'dense': Array(True, dtype=bool)}
  """

  def leaf(g):
    if not is_float(g):
      return jnp.zeros([], jnp.bool_)
    return jnp.logical_not(jnp.all(jnp.isfinite(g)))

  return jax.tree_util.tree_map(leaf, grads)
