"""The autocast interpreter: a jaxpr evaluated again, equation by equation, with casts.

Each value of the jaxpr is evaluated to a :class:`~._values.Val`: the array and the
:class:`~._values.Facts` known of it (a lower-precision result, a function input's rank, a
constant). The facts travel with the value, through layout primitives and into and out of
every sub-jaxpr, so a rule such as torch's bias-in-``linear`` holds inside ``jit``,
``checkpoint``, ``scan``, ``cond``, ``while``, ``shard_map`` and the custom rules alike.

Each equation goes to its primitive's rule, looked up in the registry
(:mod:`._rules`): one function per behaviour, in the room of its kind (first-order, layout,
scatter, independent, as-written, calls, loops, branches, custom rules). The interpreter
knows no primitive: it evaluates, traces sub-jaxprs for the rules, and taps. Each rebound
equation keeps its name stack and source line, so the HLO and the profiles of the autocast
step carry the model's ``jax.named_scope`` names.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import jax
import jax.extend.core as jex
import numpy as np

from jax_lossscale._autocast._rules import lookup
from jax_lossscale._autocast._values import Facts
from jax_lossscale._autocast._values import TapSink
from jax_lossscale._autocast._values import Val
from jax_lossscale._autocast._values import at
from jax_lossscale._autocast._values import is_float

__all__ = ("Interpreter",)


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
    # Each rule, by primitive name (check_policy keyed it by the declared primitives).
    self.policy = {p.name: r for p, r in policy.items()}
    self.taps = taps
    self._untapped = 0

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
    """The outputs of ``eqn``: its primitive's rule in the registry, applied."""
    rule = lookup(eqn.primitive)
    if not rule.untapped:
      return rule.fn(self, eqn, ins)
    if self.taps is not None and not self._untapped:
      self.taps.enter(eqn)
    self._untapped += 1
    try:
      return rule.fn(self, eqn, ins)
    finally:
      self._untapped -= 1

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
