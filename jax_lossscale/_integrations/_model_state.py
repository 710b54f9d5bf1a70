"""A skipped step leaves the model's own state as it was: :func:`keep_if_skipped`.

The forward pass of a training step updates state that is not a parameter:
BatchNorm's running statistics (linen's ``batch_stats`` collection, NNX's
``BatchStat`` variables, Equinox's ``eqx.nn.State``), a spectral norm's power
iterations, a counter. A skipped step keeps the params and the optimizer state;
this keeps that state too, with the same ``jnp.where`` (no ``lax.cond``, no host
sync), bit for bit. :meth:`jax_lossscale.flax.TrainState.apply_gradients` does it
for its extra fields; the other routes call :func:`keep_if_skipped` after the
optimizer's update.
"""

from __future__ import annotations

from typing import Any
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np

from jax_lossscale._scaler._state import get_scale_state
from jax_lossscale._typing import PyTree
from jax_lossscale._typing import ScaleSource


def last_step_skipped(state: ScaleSource) -> jax.Array:
  """bool[]: was the last update of the scaler in ``state`` a skipped step?"""
  # jnp.asarray also reads nnx.Variable leaves (an nnx.Optimizer's opt_state).
  return jnp.asarray(get_scale_state(state).consecutive_skips, jnp.int32) > 0


def _is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.number, np.bool_, bool, int, float))


def select_tree(take_new: jax.Array, new: PyTree, old: PyTree, name: str, hint: str = "") -> PyTree:
  """``new`` where ``take_new``, else ``old``: one ``jnp.where`` per array leaf.

  ``new`` and ``old`` must have the same structure, and each pair of array
  leaves the same shape and dtype (a skipped step cannot change a type).
  Other leaves (strings, callables held in a pytree) must be the same object
  in both, and are passed through.

  Raises:
    ValueError: naming ``name`` and the leaf's path, for a mismatch.
  """
  new_leaves, treedef = jax.tree_util.tree_flatten_with_path(new)
  old_leaves, old_treedef = jax.tree_util.tree_flatten(old)
  if cast(Any, old_treedef) != treedef:  # mypy reads jaxlib's PyTreeDef stub as unknown
    raise ValueError(
      f"{name}: the new value's structure {treedef} differs from the old one's "
      f"{old_treedef}; a skipped step must be able to put the old value back.{hint}"
    )
  out = []
  for (path, a), b in zip(new_leaves, old_leaves):
    where = f"{name}{jax.tree_util.keystr(path)}"
    if not (_is_array(a) and _is_array(b)):
      if a is not b:
        raise ValueError(
          f"{where}: a leaf that is not an array changed ({b!r} -> {a!r}); a skipped step "
          "cannot keep it with jnp.where."
        )
      out.append(a)
      continue
    sa, sb = jnp.shape(a), jnp.shape(b)
    da, db = jnp.result_type(a), jnp.result_type(b)
    if sa != sb or da != db:
      raise ValueError(
        f"{where}: the new value is {da}{list(sa)}, the old one {db}{list(sb)}; a skipped "
        f"step must be able to put the old value back, so shape and dtype must not change.{hint}"
      )
    out.append(jnp.where(take_new, a, b))
  return jax.tree_util.tree_unflatten(treedef, out)


def keep_if_skipped(state: ScaleSource, new: PyTree, old: PyTree) -> PyTree:
  """The model state of a step: ``new``, or ``old`` if the step was skipped.

  Call it after the optimizer's update, with the state that update returned
  (its scaler knows whether the step was skipped), the model state the
  forward pass produced (``new``: BatchNorm's running statistics, an
  ``eqx.nn.State``, NNX ``BatchStat`` variables) and the one it started from
  (``old``). A skipped step then leaves the model state bit-identical, as it
  leaves the params and the optimizer state. One ``jnp.where`` per leaf: no
  ``lax.cond``, no host sync; use it inside ``jit``.

  An inf or NaN in a batch makes its statistics non-finite, and running
  statistics that take them stay NaN for good (every later evaluation is
  NaN); a batch whose backward overflowed has finite statistics, which some
  users prefer to keep: that is the one reason not to call this.

  ``state`` must be the state *after* the update: before it, it still tells
  about the previous step. Under :func:`jax_lossscale.multi_steps` it tells
  about the last optimizer step taken, not about the current mini-step.

  Args:
    state: the optimizer state returned by the update (an Optax state holding
      a loss scaler, a train state, an ``nnx.Optimizer``'s ``opt_state``, a
      :class:`jax_lossscale.DynamicScaleState`).
    new: the model state after the step's forward pass.
    old: the model state before it; same structure, shapes and dtypes.

  Returns:
    ``new``, or ``old`` where the step was skipped, leaf by leaf.

  Raises:
    ValueError: ``state`` holds no loss scaler (or several); ``new`` and
      ``old`` differ in structure, shape or dtype (naming the leaf).

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import jax_lossscale as jls
    >>> tx = jls.dynamic_loss_scale(optax.sgd(0.1))
    >>> opt_state = tx.init({"w": jnp.zeros(2)})
    >>> stats = {"mean": jnp.zeros(2)}
    >>> new_stats = {"mean": jnp.array([jnp.nan, 1.0])}  # a batch with an inf
    >>> _, opt_state = tx.update({"w": jnp.array([jnp.nan, 1.0])}, opt_state)
    >>> jls.keep_if_skipped(opt_state, new_stats, stats)["mean"]
    Array([0., 0.], dtype=float32)
  """
  return select_tree(jnp.logical_not(last_step_skipped(state)), new, old, "new")
