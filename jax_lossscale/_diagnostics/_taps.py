"""The gradient taps of :func:`jax_lossscale.diagnostics.check_underflow`.

The autocast interpreter reports each output of a lower-precision primitive to the
:class:`Taps` it is given: a zero is added to it, and the gradient of that zero is the
gradient of the output (logits, attention scores), the float16 value the check measures.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
from jax.extend import source_info_util
import jax.numpy as jnp

__all__ = ("Taps",)


class Taps:
  """Zero taps added to the outputs of the lower-precision primitives.

  :func:`jax_lossscale.diagnostics.check_underflow` passes them to the autocast
  interpreter (they implement its ``TapSink``) and differentiates with respect to them:
  the gradient of a tap is the gradient of that op's output (logits, attention scores).
  Without ``values`` the taps are only counted (their names and shapes recorded); with
  them, each output gets the value of its name (one left out of ``values`` is not
  tapped). Outputs inside loops, conds, shard_map and custom rules are not tapped (a tap
  there would sum the gradients of every iteration or branch): :attr:`untapped` counts
  them by the region they are in. An output the function adds a user's tap to (one of
  ``user``, an input) is recorded in :attr:`duplicates`: it is tapped already.
  """

  def __init__(self, values: Mapping[str, Any] | None = None):
    self.values = None if values is None else dict(values)
    self.names: list[str] = []
    self.shapes: list[Any] = []
    #: ``(primitive, iterations or None) -> [regions, lower-precision outputs]``.
    self.untapped: dict[tuple[str, int | None], list[int]] = {}
    self.duplicates: set[str] = set()
    self._region: tuple[str, int | None] = ("", None)
    self._user: dict[int, Any] = {}  # id -> the array: the users' taps and their layouts
    self._tapped: dict[int, tuple[Any, str]] = {}  # id -> (the tapped output, its name)

  def add(self, eqn: Any, out: Any, label: str | None = None) -> Any:
    i = len(self.names)
    stack = _scopes(source_info_util.current_name_stack())
    label = label or eqn.primitive.name
    name = f"{stack}/{label}#{i}" if stack else f"{label}#{i}"
    self.names.append(name)
    self.shapes.append(jax.ShapeDtypeStruct(out.shape, jnp.float32))
    if self.values is not None and name in self.values:
      out = out + self.values[name].astype(out.dtype)
    self._tapped[id(out)] = (out, name)
    return out

  def enter(self, eqn: Any) -> None:
    """An outermost untapped region starts (a loop, a cond, a custom rule)."""
    length = eqn.params.get("length") if eqn.primitive.name == "scan" else None
    key = (eqn.primitive.name, None if length is None else int(length))
    self.untapped.setdefault(key, [0, 0])[0] += 1
    self._region = key

  def skip(self) -> None:
    """A lower-precision output inside the current untapped region."""
    self.untapped[self._region][1] += 1

  def mark_user(self, x: Any) -> None:
    self._user[id(x)] = x

  def is_user(self, x: Any) -> bool:
    return self._user.get(id(x)) is x

  def tapped(self, x: Any) -> str | None:
    found = self._tapped.get(id(x))
    return found[1] if found is not None and found[0] is x else None

  def duplicate(self, name: str) -> None:
    """The output tapped as ``name`` also has a user's tap added to it."""
    self.duplicates.add(name)

  def same_as(self, x: Any, name: str) -> None:
    """``x`` has the gradient of the output tapped as ``name`` (a layout of it, a bias
    added): a user's tap added to it duplicates that tap."""
    self._tapped[id(x)] = (x, name)


def _scopes(name_stack: Any) -> str:
  """The scopes of a name stack, without the transformations (``jvp()`` under grad)."""
  stack = getattr(name_stack, "stack", None)
  if stack is None:
    return str(name_stack)
  return "/".join(e.name for e in stack if type(e).__name__ != "Transform")
