"""torch's promotion of the float operands of one op, which several rooms' rules share.

An op whose float operands disagree runs in their widest dtype, as torch promotes: each
group of operands the function traced in one dtype is brought back to one dtype, chosen
among the operands that drive it (a constant or a converted mask follows the others), by
torch's categories (dimensioned tensors over zero-dim tensors over Python scalars) or, for
an ``add``, by torch's bias rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from jax_lossscale._autocast._rules._registry import Interp
from jax_lossscale._autocast._values import Facts
from jax_lossscale._autocast._values import Val
from jax_lossscale._autocast._values import cast
from jax_lossscale._autocast._values import is_float
from jax_lossscale._autocast._values import torch_promote

__all__ = ("keep_lowp", "promote")


def promote(interp: Interp, eqn: Any, ins: Sequence[Val], bias: bool = False) -> list[Any]:
  """The operands of ``eqn``, float ones brought to one dtype.

  Args:
    interp: the interpreter.
    eqn: the equation.
    ins: its operands' values.
    bias: the op is an ``add``, to which torch's bias rule applies (:func:`_bias_target`).
  """
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
    target = _bias_target(interp, ins, driving) if bias else None
    if target is None:
      target = _torch_promotion(eqn, ins, driving)
    for i in members:
      vals[i] = cast(vals[i], target)
  return vals


def _bias_target(interp: Interp, ins: Sequence[Val], members: Sequence[int]) -> Any:
  """The op's dtype for a parameter of lower rank added onto a lower-precision result.

  torch's ``linear``, ``addmm`` and ``conv`` include their bias; a second lower-rank
  tensor added to the sum (a positional table) promotes, since the sum is no longer
  the op's output.
  """
  if len(members) != 2:
    return None
  a, b = members
  for lo, other in ((a, b), (b, a)):
    lo_v, other_v = ins[lo], ins[other]
    if not lo_v.facts.lowp or np.dtype(lo_v.x.dtype) != interp.dtype or other_v.facts.lowp:
      continue
    rank = other_v.facts.input_rank
    if rank is None or rank >= len(lo_v.x.shape):
      continue
    return interp.dtype
  return None


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


def keep_lowp(interp: Interp, out: Any, facts: Facts) -> Facts:
  """``facts`` of ``out``, no longer a lower-precision result if ``out`` left the dtype."""
  if facts.lowp and not (is_float(out) and np.dtype(out.dtype) == interp.dtype):
    return facts._replace(lowp=False)
  return facts
