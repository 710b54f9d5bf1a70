"""A call's arguments split into arrays (traced) and everything else (static), and rebuilt."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

__all__ = ("is_array", "rebuild", "split")


def is_array(x: Any) -> bool:
  """Whether ``x`` is traced (a JAX or NumPy array or scalar); anything else is static."""
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


def split(args: Any, kwargs: Any) -> tuple[list[Any], Any, tuple[int, ...]]:
  """``(leaves, treedef, dyn_idx)`` of ``(args, kwargs)``: the array leaves are at ``dyn_idx``."""
  leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
  return leaves, treedef, tuple(i for i, x in enumerate(leaves) if is_array(x))


def rebuild(
  treedef: Any, template: Sequence[Any], dyn_idx: Sequence[int], dyn: Sequence[Any]
) -> tuple[Any, Any]:
  """``(args, kwargs)`` with the arrays ``dyn`` put back at ``dyn_idx`` of ``template``."""
  full = list(template)
  for i, x in zip(dyn_idx, dyn, strict=True):
    full[i] = x
  args, kwargs = jax.tree_util.tree_unflatten(treedef, full)
  return args, kwargs
