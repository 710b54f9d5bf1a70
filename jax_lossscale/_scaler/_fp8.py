"""Flax's fp8 meta-state: the ``OVERWRITE_WITH_GRADIENT`` collection is never a gradient.

Flax's fp8 dot-general ops (``nn.Fp8DirectDotGeneralOp``, ``nn.Fp8Einsum``)
keep their scales and amax histories in the ``_overwrite_with_gradient``
collection and return the *new* values as the cotangents of those variables;
``TrainState.apply_gradients`` then overwrites the old values with them. Those
leaves are not multiplied by the loss scale in the backward pass, so they must
not be divided by it, and an inf in an amax history is not a gradient
overflow. The output-gradient amax history does record the *scaled*
gradients, which is what the next step's backward pass quantizes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from typing import Callable

import jax

#: The name of Flax's collection (``flax.linen.fp8_ops.OVERWRITE_WITH_GRADIENT``),
#: spelled here so that the Optax wrappers need not import Flax.
FP8_META = "_overwrite_with_gradient"


def _is_meta_path(path: Any) -> bool:
  return any(isinstance(k, jax.tree_util.DictKey) and k.key == FP8_META for k in path)


def has_fp8_meta(tree: Any) -> bool:
  """Whether any leaf of ``tree`` sits under a ``_overwrite_with_gradient`` dict key."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return any(_is_meta_path(path) for path, _ in flat)


def map_gradients(
  fn: Callable[[list[Any]], tuple[list[Any], Any]],
  tree: Any,
  meta_fn: Callable[[list[Any]], list[Any]],
) -> tuple[Any, Any]:
  """Applies ``fn`` to the gradient leaves of ``tree`` only, ``meta_fn`` to its fp8 meta.

  Args:
    fn: takes the list of gradient leaves (in tree order) and returns
      ``(new_leaves, extra)``, the same number of leaves.
    tree: a gradient pytree, possibly holding fp8 meta under
      ``_overwrite_with_gradient`` keys.
    meta_fn: takes the list of fp8 meta leaves and returns as many.

  Returns:
    ``(new_tree, extra)``: ``tree`` with its gradient leaves replaced by
    ``fn``'s and its fp8 meta leaves by ``meta_fn``'s.
  """
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  meta = [_is_meta_path(path) for path, _ in flat]
  leaves = [x for _, x in flat]
  new_grads, extra = fn([x for x, m in zip(leaves, meta) if not m])
  meta_leaves = [x for x, m in zip(leaves, meta) if m]
  new_meta, new = iter(meta_fn(meta_leaves)), iter(new_grads)
  out = [next(new_meta) if m else next(new) for m in meta]
  return jax.tree_util.tree_unflatten(treedef, out), extra


def gradient_leaves(tree: Any) -> list[Any]:
  """The leaves of ``tree`` that are not fp8 meta, in tree order."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [x for path, x in flat if not _is_meta_path(path)]


def split_variables(tree: Any) -> tuple[Any, Any]:
  """Flax's ``TrainState`` layout: ``{"params": p, FP8_META: m}`` gives ``(p, m)``.

  The one place that reads that layout (``jax_lossscale.flax.TrainState``'s ``create``
  and ``apply_gradients``): the optimizer sees ``p`` only, and ``m`` is overwritten by
  the gradient's value. Any other tree gives ``(tree, None)``. (The Optax wrappers and
  ``value_and_grad`` find fp8 meta at any depth, with :func:`has_fp8_meta`.)
  """
  if isinstance(tree, Mapping) and FP8_META in tree:
    return tree["params"], tree[FP8_META]
  return tree, None


def join_variables(params: Any, meta: Any) -> Any:
  """The inverse of :func:`split_variables`."""
  return params if meta is None else {"params": params, FP8_META: meta}
