"""The first-order primitives: each computes on its operands, under the policy's rule.

torch's CUDA autocast lists name the ops that run in the autocast dtype (``lower``) or in
float32 (``float32``); every other op runs in the dtype of its operands, promoted as torch
promotes when float operands disagree (``promote``). The policy (:mod:`.._policy`) gives each
primitive its rule; the primitives of its rows are first-order, and so are those listed
here, which promote unless a user's policy says otherwise.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from jax_lossscale._autocast._errors import unsupported
from jax_lossscale._autocast._policy import FLOAT32
from jax_lossscale._autocast._policy import LOWER
from jax_lossscale._autocast._policy import POLICY_TABLE
from jax_lossscale._autocast._policy import PROMOTE
from jax_lossscale._autocast._rules._promotion import promote
from jax_lossscale._autocast._rules._registry import FIRST_ORDER
from jax_lossscale._autocast._rules._registry import V0_10
from jax_lossscale._autocast._rules._registry import V0_11
from jax_lossscale._autocast._rules._registry import V0_12
from jax_lossscale._autocast._rules._registry import Interp
from jax_lossscale._autocast._rules._registry import Name
from jax_lossscale._autocast._rules._registry import register
from jax_lossscale._autocast._rules._registry import unknown
from jax_lossscale._autocast._values import Facts
from jax_lossscale._autocast._values import Val
from jax_lossscale._autocast._values import bind
from jax_lossscale._autocast._values import cast
from jax_lossscale._autocast._values import cast_to_declared
from jax_lossscale._autocast._values import is_eligible
from jax_lossscale._autocast._values import is_float
from jax_lossscale._autocast._values import jaxprs_in_params

__all__ = ("add", "first_order", "unknown_primitive")

#: The first-order primitives in no row of the policy (which promote by default), defined by
#: every supported JAX release.
COMPUTES = (
  # elementwise arithmetic and comparisons
  "abs",
  "acosh",
  "add_any",
  "and",
  "asinh",
  "atan",
  "atanh",
  "bessel_i0e",
  "bessel_i1e",
  "cbrt",
  "ceil",
  "clamp",
  "clz",
  "complex",
  "conj",
  "cos",
  "digamma",
  "div",
  "eq",
  "eq_to",
  "erf",
  "erfc",
  "exp2",
  "floor",
  "ge",
  "gt",
  "igamma",
  "igamma_grad_a",
  "igammac",
  "imag",
  "is_finite",
  "le",
  "le_to",
  "lgamma",
  "logistic",
  "lt",
  "lt_to",
  "max",
  "min",
  "mul",
  "ne",
  "neg",
  "nextafter",
  "not",
  "or",
  "polygamma",
  "population_count",
  "real",
  "regularized_incomplete_beta",
  "rem",
  "round",
  "shift_left",
  "shift_right_arithmetic",
  "shift_right_logical",
  "sign",
  "sin",
  "sqrt",
  "sub",
  "tanh",
  "xor",
  "zeta",
  # reductions, scans over an axis, contractions, convolutions
  "argmax",
  "argmin",
  "cummax",
  "cummin",
  "reduce_and",
  "reduce_max",
  "reduce_min",
  "reduce_or",
  "reduce_xor",
  "reduce_window_max",
  "reduce_window_min",
  "reduce_window_sum",
  "ragged_dot_general",
  "fft",
  "top_k",
  "approx_top_k",
  # linear algebra (one float operand each, or operands of one dtype)
  "cholesky",
  "cholesky_update",
  "eig",
  "eigh",
  "geqp3",
  "geqrf",
  "hessenberg",
  "householder_product",
  "lu",
  "lu_pivots_to_permutation",
  "qr",
  "schur",
  "svd",
  "symmetric_product",
  "triangular_solve",
  "tridiagonal",
  "tridiagonal_solve",
)

#: Those only some JAX releases define (jnp.log2 is its own primitive from jax 0.11, and takes
#: the log row's rule: ``_policy.VERSIONED_ROWS``).
COMPUTES_SINCE = (
  Name("mulhi", since=V0_10),
  Name("ormqr", since=V0_10),
  Name("log2", since=V0_11),
  Name("one_minus_square", since=V0_11),
  Name("polynomial", since=V0_12),
)


def compute(interp: Interp, eqn: Any, ins: list[Val], rule: str, bias: bool = False) -> list[Val]:
  """``eqn`` bound on its operands cast by ``rule``; ``bias``: torch's bias rule applies."""
  params = dict(eqn.params)
  if interp.as_written_mode:
    outs = bind(eqn, cast_to_declared([v.x for v in ins], [v.aval for v in eqn.invars]))
    if rule == LOWER:
      outs = interp.tap(eqn, outs)
    return [Val(o) for o in outs]
  if rule == LOWER:
    vals = [cast(v.x, interp.dtype) if is_float(v.x) else v.x for v in ins]
    pet = params.get("preferred_element_type")
    if pet is not None and is_eligible(pet):
      params["preferred_element_type"] = interp.dtype
    outs = interp.tap(eqn, bind(eqn, vals, params))
    return [Val(o, Facts(lowp=is_float(o) and np.dtype(o.dtype) == interp.dtype)) for o in outs]
  if rule == FLOAT32:
    vals = [cast(v.x, jnp.float32) if is_float(v.x) else v.x for v in ins]
  else:
    vals = promote(interp, eqn, ins, bias)
  return [Val(o) for o in bind(eqn, vals, params)]


@register(FIRST_ORDER, *(row.primitive for row in POLICY_TABLE), *COMPUTES, *COMPUTES_SINCE)
def first_order(interp: Interp, eqn: Any, ins: list[Val]) -> list[Val]:
  """Takes its rule from the policy: `lower` (cast to the autocast dtype), `float32`, or
  `promote` (the default: torch's rule for an op in no list, constants following the others)."""
  return compute(interp, eqn, ins, interp.policy.get(eqn.primitive.name, PROMOTE))


@register(FIRST_ORDER, "add")
def add(interp: Interp, eqn: Any, ins: list[Val]) -> list[Val]:
  """Takes its rule from the policy, with torch's bias rule: a parameter of lower rank added
  onto a lower-precision result stays in its dtype, as in torch's `linear`."""
  same = _tapped_output_met(interp, ins)
  outs = compute(interp, eqn, ins, interp.policy.get(eqn.primitive.name, PROMOTE), bias=True)
  if same is not None and len(outs) == 1:
    interp.taps.same_as(outs[0].x, same)  # type: ignore[union-attr]
  return outs


def _tapped_output_met(interp: Interp, ins: list[Val]) -> str | None:
  """A user's tap added to a tapped output: that output is tapped already.

  Returns the tap name of an ``add`` of a tapped output and a lower-rank or same-shape
  value that is not a user's tap (a bias): the sum has that output's gradient.
  """
  taps = interp.taps
  if taps is None or len(ins) != 2:
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


@unknown
def unknown_primitive(interp: Interp, eqn: Any, ins: list[Val]) -> list[Val]:
  """A primitive no rule declares: refused if it holds sub-jaxprs
  (`UnsupportedPrimitiveError`), else it promotes as a first-order one."""
  if next(iter(jaxprs_in_params(eqn.params)), None) is not None:  # a generator: never falsy
    raise unsupported(eqn.primitive.name, eqn)
  return compute(interp, eqn, ins, PROMOTE)
