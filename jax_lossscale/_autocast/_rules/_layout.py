"""The layout primitives: they move or select data, and its dtype and facts carry through.

A layout runs in its operand's dtype and carries that operand's facts (a lower-precision
result, a function input's rank, a constant); float operands that disagree (``select_n``,
``concatenate``) are promoted, constants following the others. ``convert_element_type`` and
``zeros_like`` have rules of their own. A layout of a tapped value is that tap for
``check_underflow``, and a layout of a user's tap is the user's tap.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from jax_lossscale._autocast._rules._promotion import keep_lowp
from jax_lossscale._autocast._rules._promotion import promote
from jax_lossscale._autocast._rules._registry import LAYOUT
from jax_lossscale._autocast._rules._registry import V0_10
from jax_lossscale._autocast._rules._registry import V0_11
from jax_lossscale._autocast._rules._registry import Interp
from jax_lossscale._autocast._rules._registry import Name
from jax_lossscale._autocast._rules._registry import register
from jax_lossscale._autocast._values import Facts
from jax_lossscale._autocast._values import Val
from jax_lossscale._autocast._values import bind
from jax_lossscale._autocast._values import is_eligible
from jax_lossscale._autocast._values import is_float

__all__ = ("convert", "layout", "zeros_like")

#: Layouts through which a value stays (a layout of) the function input it was: the
#: candidates for torch's bias rule (a parameter of lower rank added onto a lower-precision
#: result is part of that op, as in torch's ``linear``).
KEEPS_RANK = (
  "reshape",
  "broadcast_in_dim",
  "transpose",
  "squeeze",
  "copy",
  "slice",
  "rev",
  "sharding_constraint",
  "layout_constraint",
  "reshard",
  "name",
  "stop_gradient",
)

#: The other layouts.
MOVES = (
  "dynamic_slice",
  "dynamic_update_slice",
  "gather",
  "pad",
  "concatenate",
  "split",
  "select_n",
  "tile",
  Name("stack", since=V0_10),
  Name("unstack", since=V0_10),
  Name("relayout", since=V0_11),
)


def _carry_taps(interp: Interp, ins: list[Val], outs: list[Val], keeps_rank: bool) -> list[Val]:
  taps = interp.taps
  if taps is not None and len(ins) == 1 and len(outs) == 1:
    if taps.is_user(ins[0].x):  # a layout of a user's tap (its cast) is that tap
      taps.mark_user(outs[0].x)
    name = taps.tapped(ins[0].x)
    if name is not None and keeps_rank:
      taps.same_as(outs[0].x, name)
  return outs


def _moved(interp: Interp, eqn: Any, ins: list[Val], keeps_rank: bool) -> list[Val]:
  outs = bind(eqn, promote(interp, eqn, ins))
  floats = [v for v in ins if is_float(v.x)]
  if len(floats) <= 1:
    first = ins[0].facts
    facts = Facts(
      lowp=first.lowp,
      input_rank=first.input_rank if keeps_rank else None,
      follows=first.follows,
    )
  else:  # select_n, concatenate, pad, dynamic_update_slice: what all operands share
    driving = [v for v in floats if not v.facts.follows]
    facts = Facts(
      lowp=bool(driving) and all(v.facts.lowp for v in driving),
      follows=not driving,
    )
  vals = [Val(o, keep_lowp(interp, o, facts)) for o in outs]
  return _carry_taps(interp, ins, vals, keeps_rank)


@register(LAYOUT, *KEEPS_RANK, keeps_rank=True)
def keeps_rank(interp: Interp, eqn: Any, ins: list[Val]) -> list[Val]:
  """Runs in its operand's dtype and carries its facts, a function input's rank included
  (the bias rule sees a reshaped or broadcast parameter as the parameter)."""
  return _moved(interp, eqn, ins, keeps_rank=True)


@register(LAYOUT, *MOVES)
def layout(interp: Interp, eqn: Any, ins: list[Val]) -> list[Val]:
  """Runs in its operand's dtype and carries its facts; float operands that disagree
  (`select_n`, `concatenate`) are promoted, constants following the others."""
  return _moved(interp, eqn, ins, keeps_rank=False)


@register(LAYOUT, "convert_element_type", keeps_rank=True)
def convert(interp: Interp, eqn: Any, ins: list[Val]) -> list[Val]:
  """The model's own cast: honoured, except a weak float made strong (an identity), and a
  bool or integer made float (a mask), which takes the dtype of what it meets."""
  val = ins[0]
  declared_in = np.dtype(eqn.invars[0].aval.dtype)
  new = np.dtype(eqn.params["new_dtype"]) if is_eligible(eqn.params["new_dtype"]) else None
  if (
    new is not None
    and not is_eligible(declared_in)
    and not jnp.issubdtype(declared_in, jnp.floating)
  ):
    # A bool or integer array made float: a mask, a count. It has no float dtype of
    # its own (torch's bool * half is half).
    out = Val(bind(eqn, [val.x])[0], Facts(follows=True))
  elif new is not None and new == declared_in and is_float(val.x) and np.dtype(val.x.dtype) != new:
    # An identity of the model (a weak float made strong) on a value autocast cast:
    # the value stays in its dtype.
    out = val
  else:
    x = bind(eqn, [val.x])[0]
    out = Val(x, keep_lowp(interp, x, val.facts))
  return _carry_taps(interp, ins, [out], keeps_rank=True)


@register(LAYOUT, "zeros_like")
def zeros_like(interp: Interp, eqn: Any, ins: list[Val]) -> list[Val]:
  """Zeros that take the dtype of what they meet (a constant)."""
  outs = [Val(o, Facts(follows=True)) for o in bind(eqn, [v.x for v in ins])]
  return _carry_taps(interp, ins, outs, keeps_rank=False)
