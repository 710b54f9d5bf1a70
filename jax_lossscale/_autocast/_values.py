"""What the autocast interpreter computes with: values with their facts, casts, binds.

Each value of an interpreted jaxpr is a :class:`Val`: the array and the :class:`Facts`
known of it. This module also holds the small operations every rule shares: casting
(:func:`cast`, :func:`cast_to_declared`, :func:`torch_promote`), rebinding an equation
under its own name stack and source line (:func:`at`, :func:`bind`), hoisting a
sub-jaxpr's consts (:func:`hoist`), reading an equation's parameters across JAX versions
(:func:`param`), and the interface of the gradient taps (:class:`TapSink`) that
:func:`jax_lossscale.diagnostics.check_underflow` passes in.
"""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Mapping
from collections.abc import Sequence
import contextlib
import functools
from typing import Any
from typing import NamedTuple
from typing import Protocol

import jax
from jax import lax
from jax.extend import source_info_util
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

from jax_lossscale._autocast._errors import unsupported

__all__ = (
  "ELIGIBLE",
  "NO_FACTS",
  "Facts",
  "TapSink",
  "Val",
  "at",
  "aval_of",
  "bind",
  "cast",
  "cast_to_declared",
  "hoist",
  "is_eligible",
  "is_float",
  "jaxprs_in_params",
  "param",
  "torch_promote",
  "users_cross",
)

#: Float dtypes autocast casts (torch: ``is_eligible`` excludes float64).
ELIGIBLE = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32))


def is_eligible(dtype: Any) -> bool:
  """Whether autocast casts arrays of ``dtype`` (float16, bfloat16, float32)."""
  try:
    return np.dtype(dtype) in ELIGIBLE
  except TypeError:  # an extended dtype (PRNG keys)
    return False


# jax.extend.core exports it from jax 0.10 on; jax 0.9 has it in jax._src.core only.
jaxprs_in_params: Any = getattr(jex, "jaxprs_in_params", None) or jax._src.core.jaxprs_in_params


class Facts(NamedTuple):
  """What the interpreter knows of a value, beyond its array.

  Attributes:
    lowp: the output of a lower-precision primitive, in the autocast dtype (or a layout
      of one): a bias added to it is part of that op, as in torch's ``linear``.
    input_rank: the value is (a layout of) an input of the function, a parameter, of this
      rank; ``None`` for a computed value.
    follows: a constant (a literal, ``zeros_like``, ``full``) or a conversion of a bool or
      integer array: it has no float dtype of its own and takes the dtype of the float
      operands it meets, as torch's ``zeros_like(h)``, masks and Python scalars do.
    saved_from: a residual that the forward part of a ``"float32_compute"`` composite op
      saved under ``grad`` (or ``linearize``): the shape and dtype of that op's primary
      input, which the gradients its backward part gives take (torch's gradient of an
      input has the input's dtype), or that shape and ``None`` where another input of
      the op has the primary's shape and another dtype (the backward part cannot tell
      their gradients apart by shape); ``None`` for any other value.
  """

  lowp: bool = False
  input_rank: int | None = None
  follows: bool = False
  saved_from: tuple[tuple[int, ...], np.dtype | None] | None = None


NO_FACTS = Facts()


class Val(NamedTuple):
  """A value of the interpreted jaxpr: the array and its facts."""

  x: Any
  facts: Facts = NO_FACTS


class TapSink(Protocol):
  """Where the interpreter reports the outputs of the lower-precision primitives.

  :func:`jax_lossscale.diagnostics.check_underflow` passes one in (its gradient taps);
  autocast itself passes none. The interpreter calls :meth:`add` on each such output
  outside ``while`` loops, conds and custom rules (the array it returns replaces the
  output), :meth:`enter` on entering the outermost of those regions and :meth:`skip` on
  each output inside it, and reports which values are a user's tap or carry a tapped
  output's gradient (a layout of it, a bias added). A ``scan`` threads the taps inside
  it through its iterations: :meth:`loop` on entering it gives them stacked, its body
  gives one iteration's rows to :meth:`iteration`, and :meth:`end_loop` closes it.
  """

  def add(self, eqn: Any, out: Any, label: str | None = None) -> Any: ...

  def enter(self, eqn: Any) -> None: ...

  def skip(self, out: Any) -> None: ...

  def loop(self, length: int) -> list[tuple[str, Any]]: ...

  def iteration(self, rows: Mapping[str, Any]) -> None: ...

  def end_loop(self) -> None: ...

  def mark_user(self, x: Any) -> None: ...

  def is_user(self, x: Any) -> bool: ...

  def tapped(self, x: Any) -> str | None: ...

  def same_as(self, x: Any, name: str) -> None: ...

  def duplicate(self, name: str) -> None: ...


def is_float(x: Any) -> bool:
  """Whether ``x`` is an array autocast casts (float16, bfloat16, float32)."""
  return hasattr(x, "dtype") and is_eligible(x.dtype)


def cast(x: Any, dtype: Any) -> Any:
  """``x`` in ``dtype`` (no equation when it already is)."""
  if np.dtype(x.dtype) == np.dtype(dtype):
    return x
  return lax.convert_element_type(x, dtype)


def cast_to_declared(vals: Sequence[Any], avals: Sequence[Any]) -> list[Any]:
  """Each float value back in the dtype its aval declares."""
  out = []
  for v, a in zip(vals, avals, strict=True):
    dt = getattr(a, "dtype", None)
    if dt is not None and hasattr(v, "dtype") and jnp.issubdtype(v.dtype, jnp.floating):
      v = cast(v, dt)
    out.append(v)
  return out


def torch_promote(dtypes: Sequence[Any]) -> np.dtype:
  """torch's type promotion of tensors of these dtypes, whatever JAX's promotion mode.

  For the floats autocast casts between it is JAX's standard lattice: float16 with
  bfloat16 is float32 in both, and the wider dtype wins otherwise.
  """
  with jax.numpy_dtype_promotion("standard"):
    return np.dtype(functools.reduce(jnp.promote_types, dtypes))


@contextlib.contextmanager
def at(eqn: Any) -> Iterator[None]:
  """Binds under ``eqn``'s name stack, source line and equation context."""
  name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
  with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack):
    manager = getattr(getattr(eqn, "ctx", None), "manager", None)
    if manager is None:
      yield
    else:
      with manager:
        yield


def bind(eqn: Any, vals: Sequence[Any], params: Mapping[str, Any] | None = None) -> list[Any]:
  """``eqn``'s primitive bound again on ``vals``, with ``params`` (default: its own)."""
  prim = eqn.primitive
  got = prim.get_bind_params(dict(eqn.params if params is None else params))
  if isinstance(got, tuple):  # jax < 0.10: (subfuns, params)
    subfuns, bind_params = got
    out = prim.bind(*subfuns, *vals, **bind_params)
  else:  # the subfuns travel in the params
    out = prim.bind(*vals, **got)
  return list(out) if eqn.primitive.multiple_results else [out]


def hoist(closed: Any) -> tuple[Any, list[Any]]:
  """A ClosedJaxpr without consts (they become its leading inputs), and the consts."""
  if not closed.consts:
    return closed, []
  jaxpr = closed.jaxpr
  opened = jaxpr.replace(constvars=[], invars=[*jaxpr.constvars, *jaxpr.invars])
  return jex.ClosedJaxpr(opened, ()), list(closed.consts)


def aval_of(x: Any) -> Any:
  """The abstract value of ``x`` (``jax.typeof``, ``get_aval`` before it existed)."""
  typeof = getattr(jax, "typeof", None) or jax.core.get_aval  # type: ignore[attr-defined]
  return typeof(x)


def param(eqn: Any, name: str, *renamed: str) -> Any:
  """``eqn.params[name]``, or under one of its ``renamed`` spellings (other JAX versions).

  Raises:
    UnsupportedPrimitiveError: the equation has none of them (a JAX version whose
      parameters autocast does not know); the message names the version and the parameter.
  """
  for key in (name, *renamed):
    try:
      return eqn.params[key]
    except KeyError:
      continue
  spelled = " or ".join(repr(k) for k in (name, *renamed))
  raise unsupported(
    eqn.primitive.name,
    eqn,
    f" (its parameter {spelled} is missing in jax {jax.__version__}, whose parameters for it"
    f" are {sorted(eqn.params)})",
  )


def users_cross(taps: TapSink | None, outer: Sequence[Val], inner: Sequence[Val]) -> None:
  """A user's tap passed into a body (a scan's rows of it) is a user's tap there too."""
  if taps is None:
    return
  for o, i in zip(outer, inner, strict=True):
    if taps.is_user(o.x):
      taps.mark_user(i.x)
