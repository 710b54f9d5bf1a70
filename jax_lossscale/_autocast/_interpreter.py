"""The autocast interpreter: a jaxpr evaluated again, equation by equation, with casts.

Each value of the jaxpr is evaluated to a :class:`Val`: the array and the :class:`Facts`
known of it (a lower-precision result, a function input's rank, a constant). The facts
travel with the value, through layout primitives and into and out of every sub-jaxpr, so
a rule such as torch's bias-in-``linear`` holds inside ``jit``, ``checkpoint``, ``scan``,
``cond``, ``while``, ``shard_map`` and the custom rules alike.

Higher-order primitives are rebound as themselves: the sub-jaxprs are traced again
through the interpreter and swapped into the equation's parameters, and every other
parameter (shardings, donation, layouts, ``branches_platforms``, remat's policy, scan's
unroll...) is carried as it was. Each rebound equation keeps its name stack and source
line, so the HLO and the profiles of the autocast step carry the model's
``jax.named_scope`` names.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Mapping
from collections.abc import Sequence
import contextlib
import functools
import importlib
from typing import Any
from typing import NamedTuple

import jax
from jax import lax
from jax.extend import source_info_util
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

from jax_lossscale._autocast import _primitives as prims
from jax_lossscale._autocast._errors import ClosedOverTracerError
from jax_lossscale._autocast._errors import unsupported
from jax_lossscale._autocast._errors import where
from jax_lossscale._autocast._policy import FLOAT32
from jax_lossscale._autocast._policy import LOWER
from jax_lossscale._autocast._policy import PROMOTE
from jax_lossscale._autocast._policy import is_eligible

__all__ = ("NO_FACTS", "Facts", "Interpreter", "Taps", "Val", "cast", "is_eligible")

# jax.extend.core exports it from jax 0.10 on; jax 0.9 has it in jax._src.core only.
_jaxprs_in_params: Any = getattr(jex, "jaxprs_in_params", None) or jax._src.core.jaxprs_in_params


#: The name prefixes of the ``jit`` regions the interpreter does not interpret.
FLOAT32_MARK = "jls_float32"
AUTOCAST_MARK = "jls_autocast"
OP_MARK = "jls_op_"

#: Layout primitives through which a value stays (a layout of) the function input it was:
#: the candidates for torch's bias rule.
_RANK_KEEPING = frozenset(
  {
    "reshape",
    "broadcast_in_dim",
    "transpose",
    "squeeze",
    "convert_element_type",
    "copy",
    "slice",
    "rev",
    "sharding_constraint",
    "layout_constraint",
    "reshard",
    "name",
    "stop_gradient",
  }
)


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
  """

  lowp: bool = False
  input_rank: int | None = None
  follows: bool = False


NO_FACTS = Facts()


class Val(NamedTuple):
  """A value of the interpreted jaxpr: the array and its facts."""

  x: Any
  facts: Facts = NO_FACTS


class Taps:
  """Zero taps added to the outputs of the lower-precision primitives.

  :func:`jax_lossscale.diagnostics.check_underflow` differentiates with respect to them:
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


#: The higher-order primitives inside which no output is tapped.
_UNTAPPED = frozenset({"scan", "while", "cond", "shard_map", "custom_jvp_call", "custom_vjp_call"})


def _is_float(x: Any) -> bool:
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
def _at(eqn: Any) -> Iterator[None]:
  """Binds under ``eqn``'s name stack, source line and equation context."""
  name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
  with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack):
    manager = getattr(getattr(eqn, "ctx", None), "manager", None)
    if manager is None:
      yield
    else:
      with manager:
        yield


def _bind(eqn: Any, vals: Sequence[Any], params: Mapping[str, Any] | None = None) -> list[Any]:
  prim = eqn.primitive
  got = prim.get_bind_params(dict(eqn.params if params is None else params))
  if isinstance(got, tuple):  # jax < 0.10: (subfuns, params)
    subfuns, bind_params = got
    out = prim.bind(*subfuns, *vals, **bind_params)
  else:  # the subfuns travel in the params
    out = prim.bind(*vals, **got)
  return list(out) if eqn.primitive.multiple_results else [out]


def _hoist(closed: Any) -> tuple[Any, list[Any]]:
  """A ClosedJaxpr without consts (they become its leading inputs), and the consts."""
  if not closed.consts:
    return closed, []
  jaxpr = closed.jaxpr
  opened = jaxpr.replace(constvars=[], invars=[*jaxpr.constvars, *jaxpr.invars])
  return jex.ClosedJaxpr(opened, ()), list(closed.consts)


def _aval(x: Any) -> Any:
  typeof = getattr(jax, "typeof", None) or jax.core.get_aval  # type: ignore[attr-defined]
  return typeof(x)


class Interpreter:
  """Evaluates jaxprs with the casts of one policy inserted."""

  def __init__(
    self,
    dtype: Any,
    policy: Mapping[jex.Primitive, str],
    taps: Taps | None = None,
    as_written: bool = False,
  ):
    # as_written: every primitive runs on its declared dtypes (the function itself), the
    # lower-precision ones still tapped: check_underflow's float32 reference.
    self.as_written_mode = as_written
    self.dtype = np.dtype(dtype)
    self.policy = dict(policy)
    self.taps = taps
    self._untapped = 0
    # Policy entries keyed by a stand-in (a primitive JAX exports no object for).
    self.policy_by_name = {
      p.name: r for p, r in policy.items() if isinstance(p, prims.NamedPrimitive)
    }

  # -- tracing a sub-jaxpr through the interpreter ---------------------------------

  def trace(
    self, fn: Callable[[list[Val]], list[Val]], args: Sequence[Any], facts: Sequence[Facts]
  ) -> tuple[Any, list[Facts]]:
    """``fn`` over values (or avals) ``args`` with ``facts``, traced to a ClosedJaxpr."""
    captured: list[list[Facts]] = []

    def body(*xs: Any) -> list[Any]:
      outs = fn([Val(x, f) for x, f in zip(xs, facts, strict=True)])
      captured.append([o.facts for o in outs])
      return [o.x for o in outs]

    closed = jax.make_jaxpr(body)(*args)
    return closed, captured[-1]

  # -- evaluation ------------------------------------------------------------------

  def eval_closed(self, closed: Any, args: Sequence[Val]) -> list[Val]:
    return self.eval_jaxpr(closed.jaxpr, closed.consts, args)

  def eval_jaxpr(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Val]) -> list[Val]:
    env: dict[Any, Val] = {}

    def read(v: Any) -> Val:
      if isinstance(v, jex.Literal):
        val = v.val
        if not hasattr(val, "dtype"):  # a Python scalar: give it its declared dtype
          val = np.asarray(val, dtype=v.aval.dtype)  # type: ignore[attr-defined]
        return Val(val, Facts(follows=True))
      return env[v]

    for v, c in zip(jaxpr.constvars, consts, strict=True):
      env[v] = Val(c, Facts(input_rank=len(getattr(v.aval, "shape", ()))))
    for v, a in zip(jaxpr.invars, args, strict=True):
      env[v] = a
    for eqn in jaxpr.eqns:
      ins = [read(v) for v in eqn.invars]
      with _at(eqn):
        outs = self.eval_eqn(eqn, ins)
      for v, o in zip(eqn.outvars, outs, strict=True):
        if isinstance(v, jex.Var) and type(v).__name__ != "DropVar":
          env[v] = o
    return [read(v) for v in jaxpr.outvars]

  def eval_eqn(self, eqn: Any, ins: list[Val]) -> list[Val]:
    prim = eqn.primitive
    k = prims.kind(prim)
    if k == prims.HIGHER_ORDER:
      handler = HANDLERS.get(prim.name)
      if handler is None:
        raise unsupported(prim.name, eqn)
      untapped = prim.name in _UNTAPPED
      if untapped and self.taps is not None and not self._untapped:
        self.taps.enter(eqn)
      self._untapped += untapped
      try:
        return handler(self, eqn, ins)
      finally:
        self._untapped -= untapped
    if k in (prims.AS_WRITTEN, prims.KERNEL):
      return self.as_written(eqn, ins)
    if k is None and _jaxprs_in_params(eqn.params):
      raise unsupported(prim.name, eqn)
    if k == prims.INDEPENDENT:
      return [Val(o) for o in _bind(eqn, [v.x for v in ins])]
    if k == prims.SCATTER:
      return self.scatter(eqn, ins)
    if k == prims.LAYOUT:
      return self.layout(eqn, ins)
    return self.first_order(eqn, ins)

  def as_written(self, eqn: Any, ins: list[Val]) -> list[Val]:
    vals = cast_to_declared([v.x for v in ins], [v.aval for v in eqn.invars])
    return [Val(o) for o in _bind(eqn, vals)]

  def rule(self, prim: jex.Primitive) -> str:
    rule = self.policy.get(prim)
    if rule is None:
      rule = self.policy_by_name.get(prim.name, PROMOTE)
    return rule

  def first_order(self, eqn: Any, ins: list[Val]) -> list[Val]:
    same = self._user_tap_meets(eqn, ins) if self.taps is not None else None
    outs = self._first_order(eqn, ins)
    if same is not None and len(outs) == 1:
      self.taps.same_as(outs[0].x, same)  # type: ignore[union-attr]
    return outs

  def _first_order(self, eqn: Any, ins: list[Val]) -> list[Val]:
    params = dict(eqn.params)
    rule = self.rule(eqn.primitive)
    if self.as_written_mode:
      outs = _bind(eqn, cast_to_declared([v.x for v in ins], [v.aval for v in eqn.invars]))
      if rule == LOWER:
        outs = self._tap(eqn, outs)
      return [Val(o) for o in outs]
    if rule == LOWER:
      vals = [cast(v.x, self.dtype) if _is_float(v.x) else v.x for v in ins]
      pet = params.get("preferred_element_type")
      if pet is not None and is_eligible(pet):
        params["preferred_element_type"] = self.dtype
      outs = self._tap(eqn, _bind(eqn, vals, params))
      return [Val(o, Facts(lowp=_is_float(o) and np.dtype(o.dtype) == self.dtype)) for o in outs]
    if rule == FLOAT32:
      vals = [cast(v.x, jnp.float32) if _is_float(v.x) else v.x for v in ins]
    else:
      vals = self.promote(eqn, ins)
    return [Val(o) for o in _bind(eqn, vals, params)]

  def _tap(self, eqn: Any, outs: list[Any], label: str | None = None) -> list[Any]:
    """The outputs of a lower-precision primitive (or registered op), tapped (or counted
    as untapped)."""
    if self.taps is None:
      return outs
    if self._untapped:
      if any(_is_float(o) for o in outs):
        self.taps.skip()
      return outs
    return [self.taps.add(eqn, o, label) if _is_float(o) else o for o in outs]

  def _user_tap_meets(self, eqn: Any, ins: list[Val]) -> str | None:
    """A user's tap added to a tapped output: that output is tapped already.

    Returns the tap name of an ``add`` of a tapped output and a lower-rank or
    same-shape value that is not a user's tap (a bias): the sum has that output's
    gradient.
    """
    taps = self.taps
    if taps is None or eqn.primitive.name != "add" or len(ins) != 2:
      return None
    for a, b in ((ins[0].x, ins[1].x), (ins[1].x, ins[0].x)):
      name = taps.tapped(a)
      if name is None:
        continue
      if taps.is_user(b):
        taps.duplicates.add(name)
        return None
      if np.size(b) <= np.size(a):
        return name
    return None

  def layout(self, eqn: Any, ins: list[Val]) -> list[Val]:
    outs = self._layout(eqn, ins)
    if self.taps is not None and len(ins) == 1 and len(outs) == 1:
      if self.taps.is_user(ins[0].x):  # a layout of a user's tap (its cast) is that tap
        self.taps.mark_user(outs[0].x)
      name = self.taps.tapped(ins[0].x)
      if name is not None and eqn.primitive.name in _RANK_KEEPING:
        self.taps.same_as(outs[0].x, name)
    return outs

  def _layout(self, eqn: Any, ins: list[Val]) -> list[Val]:
    name = eqn.primitive.name
    if name == "convert_element_type":
      return [self.convert(eqn, ins[0])]
    if name == "zeros_like":  # zeros take the dtype of what they meet
      return [Val(o, Facts(follows=True)) for o in _bind(eqn, [v.x for v in ins])]
    vals = self.promote(eqn, ins)
    outs = _bind(eqn, vals)
    floats = [v for v in ins if _is_float(v.x)]
    if len(floats) <= 1:
      first = ins[0].facts
      facts = Facts(
        lowp=first.lowp,
        input_rank=first.input_rank if name in _RANK_KEEPING else None,
        follows=first.follows,
      )
    else:  # select_n, concatenate, pad, dynamic_update_slice: what all operands share
      driving = [v for v in floats if not v.facts.follows]
      facts = Facts(
        lowp=bool(driving) and all(v.facts.lowp for v in driving),
        follows=not driving,
      )
    return [Val(o, self._keep_lowp(o, facts)) for o in outs]

  def _keep_lowp(self, out: Any, facts: Facts) -> Facts:
    if facts.lowp and not (_is_float(out) and np.dtype(out.dtype) == self.dtype):
      return facts._replace(lowp=False)
    return facts

  def convert(self, eqn: Any, val: Val) -> Val:
    declared_in = np.dtype(eqn.invars[0].aval.dtype)
    new = np.dtype(eqn.params["new_dtype"]) if is_eligible(eqn.params["new_dtype"]) else None
    if (
      new is not None
      and not is_eligible(declared_in)
      and not jnp.issubdtype(declared_in, jnp.floating)
    ):
      # A bool or integer array made float: a mask, a count. It has no float dtype of
      # its own (torch's bool * half is half).
      out = _bind(eqn, [val.x])[0]
      return Val(out, Facts(follows=True))
    if new is not None and new == declared_in and _is_float(val.x) and np.dtype(val.x.dtype) != new:
      # An identity of the model (a weak float made strong) on a value autocast cast:
      # the value stays in its dtype.
      return val
    out = _bind(eqn, [val.x])[0]
    return Val(out, self._keep_lowp(out, val.facts))

  def promote(self, eqn: Any, ins: Sequence[Val]) -> list[Any]:
    """The operands of an elementwise primitive, float ones brought to one dtype."""
    vals = [v.x for v in ins]
    idx = [i for i, v in enumerate(vals) if _is_float(v)]
    if len(idx) < 2:
      return vals
    # Group by the declared dtype: operands that were traced with different dtypes are
    # allowed to differ by the primitive itself.
    groups: dict[Any, list[int]] = {}
    for i in idx:
      groups.setdefault(np.dtype(eqn.invars[i].aval.dtype), []).append(i)
    for members in groups.values():
      if len({np.dtype(vals[i].dtype) for i in members}) < 2:
        continue
      driving = [i for i in members if not ins[i].facts.follows] or members
      target = self._bias_target(eqn, ins, driving)
      if target is None:
        target = self._torch_promotion(eqn, ins, driving)
      for i in members:
        vals[i] = cast(vals[i], target)
    return vals

  def _bias_target(self, eqn: Any, ins: Sequence[Val], members: Sequence[int]) -> Any:
    """The op's dtype for a parameter of lower rank added onto a lower-precision result.

    torch's ``linear``, ``addmm`` and ``conv`` include their bias; a second lower-rank
    tensor added to the sum (a positional table) promotes, since the sum is no longer
    the op's output.
    """
    if eqn.primitive.name != "add" or len(members) != 2:
      return None
    a, b = members
    for lo, other in ((a, b), (b, a)):
      lo_v, other_v = ins[lo], ins[other]
      if not lo_v.facts.lowp or np.dtype(lo_v.x.dtype) != self.dtype or other_v.facts.lowp:
        continue
      rank = other_v.facts.input_rank
      if rank is None or rank >= len(lo_v.x.shape):
        continue
      return self.dtype
    return None

  @staticmethod
  def _torch_promotion(eqn: Any, ins: Sequence[Val], members: Sequence[int]) -> np.dtype:
    # torch's categories: dimensioned tensors > zero-dim tensors > Python scalars.
    def category(i: int) -> int:
      if getattr(eqn.invars[i].aval, "weak_type", False):
        return 0
      if len(ins[i].x.shape) == 0:
        return 1
      return 2

    top = max(category(i) for i in members)
    return torch_promote([np.dtype(ins[i].x.dtype) for i in members if category(i) == top])

  def scatter(self, eqn: Any, ins: list[Val]) -> list[Val]:
    """A scatter: operand and updates promoted together, the combiner traced again."""
    vals = self.promote(eqn, ins)
    params = dict(eqn.params)
    dtype = np.dtype(vals[0].dtype)
    combiner = params.get("update_jaxpr")
    if combiner is not None and dtype != np.dtype(eqn.invars[0].aval.dtype):
      fn = jex.jaxpr_as_fun(jex.ClosedJaxpr(combiner, params.get("update_consts", ())))
      scalar = jax.ShapeDtypeStruct((), dtype)
      retraced = jax.make_jaxpr(fn)(scalar, scalar)
      params["update_jaxpr"] = retraced.jaxpr
      params["update_consts"] = tuple(retraced.consts)
    outs = _bind(eqn, vals, params)
    return [Val(o, self._keep_lowp(o, Facts(lowp=ins[0].facts.lowp))) for o in outs]


# -- higher-order primitives --------------------------------------------------------
#
# Each handler reads its equation's parameters through `_param` (or `_scan_layout`), which
# knows each parameter's spellings across the JAX versions autocast supports and raises
# UnsupportedPrimitiveError naming the JAX version and the parameter for any other.


def _param(eqn: Any, name: str, *renamed: str) -> Any:
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


def _scan_layout(eqn: Any) -> tuple[int, int]:
  """The number of consts and of carries of a ``scan`` equation.

  jax 0.9-0.10 give them as ``num_consts`` and ``num_carry``; from jax 0.11 the
  operands are described by ``ft_in``, a flat tree of three parts (consts, carry, xs).
  """
  if "num_consts" in eqn.params or "ft_in" not in eqn.params:
    return _param(eqn, "num_consts"), _param(eqn, "num_carry")
  consts, carry, _ = _param(eqn, "ft_in").unpack()
  return len(consts), len(carry)


def _scan_with_leading_consts(eqn: Any, params: dict[str, Any], k: int) -> dict[str, Any]:
  """``params`` of a ``scan`` whose body takes ``k`` more leading consts."""
  if not k:
    return params
  if "num_consts" in params or "ft_in" not in params:
    new = dict(params, num_consts=_param(eqn, "num_consts") + k)
    if "linear" in params:
      new["linear"] = (False,) * k + tuple(params["linear"])
    return new
  # jax >= 0.11: ft_in has no public constructor (and jax 0.10 has no such module).
  flattree: Any = importlib.import_module("jax._src.flattree")

  consts, carry, xs = _param(eqn, "ft_in").unpack()
  consts = flattree.pack((flattree.nones(k), consts))
  return dict(params, ft_in=flattree.pack((consts, carry, xs)))


def _eval_jit(interp: Interpreter, eqn: Any, ins: list[Val]) -> list[Val]:
  params = eqn.params
  name = str(params.get("name", ""))
  if name.startswith(OP_MARK):
    from jax_lossscale._autocast import _composite  # the composite ops use the interpreter

    return _composite.evaluate(interp, eqn, ins)
  if FLOAT32_MARK in name or AUTOCAST_MARK in name:
    # A region left as written: its inputs go back to the declared dtypes.
    return interp.as_written(eqn, ins)
  jaxpr = _param(eqn, "jaxpr")
  closed, facts = interp.trace(
    lambda vs: interp.eval_closed(jaxpr, vs), [v.x for v in ins], [v.facts for v in ins]
  )
  closed, consts = _hoist(closed)
  new = dict(params, jaxpr=closed)
  if consts:
    k = len(consts)
    in_shardings = _param(eqn, "in_shardings")
    new["in_shardings"] = (*_unspecified(in_shardings, k), *in_shardings)
    if "in_layouts" in params:
      new["in_layouts"] = (None,) * k + tuple(params["in_layouts"])
    if "donated_invars" in params:
      new["donated_invars"] = (False,) * k + tuple(params["donated_invars"])
  outs = _bind(eqn, [*consts, *(v.x for v in ins)], new)
  return [Val(o, f) for o, f in zip(outs, facts, strict=True)]


def _unspecified(shardings: Sequence[Any], k: int) -> tuple[Any, ...]:
  unspec = next((s for s in shardings if type(s).__name__ == "UnspecifiedValue"), None)
  if unspec is None:
    from jax._src.sharding_impls import UNSPECIFIED  # only for a jit with every input sharded

    unspec = UNSPECIFIED
  return (unspec,) * k


def _eval_closed_call(interp: Interpreter, eqn: Any, ins: list[Val]) -> list[Val]:
  # closed_call (jax <= 0.10), and eval_jaxpr, which replaces it from jax 0.11 (jax 0.10's
  # eval_jaxpr, which spells it `jaxpr`, is staged out as a closed_call).
  return interp.eval_closed(_param(eqn, "call_jaxpr", "jaxpr"), ins)


def _eval_call(interp: Interpreter, eqn: Any, ins: list[Val]) -> list[Val]:
  return interp.eval_jaxpr(_param(eqn, "call_jaxpr"), (), ins)


def _eval_remat(interp: Interpreter, eqn: Any, ins: list[Val]) -> list[Val]:
  params = eqn.params
  jaxpr = _param(eqn, "jaxpr")
  closed, facts = interp.trace(
    lambda vs: interp.eval_jaxpr(jaxpr, (), vs),
    [v.x for v in ins],
    [v.facts for v in ins],
  )
  closed, consts = _hoist(closed)
  outs = _bind(eqn, [*consts, *(v.x for v in ins)], dict(params, jaxpr=closed.jaxpr))
  return [Val(o, f) for o, f in zip(outs, facts, strict=True)]


def _carry_facts(n: int) -> list[Facts]:
  return [NO_FACTS] * n


def _eval_scan(interp: Interpreter, eqn: Any, ins: list[Val]) -> list[Val]:
  params = eqn.params
  closed = _param(eqn, "jaxpr")
  nc, ncarry = _scan_layout(eqn)
  consts, init, xs = ins[:nc], ins[nc : nc + ncarry], ins[nc + ncarry :]
  carry_avals = closed.in_avals[nc : nc + ncarry]
  init_x = cast_to_declared([v.x for v in init], carry_avals)
  length = _param(eqn, "length")
  x_avals = [jex.mapped_aval(length, 0, _aval(v.x)) for v in xs]
  x_facts = [
    v.facts._replace(input_rank=None if v.facts.input_rank is None else v.facts.input_rank - 1)
    for v in xs
  ]

  def body(vs: list[Val]) -> list[Val]:
    outs = interp.eval_closed(closed, vs)
    carry = cast_to_declared([o.x for o in outs[:ncarry]], carry_avals)
    return [*(Val(c) for c in carry), *outs[ncarry:]]

  new_closed, facts = interp.trace(
    body,
    [*(v.x for v in consts), *init_x, *x_avals],
    [*(v.facts for v in consts), *_carry_facts(ncarry), *x_facts],
  )
  new_closed, hoisted = _hoist(new_closed)
  k = len(hoisted)
  new = dict(_scan_with_leading_consts(eqn, dict(params), k), jaxpr=new_closed)
  outs = _bind(eqn, [*hoisted, *(v.x for v in consts), *init_x, *(v.x for v in xs)], new)
  return [
    Val(o, NO_FACTS if i < ncarry else f) for i, (o, f) in enumerate(zip(outs, facts, strict=True))
  ]


def _eval_while(interp: Interpreter, eqn: Any, ins: list[Val]) -> list[Val]:
  params = eqn.params
  cond_closed, body_closed = _param(eqn, "cond_jaxpr"), _param(eqn, "body_jaxpr")
  cn, bn = _param(eqn, "cond_nconsts"), _param(eqn, "body_nconsts")
  cconsts, bconsts, init = ins[:cn], ins[cn : cn + bn], ins[cn + bn :]
  carry_avals = body_closed.in_avals[bn:]
  init_x = cast_to_declared([v.x for v in init], carry_avals)

  new_cond, _ = interp.trace(
    lambda vs: interp.eval_closed(cond_closed, vs),
    [*(v.x for v in cconsts), *init_x],
    [*(v.facts for v in cconsts), *_carry_facts(len(init))],
  )

  def body(vs: list[Val]) -> list[Val]:
    outs = interp.eval_closed(body_closed, vs)
    return [Val(c) for c in cast_to_declared([o.x for o in outs], carry_avals)]

  new_body, _ = interp.trace(
    body,
    [*(v.x for v in bconsts), *init_x],
    [*(v.facts for v in bconsts), *_carry_facts(len(init))],
  )
  new_cond, ch = _hoist(new_cond)
  new_body, bh = _hoist(new_body)
  new = dict(
    params,
    cond_jaxpr=new_cond,
    body_jaxpr=new_body,
    cond_nconsts=cn + len(ch),
    body_nconsts=bn + len(bh),
  )
  vals = [*ch, *(v.x for v in cconsts), *bh, *(v.x for v in bconsts), *init_x]
  return [Val(o) for o in _bind(eqn, vals, new)]


def _eval_cond(interp: Interpreter, eqn: Any, ins: list[Val]) -> list[Val]:
  params = eqn.params
  branches = _param(eqn, "branches")
  index, ops = ins[0], ins[1:]
  op_x, op_facts = [v.x for v in ops], [v.facts for v in ops]

  def branch_fn(b: Any) -> Callable[[list[Val]], list[Val]]:
    return lambda vs: interp.eval_closed(b, vs)

  first = [interp.trace(branch_fn(b), op_x, op_facts) for b in branches]
  n_out = len(first[0][0].out_avals)
  targets = [
    torch_promote([np.dtype(c.out_avals[i].dtype) for c, _ in first]) for i in range(n_out)
  ]

  def cast_branch(branch: Any) -> Callable[[list[Val]], list[Val]]:
    def run(vs: list[Val]) -> list[Val]:
      outs = interp.eval_closed(branch, vs)
      return [
        Val(cast(o.x, t) if _is_float(o.x) else o.x, o.facts)
        for o, t in zip(outs, targets, strict=True)
      ]

    return run

  traced = [interp.trace(cast_branch(b), op_x, op_facts) for b in branches]
  closed_branches, consts = _common_consts([c for c, _ in traced], op_x)
  facts = [
    Facts(lowp=all(f[i].lowp for _, f in traced) and np.dtype(targets[i]) == interp.dtype)
    for i in range(n_out)
  ]
  outs = _bind(eqn, [index.x, *consts, *op_x], dict(params, branches=tuple(closed_branches)))
  return [Val(o, f) for o, f in zip(outs, facts, strict=True)]


def _common_consts(closed: Sequence[Any], args: Sequence[Any]) -> tuple[list[Any], list[Any]]:
  """Branches without consts: every branch's consts become shared leading inputs."""
  hoisted = [_hoist(c) for c in closed]
  consts = [c for _, cs in hoisted for c in cs]
  if not consts:
    return [c for c, _ in hoisted], []
  out = []
  start = 0
  for jaxpr, cs in hoisted:
    lo, hi = start, start + len(cs)
    start = hi
    fn = jex.jaxpr_as_fun(jaxpr)

    def branch(*xs: Any, lo: int = lo, hi: int = hi, fn: Any = fn) -> Any:
      return fn(*xs[lo:hi], *xs[len(consts) :])

    out.append(jax.make_jaxpr(branch)(*consts, *args))
  return out, consts


def _eval_shard_map(interp: Interpreter, eqn: Any, ins: list[Val]) -> list[Val]:
  # The body is traced through the public constructor (it sets up the manual axes), and
  # the sub-jaxpr it traced is swapped into this equation's own parameters.
  params = eqn.params
  jaxpr = _param(eqn, "jaxpr")
  captured: list[list[Facts]] = []
  facts_in = [v.facts for v in ins]

  def body(*xs: Any) -> tuple[Any, ...]:
    outs = interp.eval_jaxpr(jaxpr, (), [Val(x, f) for x, f in zip(xs, facts_in, strict=True)])
    captured.append([o.facts for o in outs])
    return tuple(o.x for o in outs)

  axis_names = params.get("newly_manual_axes", params.get("manual_axes", frozenset()))
  fn = jax.shard_map(
    body,
    mesh=_param(eqn, "mesh"),
    in_specs=tuple(_param(eqn, "in_specs")),
    out_specs=tuple(_param(eqn, "out_specs")),
    axis_names=frozenset(axis_names),
    check_vma=params.get("check_vma", params.get("check_rep", True)),
  )
  outer = jax.make_jaxpr(fn)(*(v.x for v in ins))
  traced = [e for e in outer.jaxpr.eqns if e.primitive is eqn.primitive]
  if len(outer.jaxpr.eqns) != 1 or len(traced) != 1 or outer.consts:
    outs = list(fn(*(v.x for v in ins)))  # the constructor's own equation, as traced
  else:
    outs = _bind(eqn, [v.x for v in ins], dict(params, jaxpr=traced[0].params["jaxpr"]))
  return [Val(o, f) for o, f in zip(outs, captured[-1], strict=True)]


def _check_no_stale_tracers(eqn: Any, consts: Sequence[Any], kind: str, rule: str) -> None:
  if any(isinstance(c, jax.core.Tracer) for c in consts):
    raise ClosedOverTracerError(
      f"autocast cannot rebuild a {kind}{where(eqn)} whose {rule} closes over a traced "
      "intermediate value of the function (the rule is traced lazily, after that value's "
      f"trace ended). Pass the value to the {kind} function as an argument, or exclude the "
      "region by wrapping it in `jax_lossscale.float32(fn)`."
    )


def _primal(
  interp: Interpreter, closed: Any, consts: Sequence[Val], args: Sequence[Val]
) -> tuple[Callable[..., tuple[Any, ...]], list[list[Facts]]]:
  """A custom rule's primal over arrays, evaluated by ``interp``; its outputs' facts are
  appended to the list returned with it (the arguments keep their own facts)."""
  arg_facts = [v.facts for v in args]
  captured: list[list[Facts]] = []

  def primal(*xs: Any) -> tuple[Any, ...]:
    outs = interp.eval_closed(
      closed, [*consts, *(Val(x, f) for x, f in zip(xs, arg_facts, strict=True))]
    )
    captured.append([o.facts for o in outs])
    return tuple(o.x for o in outs)

  return primal, captured


def _eval_custom_jvp(interp: Interpreter, eqn: Any, ins: list[Val]) -> list[Val]:
  # Rebuilt through the public constructor: the jvp rule is a thunk JAX traces lazily.
  closed = _param(eqn, "call_jaxpr")
  num_consts = _param(eqn, "num_consts")
  jvp_jaxpr_fun = _param(eqn, "jvp_jaxpr_fun")
  consts, args = ins[:num_consts], ins[num_consts:]
  primal, captured = _primal(interp, closed, consts, args)
  fn = jax.custom_jvp(primal)

  def jvp(primals: Any, tangents: Any) -> Any:
    outs = primal(*primals)
    jvp_jaxpr, jvp_consts, out_zeros = jvp_jaxpr_fun.call_wrapped(*[False] * len(primals))
    _check_no_stale_tracers(eqn, jvp_consts, "custom_jvp", "jvp rule")
    res = interp.eval_jaxpr(jvp_jaxpr, jvp_consts, [Val(x) for x in (*primals, *tangents)])
    nz_tangents = iter(res[len(out_zeros) :])
    out_tangents: list[Any] = []
    for p, zero in zip(outs, out_zeros, strict=True):
      if zero and jnp.issubdtype(p.dtype, jnp.inexact):
        out_tangents.append(jnp.zeros(p.shape, p.dtype))
      elif zero:
        out_tangents.append(np.zeros(p.shape, jax.dtypes.float0))
      else:
        out_tangents.append(cast(next(nz_tangents).x, p.dtype))
    return outs, tuple(out_tangents)

  fn.defjvp(jvp)
  outs = fn(*(v.x for v in args))
  return [Val(o, f) for o, f in zip(outs, captured[0], strict=True)]


def _eval_custom_vjp(interp: Interpreter, eqn: Any, ins: list[Val]) -> list[Val]:
  # Rebuilt through the public constructor: fwd and bwd are traced lazily by JAX.
  closed = _param(eqn, "call_jaxpr")
  num_consts = _param(eqn, "num_consts")
  fwd_thunk = _param(eqn, "fwd_jaxpr_thunk")
  bwd = _param(eqn, "bwd")
  out_trees = _param(eqn, "out_trees")
  consts, args = ins[:num_consts], ins[num_consts:]
  declared_in = closed.in_avals[num_consts:]
  declared_out = closed.out_avals
  primal, captured = _primal(interp, closed, consts, args)
  fn = jax.custom_vjp(primal)
  arg_dtypes = [np.dtype(v.x.dtype) for v in args]
  static: dict[str, Any] = {}

  def fwd(*xs: Any) -> Any:
    outs = primal(*xs)
    fwd_jaxpr, fwd_consts = fwd_thunk.call_wrapped(*[True] * len(xs))
    _check_no_stale_tracers(eqn, fwd_consts, "custom_vjp", "fwd rule")
    res_outs = [v.x for v in interp.eval_jaxpr(fwd_jaxpr, fwd_consts, [Val(x) for x in xs])]
    _, res_tree, input_fwds = out_trees()
    n_pruned = len(res_outs) - len(declared_out)
    pruned = iter(res_outs[:n_pruned])
    pruned_avals = iter(fwd_jaxpr.outvars[:n_pruned])
    res, res_avals = [], []
    for i in input_fwds:
      if i is None:
        res.append(next(pruned))
        res_avals.append(next(pruned_avals).aval)
      else:
        res.append(xs[i])
        res_avals.append(declared_in[i])
    assert len(res) == res_tree.num_leaves
    static["res_avals"] = tuple(res_avals)
    return outs, tuple(res)

  def bwd_rule(res: Any, cts: Any) -> Any:
    res_avals = static["res_avals"]
    zero_flags: list[bool] = []

    def flat_bwd(*a: Any) -> list[Any]:
      out = bwd.call_wrapped(*a)
      if _BWD_RETURNS_LOGS:  # jax >= 0.11: (cotangents, backward-pass logs)
        out, logs = out
        if logs is not None:
          raise unsupported(
            "custom_vjp_call",
            eqn,
            f" (its backward rule returns logs, `custom_vjp.defvjp_with_logs` of jax"
            f" {jax.__version__}, which autocast does not carry)",
          )
      flat = []
      for o, av in zip(out, declared_in, strict=True):
        is_zero = not hasattr(o, "shape") or type(o).__name__ in ("Zero", "SymbolicZero")
        zero_flags.append(is_zero)
        flat.append(jnp.zeros(av.shape, av.dtype) if is_zero else o)
      return flat

    ct_avals = [a.to_tangent_aval() for a in declared_out]
    bwd_closed = jax.make_jaxpr(flat_bwd)(*_abstract(res_avals), *_abstract(ct_avals))
    cts_in = interp.eval_closed(bwd_closed, [Val(x) for x in (*res, *cts)])
    out: list[Any] = []
    for ct, zero, dt in zip(cts_in, zero_flags, arg_dtypes, strict=True):
      if zero or not jnp.issubdtype(dt, jnp.inexact):
        out.append(None)
      else:
        out.append(cast(ct.x, dt))
    return tuple(out)

  fn.defvjp(fwd, bwd_rule)
  outs = fn(*(v.x for v in args))
  return [Val(o, f) for o, f in zip(outs, captured[0], strict=True)]


#: Whether a custom_vjp's ``bwd`` parameter returns ``(cotangents, logs)`` (jax >= 0.11,
#: which has ``custom_vjp.defvjp_with_logs``) rather than the cotangents alone.
_BWD_RETURNS_LOGS = hasattr(jax.custom_vjp, "defvjp_with_logs")


def _abstract(avals: Sequence[Any]) -> list[Any]:
  out = []
  for a in avals:
    sharding = getattr(a, "sharding", None)
    try:
      out.append(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding))
    except (TypeError, ValueError):
      out.append(jax.ShapeDtypeStruct(a.shape, a.dtype))
  return out


#: The handler of each higher-order primitive, by the primitive's name (each one is
#: looked up only for a primitive whose kind is ``HIGHER_ORDER``).
HANDLERS: dict[str, Callable[[Interpreter, Any, list[Val]], list[Val]]] = {
  "jit": _eval_jit,
  "closed_call": _eval_closed_call,
  "eval_jaxpr": _eval_closed_call,
  "call": _eval_call,
  "remat2": _eval_remat,
  "checkpoint": _eval_remat,
  "scan": _eval_scan,
  "while": _eval_while,
  "cond": _eval_cond,
  "shard_map": _eval_shard_map,
  "custom_jvp_call": _eval_custom_jvp,
  "custom_vjp_call": _eval_custom_vjp,
}
