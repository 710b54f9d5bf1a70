"""Loss scaling in a loop you do not own: one NNX variable shared by the model and its optimizer.

A trainer such as tunix's ``PeftTrainer`` builds ``nnx.Optimizer(model, tx, wrt=...)``
itself, calls ``loss_fn(model, batch)`` under ``nnx.value_and_grad`` and hands the
gradients to ``optimizer.update(model, grads)``. The loss function never sees the
optimizer, so it cannot call :func:`jax_lossscale.scale_loss`. Instead:

* :class:`LossScaledModel` wraps the model. Its forward pass is the model's, unchanged
  (the loss the trainer reports is not scaled); in the backward pass it multiplies the
  cotangent of the model's output by the scale, so the gradients that reach the params
  are the gradients of the scaled loss.
* :func:`link_loss_scale` makes the wrapper read the scale from the very ``nnx.Variable``
  that holds it in the optimizer's state (the ``scale`` of the
  :class:`~jax_lossscale.DynamicScaleState` inside ``optimizer.opt_state``). The loss
  scaler inside the optimizer unscales, checks and skips as always, and every update of
  the scale is seen by the next forward pass: the two are one object, in and out of
  ``nnx.jit``.

The shared variable is an optimizer-state variable (``nnx.optimizer.OptArray``), never an
``nnx.Param``: ``nnx.grad`` gives it no gradient, and an optimizer built with
``wrt=nnx.Param`` (or ``nnx.LoRAParam``) never updates it as a param.
"""

from __future__ import annotations

from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp

from jax_lossscale._scaler._numerics import compute_dtype
from jax_lossscale._scaler._signals import check_accumulation
from jax_lossscale._scaler._state import scale_states


@jax.custom_vjp
def _scaled_backward(xs: list[jax.Array], scale: jax.Array) -> list[jax.Array]:
  """The identity on ``xs``, whose backward pass multiplies each cotangent by ``scale``."""
  return xs


def _scaled_backward_fwd(xs: list[jax.Array], scale: jax.Array) -> tuple[list[jax.Array], Any]:
  return xs, scale


def _scaled_backward_bwd(scale: jax.Array, cts: list[jax.Array]) -> tuple[Any, jax.Array]:
  def one(ct: jax.Array) -> jax.Array:
    # The product is rounded once, to the cotangent's dtype: an overflow is an inf that
    # the loss scaler's check sees, exactly as with a scaled loss.
    dt = compute_dtype(ct.dtype)
    return (ct.astype(dt) * scale.astype(dt)).astype(ct.dtype)

  return [one(ct) for ct in cts], jnp.zeros_like(scale)


_scaled_backward.defvjp(_scaled_backward_fwd, _scaled_backward_bwd)


def scaled_backward(tree: Any, scale: jax.Array) -> Any:
  """``tree``, unchanged, with the cotangent of each floating leaf multiplied by ``scale``.

  Non-floating leaves (token ids, masks, a cache's integer positions) pass through.
  """
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  where = [
    i
    for i, x in enumerate(leaves)
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating)
  ]
  if not where:
    return tree
  scaled = _scaled_backward([leaves[i] for i in where], jnp.asarray(scale, jnp.float32))
  for i, x in zip(where, scaled):
    leaves[i] = x
  return jax.tree_util.tree_unflatten(treedef, leaves)


def _check_output_dtype(output_dtype: Any) -> Any:
  if output_dtype is None:
    return None
  try:
    dtype = jnp.dtype(output_dtype)
  except TypeError as e:
    raise TypeError(f"output_dtype must be a floating dtype or None, got {output_dtype!r}.") from e
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"output_dtype must be a floating dtype or None, got {dtype}.")
  return dtype


class LossScaledModel(nnx.Module):
  """A model whose backward pass is scaled by the loss scale of its optimizer.

  Calling it calls ``model`` with the same arguments and returns its output unchanged;
  in the backward pass, the cotangent of every floating-point leaf of the output is
  multiplied by the current loss scale. A loss computed from the output is therefore
  differentiated as if it had been multiplied by the scale, while its value (what a
  trainer logs) is not. Hand the wrapper to the trainer in place of the model, build the
  optimizer with :func:`jax_lossscale.dynamic_loss_scale`, and link the two with
  :func:`link_loss_scale` before the first step; calling an unlinked wrapper raises.

  What is scaled is the backward pass from the model's output on, not the loss
  function's own backward pass: a cotangent that the loss function's backward hands to a
  float16 output below float16's range (entries under 2**-24) is lost before it is scaled.
  ``output_dtype=jnp.float32`` returns the output in float32 (an exact cast), so the
  cotangent is scaled in float32 first and rounded to float16 after, as with a scaled loss.

  Attributes:
    model: the wrapped module.
    loss_scale: the float32 scale variable; after :func:`link_loss_scale` it is the
      optimizer's own variable.
    output_dtype: the dtype of the floating outputs, or ``None`` to keep the model's.

  Examples:
    >>> from flax import nnx
    >>> import jax.numpy as jnp, optax
    >>> import jax_lossscale as jls
    >>> from jax_lossscale.flax import LossScaledModel, link_loss_scale
    >>> model = LossScaledModel(nnx.Linear(2, 1, rngs=nnx.Rngs(0)))
    >>> tx = jls.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0)
    >>> optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    >>> _ = link_loss_scale(model, optimizer)
    >>> loss_fn = lambda m, x: jnp.sum(m(x))       # the loss as the trainer writes it
    >>> loss, grads = nnx.value_and_grad(loss_fn)(model, jnp.ones((1, 2)))
    >>> float(loss) == float(loss_fn(model, jnp.ones((1, 2)))), grads["model"]["bias"][...]
    (True, Array([8.], dtype=float32))
  """

  def __init__(self, model: nnx.Module, *, output_dtype: Any = None):
    if not isinstance(model, nnx.Module):
      raise TypeError(f"model must be an nnx.Module, got {type(model).__name__}.")
    self.model = model
    # An optimizer-state variable, like the one link_loss_scale puts here: the model's
    # state has the same structure before and after linking (a checkpoint restored
    # before the link fits it).
    self.loss_scale = nnx.optimizer.OptArray(jnp.ones([], jnp.float32))
    self.output_dtype = _check_output_dtype(output_dtype)
    self.linked = False

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    if not self.linked:
      raise RuntimeError(
        "This LossScaledModel is not linked to an optimizer: its gradients would not be "
        "scaled while the optimizer unscales them. Call "
        "jax_lossscale.flax.link_loss_scale(model, optimizer) once the nnx.Optimizer "
        "exists (for tunix: link_loss_scale(trainer.model, trainer.optimizer)), before the "
        "first step: a step that froze the model's graph earlier (nnx.cached_partial) keeps "
        "the unlinked wrapper and must be rebuilt."
      )
    out = self.model(*args, **kwargs)
    if self.output_dtype is not None:
      dt = self.output_dtype
      is_float = lambda x: isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating)
      out = jax.tree_util.tree_map(lambda x: x.astype(dt) if is_float(x) else x, out)
    return scaled_backward(out, self.loss_scale[...])


def link_loss_scale(model: nnx.Module, optimizer: nnx.Optimizer) -> nnx.Variable:
  """Makes every :class:`LossScaledModel` in ``model`` read the scale of ``optimizer``.

  The one call that joins a model to its optimizer when the loop is not yours: after it,
  the wrapper's ``loss_scale`` *is* the variable holding the scale in
  ``optimizer.opt_state`` (one object: ``nnx.jit``, ``nnx.value_and_grad``, ``nnx.split``
  and ``nnx.state`` see it once, shared). Call it after the optimizer is built and before
  the first step, e.g. ``link_loss_scale(trainer.model, trainer.optimizer)``; after a
  checkpoint is restored into the optimizer in place (``nnx.update``) the link holds, and
  a freshly built optimizer needs a new call.

  Args:
    model: an ``nnx.Module`` that is, or contains, a :class:`LossScaledModel`.
    optimizer: an ``nnx.Optimizer`` whose transformation holds exactly one loss scaler
      (:func:`jax_lossscale.dynamic_loss_scale`, ``static_loss_scale`` or
      ``no_loss_scale``, possibly inside ``chain``, :func:`jax_lossscale.multi_steps`...).

  Returns:
    The shared scale variable.

  Raises:
    TypeError: ``model`` is not an ``nnx.Module`` or ``optimizer`` not an
      ``nnx.Optimizer``.
    ValueError: ``model`` holds no :class:`LossScaledModel`, or ``optimizer``'s state
      holds no loss scaler or several.
  """
  if not isinstance(model, nnx.Module):
    raise TypeError(f"model must be an nnx.Module, got {type(model).__name__}.")
  if not isinstance(optimizer, nnx.Optimizer):
    raise TypeError(f"optimizer must be an nnx.Optimizer, got {type(optimizer).__name__}.")
  wrappers = [m for _, m in nnx.iter_graph(model) if isinstance(m, LossScaledModel)]
  if not wrappers:
    raise ValueError(
      f"model holds no LossScaledModel (got a {type(model).__name__}): wrap the model, "
      "model = jax_lossscale.flax.LossScaledModel(model), before handing it to the trainer."
    )
  found = scale_states(optimizer.opt_state)
  if len(found) != 1:
    raise ValueError(
      f"optimizer must hold exactly one loss scaler, found {len(found)}"
      + (f" (at {', '.join(p or '<root>' for p, _ in found)})" if found else "")
      + ": build it from jax_lossscale.dynamic_loss_scale(tx) (one wrapper around all "
      "param groups)."
    )
  variable = found[0][1].scale
  if not isinstance(variable, nnx.Variable):
    raise TypeError(
      f"optimizer.opt_state holds its scale as a {type(variable).__name__}, not an "
      "nnx.Variable: is this an nnx.Optimizer from Flax >= 0.12?"
    )
  check_accumulation(optimizer.opt_state)
  for w in wrappers:
    w.loss_scale = variable
    w.linked = True
  return variable
