"""The calls: ``jit``, the call primitives, ``remat`` and ``shard_map``.

Each is rebound as itself with its body interpreted (the call primitives are inlined), every
other parameter carried as it was: shardings, donation, layouts, remat's policy, the mesh.
A ``jit`` that marks a region of autocast's own (a composite op, a ``float32`` region, a
nested autocast: :func:`jit_region`) is evaluated by that region's rule instead.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import jax.extend.core as jex

from jax_lossscale._autocast._errors import unsupported
from jax_lossscale._autocast._rules._registry import HIGHER_ORDER
from jax_lossscale._autocast._rules._registry import V0_10
from jax_lossscale._autocast._rules._registry import V0_11
from jax_lossscale._autocast._rules._registry import Interp
from jax_lossscale._autocast._rules._registry import Name
from jax_lossscale._autocast._rules._registry import RuleFn
from jax_lossscale._autocast._rules._registry import register
from jax_lossscale._autocast._values import Facts
from jax_lossscale._autocast._values import Val
from jax_lossscale._autocast._values import bind
from jax_lossscale._autocast._values import hoist
from jax_lossscale._autocast._values import param

__all__ = ("call", "closed_call", "jit", "jit_region", "pmap", "remat", "shard_map")

#: ``jit`` regions that a module of autocast evaluates itself, by a mark in their name
#: (:func:`jit_region`): composite ops, ``float32`` regions, nested autocasts.
_REGIONS: dict[str, RuleFn] = {}


def jit_region(
  mark: str,
) -> Callable[[RuleFn], Any]:
  """Declares the decorated ``fn(interp, eqn, ins)`` the evaluation of every ``jit``
  whose name holds ``mark``, instead of interpreting its body."""

  def declare(fn: RuleFn) -> Any:
    if mark in _REGIONS:
      raise ValueError(f"the jit region mark {mark!r} is declared twice.")
    _REGIONS[mark] = fn
    return fn

  return declare


@register(HIGHER_ORDER, "jit")
def jit(interp: Interp, eqn: Any, ins: list[Val]) -> list[Val]:
  """Rebound as itself, params kept; its body is interpreted with the facts of its inputs
  (a bias inside a `jit` stays float16). A `jit` that marks a region of autocast's own is
  evaluated by that region's rule (the table below)."""
  params = eqn.params
  name = str(params.get("name", ""))
  for mark, region in _REGIONS.items():
    if mark in name:
      return region(interp, eqn, ins)
  jaxpr = param(eqn, "jaxpr")
  closed, facts = interp.trace(
    lambda vs: interp.eval_closed(jaxpr, vs), [v.x for v in ins], [v.facts for v in ins]
  )
  closed, consts = hoist(closed)
  new = dict(params, jaxpr=closed)
  if consts:
    k = len(consts)
    in_shardings = param(eqn, "in_shardings")
    new["in_shardings"] = (*_unspecified(in_shardings, k), *in_shardings)
    if "in_layouts" in params:
      new["in_layouts"] = (None,) * k + tuple(params["in_layouts"])
    if "donated_invars" in params:
      new["donated_invars"] = (False,) * k + tuple(params["donated_invars"])
  outs = bind(eqn, [*consts, *(v.x for v in ins)], new)
  return [Val(o, f) for o, f in zip(outs, facts, strict=True)]


def _unspecified(shardings: Sequence[Any], k: int) -> tuple[Any, ...]:
  unspec = next((s for s in shardings if type(s).__name__ == "UnspecifiedValue"), None)
  if unspec is None:
    from jax._src.sharding_impls import UNSPECIFIED  # only for a jit with every input sharded

    unspec = UNSPECIFIED
  return (unspec,) * k


@register(HIGHER_ORDER, Name("closed_call", until=V0_11), "eval_jaxpr")
def closed_call(interp: Interp, eqn: Any, ins: list[Val]) -> list[Val]:
  """Evaluated inline: its jaxpr is interpreted in place."""
  # closed_call (jax <= 0.10), and eval_jaxpr, which replaces it from jax 0.11 (jax 0.10's
  # eval_jaxpr, which spells it `jaxpr`, is staged out as a closed_call).
  return interp.eval_closed(param(eqn, "call_jaxpr", "jaxpr"), ins)


@register(HIGHER_ORDER, Name("call", until=V0_11))
def call(interp: Interp, eqn: Any, ins: list[Val]) -> list[Val]:
  """Evaluated inline (jax 0.10's `call`)."""
  return interp.eval_jaxpr(param(eqn, "call_jaxpr"), (), ins)


@register(HIGHER_ORDER, "remat2")
def remat(interp: Interp, eqn: Any, ins: list[Val]) -> list[Val]:
  """Rebound as itself, params kept (`policy`, `prevent_cse`); its body is interpreted."""
  params = eqn.params
  jaxpr = param(eqn, "jaxpr")
  closed, facts = interp.trace(
    lambda vs: interp.eval_jaxpr(jaxpr, (), vs),
    [v.x for v in ins],
    [v.facts for v in ins],
  )
  closed, consts = hoist(closed)
  outs = bind(eqn, [*consts, *(v.x for v in ins)], dict(params, jaxpr=closed.jaxpr))
  return [Val(o, f) for o, f in zip(outs, facts, strict=True)]


@register(HIGHER_ORDER, "shard_map", untapped=True)
def shard_map(interp: Interp, eqn: Any, ins: list[Val]) -> list[Val]:
  """The body is traced through `jax.shard_map` (which sets up the manual axes) and swapped
  into the equation, params kept; its lower-precision outputs are counted, not tapped, by
  `check_underflow`."""
  # The body is traced through the public constructor (it sets up the manual axes), and
  # the sub-jaxpr it traced is swapped into this equation's own parameters.
  params = eqn.params
  jaxpr = param(eqn, "jaxpr")
  captured: list[list[Facts]] = []
  facts_in = [v.facts for v in ins]

  def body(*xs: Any) -> tuple[Any, ...]:
    outs = interp.eval_jaxpr(jaxpr, (), [Val(x, f) for x, f in zip(xs, facts_in, strict=True)])
    captured.append([o.facts for o in outs])
    return tuple(o.x for o in outs)

  axis_names = params.get("newly_manual_axes", params.get("manual_axes", frozenset()))
  fn = jax.shard_map(
    body,
    mesh=param(eqn, "mesh"),
    in_specs=tuple(param(eqn, "in_specs")),
    out_specs=tuple(param(eqn, "out_specs")),
    axis_names=frozenset(axis_names),
    check_vma=params.get("check_vma", params.get("check_rep", True)),
  )
  outer = jax.make_jaxpr(fn)(*(v.x for v in ins))
  traced = [e for e in outer.jaxpr.eqns if e.primitive is eqn.primitive]
  if len(outer.jaxpr.eqns) != 1 or len(traced) != 1 or outer.consts:
    # The constructor's own equations, as traced (not traced again: its ops are counted once).
    outs = jex.jaxpr_as_fun(outer)(*(v.x for v in ins))
  else:
    outs = bind(eqn, [v.x for v in ins], dict(params, jaxpr=traced[0].params["jaxpr"]))
  return [Val(o, f) for o, f in zip(outs, captured[-1], strict=True)]


@register(HIGHER_ORDER, Name("xla_pmap", until=V0_10))
def pmap(interp: Interp, eqn: Any, ins: list[Val]) -> list[Val]:
  """Refused (`UnsupportedPrimitiveError`): jax.pmap's own primitive, until jax 0.10 (a
  `shard_map` from then on); wrap the region in `jax_lossscale.float32`."""
  raise unsupported(eqn.primitive.name, eqn)
