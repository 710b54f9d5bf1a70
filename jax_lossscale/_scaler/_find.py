"""The one walk that finds the nodes of a kind in a pytree (a scaler's state in an optimizer's).

Every resolver of "the one X in this state" (:func:`~jax_lossscale.get_scale_state`,
:func:`~jax_lossscale.get_inner_state`) walks the tree with :func:`find_all` and lets
:func:`find_one` decide; each caller words its own error. Pure structure inspection: fine
inside ``jit``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax


def find_all(tree: Any, is_kind: Callable[[Any], bool]) -> list[tuple[str, Any]]:
  """Every node of ``tree`` for which ``is_kind`` holds, with its ``keystr`` path, in order.

  The walk stops at such a node: one nested inside another is not reported.
  """
  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_kind)
  return [(jax.tree_util.keystr(path), x) for path, x in flat if is_kind(x)]


def find_one(
  tree: Any,
  is_kind: Callable[[Any], bool],
  error: Callable[[list[tuple[str, Any]]], Exception],
) -> Any:
  """The one node of ``tree`` for which ``is_kind`` holds (``tree`` itself, if it is one).

  Args:
    tree: any pytree.
    is_kind: the test for the node sought.
    error: builds the exception raised when there is none or more than one, from the list
      that :func:`find_all` gave (empty, or of two or more ``(path, node)`` pairs).

  Examples:
    >>> is_str = lambda x: isinstance(x, str)
    >>> find_one({"a": 1, "b": ("x", 2)}, is_str, lambda found: ValueError(len(found)))
    'x'
  """
  if is_kind(tree):
    return tree
  found = find_all(tree, is_kind)
  if len(found) == 1:
    return found[0][1]
  raise error(found)
