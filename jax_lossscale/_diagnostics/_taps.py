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
import numpy as np

__all__ = ("Taps", "per_iteration")


class Taps:
  """Zero taps added to the outputs of the lower-precision primitives.

  :func:`jax_lossscale.diagnostics.check_underflow` passes them to the autocast
  interpreter (they implement its ``TapSink``) and differentiates with respect to them:
  the gradient of a tap is the gradient of that op's output (logits, attention scores).
  Without ``values`` the taps are only counted (their names and shapes recorded); with
  them, each output gets the value of its name (one left out of ``values`` is not
  tapped).

  An output inside a ``scan`` gets one tap per iteration: the tap is stacked, one row per
  iteration (as the scan's inputs are), and threaded through the loop as a scanned input
  (:meth:`loop`), so the gradient of row ``i`` is the gradient of that output in
  iteration ``i``. Its name holds ``scan#<k>`` (the function's ``k``-th scan) and
  :attr:`loops` gives the scans it is in; :func:`per_iteration` splits it into one name
  per iteration, ``scan#<k>[<i>]``. Outputs inside ``while`` loops, conds, shard_map and
  custom rules are not tapped (a tap in a ``while`` would sum the gradients of every
  iteration; a cond's taken branch can differ in half precision): :attr:`untapped`
  counts them by the region they are in, less those a user's tap is added to. An output
  the function adds a user's tap to (one of ``user``, an input) is recorded in
  :attr:`duplicates`: it is tapped already.
  """

  def __init__(
    self,
    values: Mapping[str, Any] | None = None,
    loops: Mapping[str, tuple[tuple[int, int], ...]] | None = None,
  ):
    self.values = None if values is None else dict(values)
    self.names: list[str] = []
    self.shapes: list[Any] = []
    #: ``name -> ((scan number, iterations), ...)``: the scans a tap is in, outermost first.
    self.loops: dict[str, tuple[tuple[int, int], ...]] = dict(loops or {})
    #: ``primitive -> [regions, lower-precision outputs]``.
    self.untapped: dict[str, list[int]] = {}
    self.duplicates: set[str] = set()
    self._region = ""
    self._user: dict[int, Any] = {}  # id -> the array: the users' taps and their layouts
    self._tapped: dict[int, tuple[Any, str]] = {}  # id -> (the tapped output, its name)
    self._skipped: dict[str, str] = {}  # the name of an untapped output -> its region
    # the scans entered: (k, iterations, their scope, the values outside them)
    self._frames: list[tuple[int, int, str, Any]] = []
    self._scans = 0

  def add(self, eqn: Any, out: Any, label: str | None = None) -> Any:
    i = len(self.names)
    stack = _in_loops(_scopes(source_info_util.current_name_stack()), self._frames)
    label = label or eqn.primitive.name
    name = f"{stack}/{label}#{i}" if stack else f"{label}#{i}"
    self.names.append(name)
    lengths = tuple(f[1] for f in self._frames)
    self.shapes.append(jax.ShapeDtypeStruct((*lengths, *out.shape), jnp.float32))
    if self._frames:
      self.loops[name] = tuple((f[0], f[1]) for f in self._frames)
    if self.values is not None and name in self.values:
      out = out + self.values[name].astype(out.dtype)
    self._tapped[id(out)] = (out, name)
    return out

  def enter(self, eqn: Any) -> None:
    """An outermost untapped region starts (a ``while``, a cond, a custom rule)."""
    self._region = eqn.primitive.name
    self.untapped.setdefault(self._region, [0, 0])[0] += 1

  def skip(self, out: Any) -> None:
    """A lower-precision output inside the current untapped region (a user's tap added
    to it later takes it off the count, as :meth:`duplicate`)."""
    self.untapped[self._region][1] += 1
    name = f"untapped#{id(out)}"  # out is held in _tapped: its id is not reused
    self._skipped[name] = self._region
    self._tapped[id(out)] = (out, name)

  def loop(self, length: int) -> list[tuple[str, Any]]:
    """A ``scan`` of ``length`` iterations is entered (until :meth:`end_loop`): the taps
    inside it, ``(name, stacked value)``, to thread through it as scanned inputs (none
    when counting). Its body gives their rows of one iteration to :meth:`iteration`."""
    k = self._scans
    self._scans += 1
    scope = _scopes(source_info_util.current_name_stack())
    self._frames.append((k, int(length), scope, self.values))
    if self.values is None:
      return []
    return [(n, v) for n, v in self.values.items() if (k, length) in self.loops.get(n, ())]

  def iteration(self, rows: Mapping[str, Any]) -> None:
    """Inside a scan's body: the values of the taps inside it, one iteration's rows."""
    self.values = dict(rows)

  def end_loop(self) -> None:
    *_, self.values = self._frames.pop()

  def mark_user(self, x: Any) -> None:
    self._user[id(x)] = x

  def is_user(self, x: Any) -> bool:
    return self._user.get(id(x)) is x

  def tapped(self, x: Any) -> str | None:
    found = self._tapped.get(id(x))
    return found[1] if found is not None and found[0] is x else None

  def duplicate(self, name: str) -> None:
    """The output tapped as ``name`` also has a user's tap added to it."""
    region = self._skipped.pop(name, None)
    if region is not None:  # an untapped output: the user's tap checks it
      self.untapped[region][1] -= 1
      return
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


def _in_loops(stack: str, frames: list[tuple[int, int, str, Any]]) -> str:
  """``stack`` with ``scan#<k>`` after the scope of each scan it is inside."""
  if not frames:
    return stack
  parts, done = [], ""
  for k, _, outer, _ in frames:
    if outer.startswith(done) and stack.startswith(outer):
      parts.append(outer[len(done) :].strip("/"))
      done = outer
    parts.append(f"scan#{k}")
  parts.append(stack[len(done) :].strip("/"))
  return "/".join(p for p in parts if p)


def per_iteration(
  name: str, loops: tuple[tuple[int, int], ...]
) -> list[tuple[str, tuple[int, ...]]]:
  """A stacked tap's name per iteration, ``scan#<k>`` made ``scan#<k>[<i>]``, with the
  index of that iteration's row."""
  out = []
  for index in np.ndindex(*(n for _, n in loops)):
    parts = name.split("/")
    for (k, _), i in zip(loops, index, strict=True):
      at = parts.index(f"scan#{k}")
      parts[at] = f"scan#{k}[{i}]"
    out.append(("/".join(parts), tuple(int(i) for i in index)))
  return out
