"""The scatters: the operand and the updates are promoted together.

A scatter's operand and updates run in one dtype, their widest (as torch's ``index_put``
and ``scatter_add``), and its combiner is traced again for that dtype: scatters and segment
ops of a float16 message stay float16.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.extend.core as jex
import numpy as np

from jax_lossscale._autocast._rules._promotion import keep_lowp
from jax_lossscale._autocast._rules._promotion import promote
from jax_lossscale._autocast._rules._registry import SCATTER
from jax_lossscale._autocast._rules._registry import Interp
from jax_lossscale._autocast._rules._registry import register
from jax_lossscale._autocast._values import Facts
from jax_lossscale._autocast._values import Val
from jax_lossscale._autocast._values import bind

__all__ = ("scatter",)


@register(
  SCATTER, "scatter", "scatter-add", "scatter-sub", "scatter-mul", "scatter-min", "scatter-max"
)
def scatter(interp: Interp, eqn: Any, ins: list[Val]) -> list[Val]:
  """The operand and the updates are promoted together, and the combiner is traced again
  for the dtype they get (`x.at[i].add(u)`, `jax.ops.segment_sum`: float16 stays float16)."""
  vals = promote(interp, eqn, ins)
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
  return [Val(o, keep_lowp(interp, o, Facts(lowp=ins[0].facts.lowp))) for o in outs]
