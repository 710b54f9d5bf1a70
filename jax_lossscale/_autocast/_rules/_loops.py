"""The loops: ``scan`` and ``while``.

Each is rebound as itself with its body interpreted, its carries cast back to their declared
dtypes after every iteration (a carry keeps one dtype). A ``scan`` threads
``check_underflow``'s taps through its iterations, one row per iteration; a ``while`` (whose
iterations are not counted) counts the lower-precision outputs inside it instead.
"""

from __future__ import annotations

import importlib
from typing import Any

import jax.extend.core as jex

from jax_lossscale._autocast._rules._registry import HIGHER_ORDER
from jax_lossscale._autocast._rules._registry import Interp
from jax_lossscale._autocast._rules._registry import register
from jax_lossscale._autocast._values import NO_FACTS
from jax_lossscale._autocast._values import Facts
from jax_lossscale._autocast._values import Val
from jax_lossscale._autocast._values import aval_of
from jax_lossscale._autocast._values import bind
from jax_lossscale._autocast._values import cast_to_declared
from jax_lossscale._autocast._values import hoist
from jax_lossscale._autocast._values import param
from jax_lossscale._autocast._values import users_cross

__all__ = ("scan", "while_loop")


def _scan_layout(eqn: Any) -> tuple[int, int]:
  """The number of consts and of carries of a ``scan`` equation.

  jax 0.9-0.10 give them as ``num_consts`` and ``num_carry``; from jax 0.11 the
  operands are described by ``ft_in``, a flat tree of three parts (consts, carry, xs).
  """
  if "num_consts" in eqn.params or "ft_in" not in eqn.params:
    return param(eqn, "num_consts"), param(eqn, "num_carry")
  consts, carry, _ = param(eqn, "ft_in").unpack()
  return len(consts), len(carry)


def _scan_with_leading_consts(eqn: Any, params: dict[str, Any], k: int) -> dict[str, Any]:
  """``params`` of a ``scan`` whose body takes ``k`` more leading consts."""
  if not k:
    return params
  if "num_consts" in params or "ft_in" not in params:
    new = dict(params, num_consts=param(eqn, "num_consts") + k)
    if "linear" in params:
      new["linear"] = (False,) * k + tuple(params["linear"])
    return new
  # jax >= 0.11: ft_in has no public constructor (and jax 0.10 has no such module).
  flattree: Any = importlib.import_module("jax._src.flattree")

  consts, carry, xs = param(eqn, "ft_in").unpack()
  consts = flattree.pack((flattree.nones(k), consts))
  return dict(params, ft_in=flattree.pack((consts, carry, xs)))


def _scan_with_trailing_xs(eqn: Any, params: dict[str, Any], m: int) -> dict[str, Any]:
  """``params`` of a ``scan`` whose body takes ``m`` more scanned inputs, last."""
  if not m:
    return params
  if "num_consts" in params or "ft_in" not in params:
    if "linear" in params:
      return dict(params, linear=(*params["linear"], *(False,) * m))
    return params
  flattree: Any = importlib.import_module("jax._src.flattree")

  consts, carry, xs = params["ft_in"].unpack()
  return dict(params, ft_in=flattree.pack((consts, carry, flattree.pack((xs, flattree.nones(m))))))


def _carry_facts(n: int) -> list[Facts]:
  return [NO_FACTS] * n


@register(HIGHER_ORDER, "scan")
def scan(interp: Interp, eqn: Any, ins: list[Val]) -> list[Val]:
  """Rebound as itself, params kept; the carry is cast back to its declared dtype at each
  step boundary, per-step outputs keep the body's dtype, and each iteration's
  lower-precision outputs are tapped by `check_underflow`."""
  params = eqn.params
  closed = param(eqn, "jaxpr")
  nc, ncarry = _scan_layout(eqn)
  consts, init, xs = ins[:nc], ins[nc : nc + ncarry], ins[nc + ncarry :]
  carry_avals = closed.in_avals[nc : nc + ncarry]
  init_x = cast_to_declared([v.x for v in init], carry_avals)
  length = param(eqn, "length")
  x_avals = [jex.mapped_aval(length, 0, aval_of(v.x)) for v in xs]
  x_facts = [
    v.facts._replace(input_rank=None if v.facts.input_rank is None else v.facts.input_rank - 1)
    for v in xs
  ]
  # check_underflow's taps of the outputs inside: stacked, one row per iteration, scanned.
  taps = interp.loop_taps()
  threaded = [] if taps is None else taps.loop(length)
  tap_avals = [jex.mapped_aval(length, 0, aval_of(v)) for _, v in threaded]
  n_in = len(ins)

  def body(vs: list[Val]) -> list[Val]:
    if taps is not None:
      taps.iteration({name: v.x for (name, _), v in zip(threaded, vs[n_in:], strict=True)})
    users_cross(interp.taps, ins, vs[:n_in])
    outs = interp.eval_closed(closed, vs[:n_in])
    carry = cast_to_declared([o.x for o in outs[:ncarry]], carry_avals)
    return [*(Val(c) for c in carry), *outs[ncarry:]]

  try:
    new_closed, facts = interp.trace(
      body,
      [*(v.x for v in consts), *init_x, *x_avals, *tap_avals],
      [*(v.facts for v in consts), *_carry_facts(ncarry), *x_facts, *_carry_facts(len(threaded))],
    )
  finally:
    if taps is not None:
      taps.end_loop()
  new_closed, hoisted = hoist(new_closed)
  new = _scan_with_trailing_xs(
    eqn, _scan_with_leading_consts(eqn, dict(params), len(hoisted)), len(threaded)
  )
  vals = [*hoisted, *(v.x for v in consts), *init_x, *(v.x for v in xs), *(v for _, v in threaded)]
  outs = bind(eqn, vals, dict(new, jaxpr=new_closed))
  return [
    Val(o, NO_FACTS if i < ncarry else f) for i, (o, f) in enumerate(zip(outs, facts, strict=True))
  ]


@register(HIGHER_ORDER, "while", untapped=True)
def while_loop(interp: Interp, eqn: Any, ins: list[Val]) -> list[Val]:
  """Rebound as itself, params kept; the condition runs under the policy, and the carry is
  cast back to its declared dtypes."""
  params = eqn.params
  cond_closed, body_closed = param(eqn, "cond_jaxpr"), param(eqn, "body_jaxpr")
  cn, bn = param(eqn, "cond_nconsts"), param(eqn, "body_nconsts")
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
  new_cond, ch = hoist(new_cond)
  new_body, bh = hoist(new_body)
  new = dict(
    params,
    cond_jaxpr=new_cond,
    body_jaxpr=new_body,
    cond_nconsts=cn + len(ch),
    body_nconsts=bn + len(bh),
  )
  vals = [*ch, *(v.x for v in cconsts), *bh, *(v.x for v in bconsts), *init_x]
  return [Val(o) for o in bind(eqn, vals, new)]
