"""The branches: ``cond``.

Each branch is interpreted once (``check_underflow`` counts its ops once), and an output
takes the widest of its dtypes in the branches, as torch's eager code would have run the
branch taken; the casts to those dtypes are added to the traced branches afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import jax.extend.core as jex
import numpy as np

from jax_lossscale._autocast._rules._registry import HIGHER_ORDER
from jax_lossscale._autocast._rules._registry import Interp
from jax_lossscale._autocast._rules._registry import register
from jax_lossscale._autocast._values import Facts
from jax_lossscale._autocast._values import Val
from jax_lossscale._autocast._values import bind
from jax_lossscale._autocast._values import cast
from jax_lossscale._autocast._values import hoist
from jax_lossscale._autocast._values import is_eligible
from jax_lossscale._autocast._values import param
from jax_lossscale._autocast._values import torch_promote
from jax_lossscale._autocast._values import users_cross

__all__ = ("cond",)


@register(HIGHER_ORDER, "cond", untapped=True)
def cond(interp: Interp, eqn: Any, ins: list[Val]) -> list[Val]:
  """Rebound as itself, params kept; each output promoted to the widest dtype of the
  branches (float16 where every branch gives float16)."""
  params = eqn.params
  branches = param(eqn, "branches")
  index, ops = ins[0], ins[1:]
  op_x, op_facts = [v.x for v in ops], [v.facts for v in ops]

  def branch_fn(b: Any) -> Callable[[list[Val]], list[Val]]:
    def run(vs: list[Val]) -> list[Val]:
      users_cross(interp.taps, ops, vs)
      return interp.eval_closed(b, vs)

    return run

  # Each branch is interpreted once (check_underflow counts its ops once); the casts to
  # the outputs' common dtypes are added to the traced branch afterwards.
  traced = [interp.trace(branch_fn(b), op_x, op_facts) for b in branches]
  n_out = len(traced[0][0].out_avals)
  targets = [_common_float([c.out_avals[i].dtype for c, _ in traced]) for i in range(n_out)]
  cast_branches = [_cast_outputs(c, targets, op_x) for c, _ in traced]
  closed_branches, consts = _common_consts(cast_branches, op_x)
  facts = [
    Facts(lowp=all(f[i].lowp for _, f in traced) and targets[i] == interp.dtype)
    for i in range(n_out)
  ]
  outs = bind(eqn, [index.x, *consts, *op_x], dict(params, branches=tuple(closed_branches)))
  return [Val(o, f) for o, f in zip(outs, facts, strict=True)]


def _common_float(dtypes: Sequence[Any]) -> np.dtype | None:
  """The dtype a float output takes from its dtypes in the branches; ``None`` for any other
  output (an integer, a PRNG key), which every branch gives in its declared dtype."""
  if not all(is_eligible(d) for d in dtypes):
    return None
  return torch_promote([np.dtype(d) for d in dtypes])


def _cast_outputs(closed: Any, targets: Sequence[Any], args: Sequence[Any]) -> Any:
  """``closed`` with its float outputs cast to ``targets``, traced again as it is (not
  through the interpreter, so no op of it is counted twice)."""
  if all(
    t is None or np.dtype(a.dtype) == t for a, t in zip(closed.out_avals, targets, strict=True)
  ):
    return closed
  fn = jex.jaxpr_as_fun(closed)

  def run(*xs: Any) -> list[Any]:
    return [o if t is None else cast(o, t) for o, t in zip(fn(*xs), targets, strict=True)]

  return jax.make_jaxpr(run)(*args)


def _common_consts(closed: Sequence[Any], args: Sequence[Any]) -> tuple[list[Any], list[Any]]:
  """Branches without consts: every branch's consts become shared leading inputs."""
  hoisted = [hoist(c) for c in closed]
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
