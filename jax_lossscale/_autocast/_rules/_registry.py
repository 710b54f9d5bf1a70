"""The registry of autocast's rules: one :class:`Rule` per JAX primitive, one lookup.

A rule is a function ``rule(interp, eqn, ins) -> outs`` over :class:`~.._values.Val`s, in a
room of its own (the modules of this subpackage), declared for the primitives it treats by
the :func:`register` decorator above it::

    @register(LAYOUT, "reshape", "transpose", keeps_rank=True)
    def layout(interp, eqn, ins): ...

The declaration is each primitive's whole entry: its kind, its rule, its flags and the JAX
releases that define it (a :class:`Name` with ``since``/``until`` for a primitive only some
releases define). Each primitive is looked up once per equation, by its ``Primitive``
object where JAX exports one (``jax.lax.*_p``, ``jax.extend.core.primitives``) and by name
otherwise (``shard_map``, ``pallas_call``, the callbacks...), so a namesake from another
module (a kernel language's ``gather``) is not taken for the lax one. A primitive no room
declares gets the :func:`unknown` rule.

``tests/autocast/test_registry.py`` fails on a declared name that is no primitive of the
installed JAX, on a primitive of JAX that no rule declares (a new primitive after an
upgrade), and on a ``since``/``until`` range the installed JAX contradicts.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple
from typing import Protocol

import jax
import jax.extend.core as jex
import jax.extend.core.primitives as _P
import numpy as np

from jax_lossscale._autocast._values import TapSink
from jax_lossscale._autocast._values import Val

__all__ = (
  "AS_WRITTEN",
  "CHECKED_RELEASES",
  "FIRST_ORDER",
  "HIGHER_ORDER",
  "INDEPENDENT",
  "KERNEL_MODULES",
  "KINDS",
  "LAYOUT",
  "OLDEST_TESTED",
  "SCATTER",
  "V0_9_0",
  "V0_9_1",
  "V0_10",
  "V0_11",
  "V0_12",
  "Interp",
  "Name",
  "NamedPrimitive",
  "Release",
  "Rule",
  "RuleFn",
  "by_name",
  "defined_in",
  "jax_release",
  "kind_of",
  "lookup",
  "register",
  "resolve",
  "rules",
  "table_names",
  "unknown",
  "versioned_names",
)

# -- the kinds -------------------------------------------------------------------------

FIRST_ORDER = "first_order"
LAYOUT = "layout"
SCATTER = "scatter"
INDEPENDENT = "independent"
AS_WRITTEN = "as_written"
HIGHER_ORDER = "higher_order"

#: Each kind, described once (the guide's table and the policy's errors read it).
KINDS = {
  FIRST_ORDER: "a first-order primitive",
  LAYOUT: "a layout primitive (it moves data; its operand's dtype carries through)",
  SCATTER: "a scatter (its operand and updates are promoted together)",
  INDEPENDENT: "a primitive whose operands are independent arrays (a collective, sort)",
  AS_WRITTEN: "an opaque primitive that runs as written, on its declared dtypes",
  HIGHER_ORDER: "a higher-order primitive whose sub-jaxprs autocast interprets",
}

#: The modules whose primitives exist only inside kernel bodies (Pallas, Mosaic, jax 0.12's
#: thunky), which autocast never enters: the ``pallas_call`` around one runs as written. No
#: rule declares them; the drift test leaves them out.
KERNEL_MODULES = (
  "jax._src.pallas.mosaic",
  "jax._src.pallas.mosaic_gpu",
  "jax._src.pallas.triton",
  "jax._src.pallas.primitives",
  "jax._src.pallas.einshape",
  "jax._src.pallas.fuser.fusible_dtype",
  "jax._src.thunky",
)

# -- JAX releases ----------------------------------------------------------------------

#: A JAX release: (major, minor, patch).
Release = tuple[int, int, int]

#: The JAX releases whose primitives the rules were checked against (every primitive each
#: one defines, from jax 0.9.0, the oldest supported, to the newest); CONTRIBUTING.md has the
#: runs.
CHECKED_RELEASES: tuple[Release, ...] = (
  (0, 9, 0),
  (0, 9, 1),
  (0, 9, 2),
  (0, 10, 2),
  (0, 11, 2),
  (0, 12, 0),
)
OLDEST_TESTED = CHECKED_RELEASES[0]

#: The releases the rooms' :class:`Name`\ s are bounded by.
V0_9_0, V0_9_1, V0_10, V0_11, V0_12 = (0, 9, 0), (0, 9, 1), (0, 10, 0), (0, 11, 0), (0, 12, 0)


def jax_release() -> Release:
  """The installed JAX's (major, minor, patch) release."""
  major, minor, patch = (int(v) for v in jax.__version_info__[:3])
  return (major, minor, patch)


# -- the interpreter, as the rules see it -----------------------------------------------


class Interp(Protocol):
  """What a rule may ask of the interpreter (``._interpreter.Interpreter``)."""

  dtype: np.dtype
  policy: dict[str, str]
  taps: TapSink | None
  as_written_mode: bool

  def trace(
    self, fn: Callable[[list[Val]], list[Val]], args: Sequence[Any], facts: Sequence[Any]
  ) -> tuple[Any, list[Any]]: ...

  def eval_closed(self, closed: Any, args: Sequence[Val]) -> list[Val]: ...

  def eval_jaxpr(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Val]) -> list[Val]: ...

  def tap(self, eqn: Any, outs: list[Any], label: str | None = None) -> list[Any]: ...

  def loop_taps(self) -> TapSink | None: ...


#: ``rule(interp, eqn, ins) -> outs``: an equation's output values for its input values.
RuleFn = Callable[[Interp, Any, list[Val]], list[Val]]

# -- the rules -------------------------------------------------------------------------


class Name(NamedTuple):
  """A primitive's name, with the JAX releases that define it where not all do.

  Attributes:
    name: the primitive's name.
    since: the first JAX release that defines it (``None``: every supported one).
    until: the first JAX release that no longer does (``None``: the newest still does).
  """

  name: str
  since: Release | None = None
  until: Release | None = None


class Rule(NamedTuple):
  """Everything autocast knows of one primitive.

  Attributes:
    name: the primitive's name (with ``since`` and ``until``).
    kind: one of :data:`KINDS`.
    fn: the rule, ``fn(interp, eqn, ins) -> outs``; its docstring's first line says what
      autocast does with the primitive (the guide's table shows it).
    untapped: ``check_underflow`` counts the lower-precision outputs inside the primitive
      instead of tapping them (a tap in a loop, a branch or a custom rule would sum the
      gradients of every iteration or branch).
    keeps_rank: a layout through which a value stays (a layout of) the function input it
      was: a candidate for torch's bias rule.
  """

  name: Name
  kind: str
  fn: RuleFn
  untapped: bool = False
  keeps_rank: bool = False


_RULES: dict[str, Rule] = {}
_BY_OBJECT: dict[jex.Primitive, Rule] = {}
_BY_NAME: dict[str, Rule] = {}
_NAMED_OBJECTS: dict[str, jex.Primitive] = {}


def _exported(name: str) -> jex.Primitive | None:
  attr = name.replace("-", "_") + ("" if name.endswith("_p") else "_p")
  for module in (jax.lax, _P):
    prim = getattr(module, attr, None)
    if isinstance(prim, jex.Primitive) and prim.name == name:
      return prim
  return None


def register(
  kind: str, *names: str | Name, untapped: bool = False, keeps_rank: bool = False
) -> Callable[[RuleFn], RuleFn]:
  """Declares the decorated function the rule of the primitives ``names``, of ``kind``.

  Raises:
    ValueError: ``kind`` is not one of :data:`KINDS`, or a name is declared twice.
  """
  if kind not in KINDS:
    raise ValueError(f"kind must be one of {tuple(KINDS)}, got {kind!r}.")

  def declare(fn: RuleFn) -> RuleFn:
    for given in names:
      name = given if isinstance(given, Name) else Name(given)
      if name.name in _RULES:
        raise ValueError(f"the primitive {name.name!r} is declared twice in the autocast registry.")
      rule = Rule(name, kind, fn, untapped, keeps_rank)
      _RULES[name.name] = rule
      prim = _exported(name.name)
      if prim is not None:
        _BY_OBJECT[prim] = rule
        _NAMED_OBJECTS[prim.name] = prim
      else:
        _BY_NAME[name.name] = rule
    return fn

  return declare


_UNKNOWN: list[Rule] = []


def unknown(fn: RuleFn) -> RuleFn:
  """Declares the decorated function the rule of every primitive no room declares."""
  _UNKNOWN[:] = [Rule(Name("<unknown>"), FIRST_ORDER, fn)]
  return fn


def lookup(prim: jex.Primitive) -> Rule:
  """The rule of ``prim``: its declared one, else the :func:`unknown` rule."""
  found = _BY_OBJECT.get(prim)
  if found is not None:
    return found
  if prim.name not in _NAMED_OBJECTS:  # else a namesake (a kernel's `gather`), not the lax one
    found = _BY_NAME.get(prim.name)
    if found is not None:
      return found
  return _UNKNOWN[0]


def rules() -> dict[str, Rule]:
  """Every declared rule, by primitive name, in the order of declaration."""
  return dict(_RULES)


def kind_of(prim: jex.Primitive) -> str | None:
  """The kind of ``prim``, or ``None`` for a primitive no rule declares."""
  rule = lookup(prim)
  return None if rule is _UNKNOWN[0] else rule.kind


# -- names and releases ----------------------------------------------------------------


def defined_in(name: str, release: tuple[int, ...]) -> bool:
  """Whether JAX ``release`` (major, minor, patch) defines the declared primitive ``name``."""
  found = _RULES.get(name)
  first, until = (None, None) if found is None else (found.name.since, found.name.until)
  return (first is None or first <= tuple(release)) and (until is None or tuple(release) < until)


def versioned_names() -> dict[str, tuple[Release, Release | None]]:
  """The names only some JAX releases define: (the first release, the first without it)."""
  return {
    name: (rule.name.since or OLDEST_TESTED, rule.name.until)
    for name, rule in _RULES.items()
    if rule.name.since is not None or rule.name.until is not None
  }


def table_names(release: tuple[int, ...] | None = None) -> dict[str, str]:
  """Every declared name that JAX ``release`` (the installed one by default) defines,
  with its kind (for the drift test)."""
  release = jax_release() if release is None else release
  return {name: rule.kind for name, rule in _RULES.items() if defined_in(name, release)}


def resolve(name: str) -> jex.Primitive:
  """The exported ``Primitive`` object of the installed JAX named ``name``."""
  prim = _exported(name)
  if prim is None:
    raise LookupError(f"JAX exports no primitive named {name!r}.")
  return prim


class NamedPrimitive(jex.Primitive):
  """A stand-in key for a policy entry naming a primitive JAX exports no object for."""


_STAND_INS: dict[str, jex.Primitive] = {}


def by_name(name: str) -> jex.Primitive | None:
  """The primitive a policy key names: the exported object, else a stand-in by name."""
  prim = _NAMED_OBJECTS.get(name) or _exported(name)
  if prim is not None:
    return prim
  if name in _BY_NAME:
    if name not in _STAND_INS:
      _STAND_INS[name] = NamedPrimitive(name)
    return _STAND_INS[name]
  return None
