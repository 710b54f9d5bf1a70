"""The autocast interpreter: a jaxpr evaluated again, equation by equation, with casts.

Each value of the jaxpr is evaluated to a :class:`~._values.Val`: the array and the
:class:`~._values.Facts` known of it (a lower-precision result, a function input's rank, a
constant). The facts travel with the value, through layout primitives and into and out of
every sub-jaxpr, so a rule such as torch's bias-in-``linear`` holds inside ``jit``,
``checkpoint``, ``scan``, ``cond``, ``while``, ``shard_map`` and the custom rules alike.

Each equation is dispatched on its primitive's kind in the registry
(:mod:`._primitives`): a first-order primitive takes its rule, a layout primitive carries
its operand's facts, and a higher-order primitive goes to the handler declared for it
(:mod:`._higher_order`), which rebinds it as itself with its sub-jaxprs interpreted. Each
rebound equation keeps its name stack and source line, so the HLO and the profiles of the
autocast step carry the model's ``jax.named_scope`` names.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

from jax_lossscale._autocast import _primitives as prims
from jax_lossscale._autocast._errors import unsupported
from jax_lossscale._autocast._policy import is_eligible
from jax_lossscale._autocast._primitives import FLOAT32
from jax_lossscale._autocast._primitives import LOWER
from jax_lossscale._autocast._primitives import PROMOTE
from jax_lossscale._autocast._values import Facts
from jax_lossscale._autocast._values import TapSink
from jax_lossscale._autocast._values import Val
from jax_lossscale._autocast._values import at
from jax_lossscale._autocast._values import bind
from jax_lossscale._autocast._values import cast
from jax_lossscale._autocast._values import cast_to_declared
from jax_lossscale._autocast._values import is_float
from jax_lossscale._autocast._values import jaxprs_in_params
from jax_lossscale._autocast._values import torch_promote

__all__ = ("Interpreter",)

_KEEPS_RANK = frozenset(prims.KEEPS_RANK)


class Interpreter:
  """Evaluates jaxprs with the casts of one policy inserted."""

  def __init__(
    self,
    dtype: Any,
    policy: Mapping[jex.Primitive, str],
    taps: TapSink | None = None,
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
      with at(eqn):
        outs = self.eval_eqn(eqn, ins)
      for v, o in zip(eqn.outvars, outs, strict=True):
        if isinstance(v, jex.Var) and type(v).__name__ != "DropVar":
          env[v] = o
    return [read(v) for v in jaxpr.outvars]

  def eval_eqn(self, eqn: Any, ins: list[Val]) -> list[Val]:
    prim = eqn.primitive
    k = prims.kind(prim)
    if k == prims.HIGHER_ORDER:
      handler = prims.handler_of(prim.name)
      if handler is None:
        raise unsupported(prim.name, eqn)
      untapped = handler.untapped
      if untapped and self.taps is not None and not self._untapped:
        self.taps.enter(eqn)
      self._untapped += untapped
      try:
        out: list[Val] = handler.fn(self, eqn, ins)
        return out
      finally:
        self._untapped -= untapped
    if k in (prims.AS_WRITTEN, prims.KERNEL):
      return self.as_written(eqn, ins)
    if k is None and jaxprs_in_params(eqn.params):
      raise unsupported(prim.name, eqn)
    if k == prims.INDEPENDENT:
      return [Val(o) for o in bind(eqn, [v.x for v in ins])]
    if k == prims.SCATTER:
      return self.scatter(eqn, ins)
    if k == prims.LAYOUT:
      return self.layout(eqn, ins)
    return self.first_order(eqn, ins)

  def as_written(self, eqn: Any, ins: list[Val]) -> list[Val]:
    vals = cast_to_declared([v.x for v in ins], [v.aval for v in eqn.invars])
    return [Val(o) for o in bind(eqn, vals)]

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
      outs = bind(eqn, cast_to_declared([v.x for v in ins], [v.aval for v in eqn.invars]))
      if rule == LOWER:
        outs = self.tap(eqn, outs)
      return [Val(o) for o in outs]
    if rule == LOWER:
      vals = [cast(v.x, self.dtype) if is_float(v.x) else v.x for v in ins]
      pet = params.get("preferred_element_type")
      if pet is not None and is_eligible(pet):
        params["preferred_element_type"] = self.dtype
      outs = self.tap(eqn, bind(eqn, vals, params))
      return [Val(o, Facts(lowp=is_float(o) and np.dtype(o.dtype) == self.dtype)) for o in outs]
    if rule == FLOAT32:
      vals = [cast(v.x, jnp.float32) if is_float(v.x) else v.x for v in ins]
    else:
      vals = self.promote(eqn, ins)
    return [Val(o) for o in bind(eqn, vals, params)]

  def loop_taps(self) -> TapSink | None:
    """The taps a ``scan`` threads through its iterations (none inside an untapped region)."""
    return None if self._untapped else self.taps

  def tap(self, eqn: Any, outs: list[Any], label: str | None = None) -> list[Any]:
    """The outputs of a lower-precision primitive (or registered op), tapped (or counted
    as untapped)."""
    if self.taps is None:
      return outs
    if self._untapped:
      floats = [o for o in outs if is_float(o)]
      if floats:
        self.taps.skip(floats[0])
      return outs
    return [self.taps.add(eqn, o, label) if is_float(o) else o for o in outs]

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
        taps.duplicate(name)
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
      if name is not None and eqn.primitive.name in _KEEPS_RANK:
        self.taps.same_as(outs[0].x, name)
    return outs

  def _layout(self, eqn: Any, ins: list[Val]) -> list[Val]:
    name = eqn.primitive.name
    if name == "convert_element_type":
      return [self.convert(eqn, ins[0])]
    if name == "zeros_like":  # zeros take the dtype of what they meet
      return [Val(o, Facts(follows=True)) for o in bind(eqn, [v.x for v in ins])]
    vals = self.promote(eqn, ins)
    outs = bind(eqn, vals)
    floats = [v for v in ins if is_float(v.x)]
    if len(floats) <= 1:
      first = ins[0].facts
      facts = Facts(
        lowp=first.lowp,
        input_rank=first.input_rank if name in _KEEPS_RANK else None,
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
    if facts.lowp and not (is_float(out) and np.dtype(out.dtype) == self.dtype):
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
      out = bind(eqn, [val.x])[0]
      return Val(out, Facts(follows=True))
    if new is not None and new == declared_in and is_float(val.x) and np.dtype(val.x.dtype) != new:
      # An identity of the model (a weak float made strong) on a value autocast cast:
      # the value stays in its dtype.
      return val
    out = bind(eqn, [val.x])[0]
    return Val(out, self._keep_lowp(out, val.facts))

  def promote(self, eqn: Any, ins: Sequence[Val]) -> list[Any]:
    """The operands of an elementwise primitive, float ones brought to one dtype."""
    vals = [v.x for v in ins]
    idx = [i for i, v in enumerate(vals) if is_float(v)]
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
    outs = bind(eqn, vals, params)
    return [Val(o, self._keep_lowp(o, Facts(lowp=ins[0].facts.lowp))) for o in outs]
