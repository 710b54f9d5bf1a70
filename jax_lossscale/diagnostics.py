"""Diagnostics: what float16 flushes or overflows, per gradient leaf.

* :func:`check_underflow`, once, before training: does this model need loss scaling?
* :func:`grad_diagnostics`, inside the train step: headroom and underflow per leaf, jit-safe.
* :func:`nonfinite_leaves`: which leaf overflowed.
* :func:`grad_leaf_names`: the leaf names, on the host, to read the two above.
"""

from jax_lossscale._diagnostics._stats import GradDiagnostics as GradDiagnostics
from jax_lossscale._diagnostics._stats import grad_diagnostics as grad_diagnostics
from jax_lossscale._diagnostics._stats import grad_leaf_names as grad_leaf_names
from jax_lossscale._diagnostics._underflow import UnderflowReport as UnderflowReport
from jax_lossscale._diagnostics._underflow import check_underflow as check_underflow
from jax_lossscale._scaler._metrics import nonfinite_leaves as nonfinite_leaves

__all__ = (
  "GradDiagnostics",
  "UnderflowReport",
  "check_underflow",
  "grad_diagnostics",
  "grad_leaf_names",
  "nonfinite_leaves",
)
