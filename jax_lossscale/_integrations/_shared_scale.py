"""Loss scaling in a loop you do not own: one NNX variable shared by the model and its optimizer.

A trainer such as tunix's ``PeftTrainer`` builds ``nnx.Optimizer(model, tx, wrt=...)``
itself, calls ``loss_fn(model, batch)`` under ``nnx.value_and_grad`` and hands the
gradients to ``optimizer.update(model, grads)``. The loss function never sees the
optimizer, so it cannot call :func:`jax_lossscale.scale_loss`. Instead
:func:`link_loss_scale` installs the scaling *inside* the model, in place:

* the model keeps its identity: the same object, its attributes and methods, its
  params at the same paths; only its class becomes a subclass of its own class (and of
  :class:`LossScaledModel`), whose ``__call__`` is the model's, unchanged forward (the
  loss the trainer reports is not scaled), with a backward pass that multiplies the
  cotangent of the model's output by the scale;
* the model's ``loss_scale`` attribute *is* the ``nnx.Variable`` that holds the scale in
  the optimizer's state (the ``scale`` of the :class:`~jax_lossscale.DynamicScaleState`
  inside ``optimizer.opt_state``): the loss scaler inside the optimizer unscales, checks
  and skips as always, and every update of the scale is seen by the next forward pass,
  in and out of ``nnx.jit``.

Installing rather than wrapping: a wrapper module hides the model's attributes from code
that inspects it (``config``, ``init_cache``, ``get_attention_mask``: tunix's RLCluster,
Sampler, DPOTrainer) and moves every param under a new path, so weight syncs and
checkpoints between the wrapped model and a bare one do not line up. A graph taken before
the link (tunix's Sampler keeps ``nnx.graphdef(model)`` from its constructor) is the bare
model's, so sampling from it needs no link.

The shared variable is an optimizer-state variable (``nnx.optimizer.OptArray``), never an
``nnx.Param``: ``nnx.grad`` gives it no gradient, and an optimizer built with
``wrt=nnx.Param`` (or ``nnx.LoRAParam``) never updates it as a param.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING
from typing import Any
from typing import cast

from flax import nnx
import jax
import jax.numpy as jnp

from jax_lossscale._scaler._numerics import compute_dtype
from jax_lossscale._scaler._signals import in_stock_multisteps
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

_NOT_LINKED = (
  "This model's loss scaling is not linked to an optimizer: its gradients would not be "
  "scaled while the optimizer unscales them. Call "
  "jax_lossscale.flax.link_loss_scale(model, optimizer) once the nnx.Optimizer exists "
  "(for tunix: link_loss_scale(trainer.model, trainer.optimizer)), before the first "
  "step: a step that froze the model's graph earlier (nnx.cached_partial) keeps the "
  "unlinked model and must be rebuilt."
)


@jax.custom_vjp
def _forward_only(xs: list[jax.Array]) -> list[jax.Array]:
  """The identity on ``xs``; differentiating it raises (an unlinked model)."""
  return xs


def _forward_only_fwd(xs: list[jax.Array]) -> tuple[list[jax.Array], None]:
  return xs, None


def _forward_only_bwd(_: None, cts: list[jax.Array]) -> tuple[list[jax.Array]]:
  raise RuntimeError(_NOT_LINKED)


_forward_only.defvjp(_forward_only_fwd, _forward_only_bwd)


def _is_float(x: Any) -> bool:
  return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating)


def _on_floats(tree: Any, fn: Any) -> Any:
  """``tree`` with its floating leaves replaced by ``fn(list of those leaves)``."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  where = [i for i, x in enumerate(leaves) if _is_float(x)]
  if not where:
    return tree
  for i, x in zip(where, fn([leaves[i] for i in where])):
    leaves[i] = x
  return jax.tree_util.tree_unflatten(treedef, leaves)


def scaled_backward(tree: Any, scale: jax.Array) -> Any:
  """``tree``, unchanged, with the cotangent of each floating leaf multiplied by ``scale``.

  Non-floating leaves (token ids, masks, a cache's integer positions) pass through.
  """
  scale = jnp.asarray(scale, jnp.float32)
  return _on_floats(tree, lambda xs: _scaled_backward(xs, scale))


def cast_logits(out: Any, dtype: Any) -> Any:
  """The model's output with its logits cast to ``dtype``; every other leaf as it was.

  The logits are the output itself when it is an array, else the first element of a
  tuple or list output (tunix's models return ``(logits, cache)``: the KV cache keeps its
  dtype, as decoding needs).
  """
  if isinstance(out, jax.Array):
    return out.astype(dtype) if _is_float(out) else out
  if isinstance(out, (tuple, list)) and out and isinstance(out[0], jax.Array):
    first = out[0].astype(dtype) if _is_float(out[0]) else out[0]
    rest = list(out[1:])
    # A namedtuple is rebuilt from its fields, a tuple or list from an iterable.
    return type(out)(first, *rest) if hasattr(out, "_fields") else type(out)([first, *rest])
  raise TypeError(
    "output_dtype casts the logits: the model's output, or the first element of a tuple or "
    f"list output, as an array; got a {type(out).__name__}"
    + (
      f" whose first element is a {type(out[0]).__name__}"
      if isinstance(out, (tuple, list)) and out
      else ""
    )
    + ". Cast inside the model or the loss function instead, with output_dtype=None."
  )


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
  """The mark of a model whose backward pass is scaled by its optimizer's loss scale.

  Never built directly: :func:`link_loss_scale` (or :func:`install_loss_scale`) turns a
  model of class ``C`` into an instance of a subclass of ``C`` and of this class, in
  place, so ``isinstance(model, C)`` and ``isinstance(model, LossScaledModel)`` both hold
  and the subclass keeps ``C``'s name. Its ``__call__`` is ``C.__call__`` (same signature)
  followed by:

  * with ``output_dtype``: the logits cast to it (see :func:`cast_logits`: the output, or
    the first element of a tuple or list output; the KV cache and every other leaf keep
    their dtypes);
  * linked: the cotangent of every floating-point leaf of the output multiplied by the
    current loss scale in the backward pass, so a loss computed from the output is
    differentiated as if it had been multiplied by the scale, while its value (what a
    trainer logs) is not;
  * not linked: the output unchanged; a forward pass runs (sampling, evaluation), and
    differentiating it raises ``RuntimeError``.

  What is scaled is the backward pass from the model's output on, not the loss function's
  own: a cotangent that the loss function's backward hands to a float16 output below
  float16's range (entries under 2**-24) is lost before it is scaled.
  ``output_dtype=jnp.float32`` returns the logits in float32 (an exact cast), so their
  cotangent is scaled in float32 first and rounded to float16 after, as with a scaled loss.

  Attributes:
    loss_scale: the float32 scale variable, once linked the optimizer's own (or the
      placeholder :func:`install_loss_scale` adds).
  """

  #: The dtype of the logits, or None to keep the model's (set on each subclass).
  _loss_scale_output_dtype: Any = None
  #: Set on the instance by link_loss_scale.
  _loss_scale_linked: bool = False

  if TYPE_CHECKING:
    loss_scale: nnx.Variable


_CLASSES: dict[tuple[type, Any], type] = {}


def _scaled_class(cls: type, output_dtype: Any) -> type:
  """The subclass of ``cls`` and :class:`LossScaledModel`, one per ``(cls, output_dtype)``
  (so that graphs and jit caches see the same class every time)."""
  key = (cls, output_dtype)
  if key not in _CLASSES:
    call = cls.__call__

    @functools.wraps(call)
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
      out = call(self, *args, **kwargs)
      if output_dtype is not None:
        out = cast_logits(out, output_dtype)
      if not self._loss_scale_linked:
        return _on_floats(out, _forward_only)
      return scaled_backward(out, self.loss_scale[...])

    namespace = {
      "__call__": __call__,
      "__module__": cls.__module__,
      "__qualname__": cls.__qualname__,
      "__doc__": cls.__doc__,
      "_loss_scale_output_dtype": output_dtype,
    }
    _CLASSES[key] = type(cls.__name__, (cls, LossScaledModel), namespace)
  return _CLASSES[key]


def _check_model(model: Any, output_dtype: Any) -> Any:
  if not isinstance(model, nnx.Module):
    raise TypeError(f"model must be an nnx.Module, got {type(model).__name__}.")
  if not callable(model):
    raise TypeError(f"model must be callable, got a {type(model).__name__} without __call__.")
  return _check_output_dtype(output_dtype)


def _install(model: nnx.Module, output_dtype: Any) -> LossScaledModel:
  if "loss_scale" in vars(model):
    raise ValueError(
      f"model already has an attribute loss_scale (a {type(vars(model)['loss_scale']).__name__}): "
      "the installed scaling keeps its scale there."
    )
  object.__setattr__(model, "__class__", _scaled_class(type(model), output_dtype))
  return cast(LossScaledModel, model)


def install_loss_scale(model: nnx.Module, *, output_dtype: Any = None) -> nnx.Module:
  """Installs loss scaling in ``model`` before a trainer is built, with a placeholder scale.

  For a trainer that restores a checkpoint of the model's whole state while it is built
  (tunix's ``PeftTrainer`` with full-parameter training): the model's state then holds
  ``loss_scale`` (an ``OptArray``, 1.0) from the start, so a checkpoint saved after
  :func:`link_loss_scale` restores into it. Not for RL: tunix's ``RLCluster`` builds its
  sampler from the model and syncs only ``nnx.Param`` state into it, so hand it the bare
  model and call :func:`link_loss_scale` alone. Until linked, the model's forward pass is
  its own and differentiating it raises.

  Args:
    model: an ``nnx.Module``; changed in place (see :class:`LossScaledModel`).
    output_dtype: the dtype of the logits, or ``None`` to keep the model's.

  Returns:
    ``model`` itself.

  Raises:
    TypeError: ``model`` is not an ``nnx.Module``, or ``output_dtype`` not a dtype.
    ValueError: ``output_dtype`` is not floating, ``model`` is already installed, or it
      has an attribute ``loss_scale`` of its own.

  Examples:
    >>> from flax import nnx
    >>> import jax.numpy as jnp, optax
    >>> import jax_lossscale as jls
    >>> model = jls.flax.install_loss_scale(nnx.Linear(2, 1, rngs=nnx.Rngs(0)))
    >>> sorted(nnx.to_pure_dict(nnx.state(model)))  # a checkpoint's structure from now on
    ['bias', 'kernel', 'loss_scale']
    >>> try:
    ...   nnx.grad(lambda m: jnp.sum(m(jnp.ones((1, 2)))))(model)
    ... except RuntimeError as e:
    ...   print(str(e)[:45])
    This model's loss scaling is not linked to an
    >>> optimizer = nnx.Optimizer(model, jls.dynamic_loss_scale(optax.sgd(0.1)), wrt=nnx.Param)
    >>> jls.flax.link_loss_scale(model, optimizer) is model.loss_scale
    True
  """
  output_dtype = _check_model(model, output_dtype)
  if isinstance(model, LossScaledModel):
    raise ValueError("model already has loss scaling installed.")
  _install(model, output_dtype).loss_scale = nnx.optimizer.OptArray(jnp.ones([], jnp.float32))
  return model


def _check_accumulation(opt_state: Any) -> None:
  """Refuses a loss scaler inside a stock ``optax.MultiSteps`` (tunix's own accumulation)."""
  if in_stock_multisteps(opt_state):
    raise ValueError(
      "optimizer holds the loss scaler inside a stock optax.MultiSteps (tunix's "
      "gradient_accumulation_steps builds one): after one overflowing micro-batch its "
      "accumulator holds NaN, so every later step would be skipped. Leave "
      "gradient_accumulation_steps unset and pass jls.multi_steps(jls.dynamic_loss_scale(tx), k) "
      "(jax_lossscale.multi_steps) as the optimizer."
    )


def link_loss_scale(
  model: nnx.Module, optimizer: nnx.Optimizer, *, output_dtype: Any = None
) -> nnx.Variable:
  """Scales ``model``'s backward pass by the loss scale of ``optimizer``.

  The one call that joins a model to its optimizer when the loop is not yours: call it
  after the optimizer is built and before the first step, e.g.
  ``link_loss_scale(trainer.model, trainer.optimizer)``. It installs the scaling in
  ``model`` in place (see :class:`LossScaledModel`: same object, attributes, methods and
  param paths) unless :func:`install_loss_scale` already did, in ``model`` or in modules
  inside it; then the installed modules' ``loss_scale`` *is* the variable holding the
  scale in ``optimizer.opt_state`` (one object: ``nnx.jit``, ``nnx.value_and_grad``,
  ``nnx.split`` and ``nnx.state`` see it once, shared). A checkpoint restored into the
  optimizer in place (``nnx.update``) keeps the link; a freshly built optimizer needs a new
  call. Graphs taken before the call (a sampler's) are the model's as it was: they sample
  as before, and ``nnx.Param`` state synced into them keeps its structure.

  Args:
    model: an ``nnx.Module``.
    optimizer: an ``nnx.Optimizer`` whose transformation holds exactly one loss scaler
      (:func:`jax_lossscale.dynamic_loss_scale`, ``static_loss_scale`` or
      ``no_loss_scale``, possibly inside ``chain``, :func:`jax_lossscale.multi_steps`...).
    output_dtype: the dtype of the logits (see :func:`cast_logits`), or ``None`` to keep
      the model's. Only when this call installs the scaling: with
      :func:`install_loss_scale`, pass it there.

  Returns:
    The shared scale variable.

  Raises:
    TypeError: ``model`` is not an ``nnx.Module``, ``optimizer`` not an
      ``nnx.Optimizer``, or ``output_dtype`` not a dtype.
    ValueError: ``optimizer``'s state holds no loss scaler or several, or holds it inside
      a stock ``optax.MultiSteps``; ``output_dtype`` is given for a model installed
      before; ``model`` has an attribute ``loss_scale`` of its own.

  Examples:
    >>> from flax import nnx
    >>> import jax.numpy as jnp, optax
    >>> import jax_lossscale as jls
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> tx = jls.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0)
    >>> optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)  # as a trainer builds it
    >>> _ = jls.flax.link_loss_scale(model, optimizer)
    >>> isinstance(model, nnx.Linear), model.in_features
    (True, 2)
    >>> loss_fn = lambda m, x: jnp.sum(m(x))       # the loss as the trainer writes it
    >>> loss, grads = nnx.value_and_grad(loss_fn)(model, jnp.ones((1, 2)))
    >>> float(loss) == float(loss_fn(model, jnp.ones((1, 2)))), grads["bias"][...]
    (True, Array([8.], dtype=float32))
  """
  output_dtype = _check_model(model, output_dtype)
  if not isinstance(optimizer, nnx.Optimizer):
    raise TypeError(f"optimizer must be an nnx.Optimizer, got {type(optimizer).__name__}.")
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
  _check_accumulation(optimizer.opt_state)
  installed = [m for _, m in nnx.iter_graph(model) if isinstance(m, LossScaledModel)]
  if installed and output_dtype is not None:
    raise ValueError(
      "output_dtype is for a model whose loss scaling link_loss_scale installs; this one "
      "was installed before (install_loss_scale): pass output_dtype there."
    )
  if not installed:
    installed = [_install(model, output_dtype)]
  for m in installed:
    m.loss_scale = variable
    m._loss_scale_linked = True
  return variable
