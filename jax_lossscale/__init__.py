"""jax_lossscale: PyTorch-exact dynamic loss scaling for JAX and Optax.

The names a user needs first are the transformations (:func:`dynamic_loss_scale`,
:func:`static_loss_scale`, :func:`no_loss_scale`), :func:`scale_loss` and
:func:`metrics`, and :func:`autocast` (torch's autocast policy for any JAX
function, with :func:`float32` to keep a region in float32). The scale rule's building blocks (:func:`update_scale`,
:func:`unscale_and_check`, :func:`all_finite`, :func:`scale_product`,
:func:`fp16_roundtrip`) stay at the top level too. Interop and tooling live in
namespaces: :mod:`jax_lossscale.flax` (the TrainState field; needs Flax, imported on first
use of ``jax_lossscale.flax``),
:mod:`jax_lossscale.torch` (``GradScaler.state_dict()``),
:mod:`jax_lossscale.diagnostics` and :mod:`jax_lossscale.checkpoint`.
"""

import importlib as _importlib
import warnings as _warnings

from jax_lossscale import checkpoint as checkpoint
from jax_lossscale import diagnostics as diagnostics
from jax_lossscale import torch as torch
from jax_lossscale._autocast import AutocastError as AutocastError
from jax_lossscale._autocast import ClosedOverTracerError as ClosedOverTracerError
from jax_lossscale._autocast import UnsupportedPrimitiveError as UnsupportedPrimitiveError
from jax_lossscale._autocast import autocast as autocast
from jax_lossscale._autocast import autocast_op as autocast_op
from jax_lossscale._autocast import autocast_policy as autocast_policy
from jax_lossscale._autocast import float32 as float32
from jax_lossscale._integrations._model_state import keep_if_skipped as keep_if_skipped
from jax_lossscale._scaler._accumulation import multi_steps as multi_steps
from jax_lossscale._scaler._guard import LossScaleError as LossScaleError
from jax_lossscale._scaler._guard import check_skips as check_skips
from jax_lossscale._scaler._loss import scale_loss as scale_loss
from jax_lossscale._scaler._metrics import metrics as metrics
from jax_lossscale._scaler._numerics import all_finite as all_finite
from jax_lossscale._scaler._numerics import fp16_roundtrip as fp16_roundtrip
from jax_lossscale._scaler._numerics import unscale_and_check as unscale_and_check
from jax_lossscale._scaler._product import scale_product as scale_product
from jax_lossscale._scaler._retry import RetriedGrads as RetriedGrads
from jax_lossscale._scaler._retry import retry_on_overflow as retry_on_overflow
from jax_lossscale._scaler._rule import update_scale as update_scale
from jax_lossscale._scaler._signals import LossScaleWarning as LossScaleWarning
from jax_lossscale._scaler._state import DynamicScaleConfig as DynamicScaleConfig
from jax_lossscale._scaler._state import DynamicScaleState as DynamicScaleState
from jax_lossscale._scaler._state import get_scale_state as get_scale_state
from jax_lossscale._scaler._transform import LossScaleState as LossScaleState
from jax_lossscale._scaler._transform import dynamic_loss_scale as dynamic_loss_scale
from jax_lossscale._scaler._transform import get_inner_state as get_inner_state
from jax_lossscale._scaler._transform import no_loss_scale as no_loss_scale
from jax_lossscale._scaler._transform import static_loss_scale as static_loss_scale

#: The one version source (pyproject.toml reads it).
__version__ = "0.2.0"

__all__ = (
  "AutocastError",
  "ClosedOverTracerError",
  "DynamicScaleConfig",
  "DynamicScaleState",
  "LossScaleError",
  "LossScaleState",
  "LossScaleWarning",
  "RetriedGrads",
  "UnsupportedPrimitiveError",
  "all_finite",
  "autocast",
  "autocast_op",
  "autocast_policy",
  "check_skips",
  "dynamic_loss_scale",
  "float32",
  "fp16_roundtrip",
  "get_inner_state",
  "get_scale_state",
  "keep_if_skipped",
  "metrics",
  "multi_steps",
  "no_loss_scale",
  "retry_on_overflow",
  "scale_loss",
  "scale_product",
  "static_loss_scale",
  "unscale_and_check",
  "update_scale",
)

#: Top-level names of 0.1.0 that moved to a namespace: old name -> new module.
#: They keep working for one release, with a FutureWarning (shown by default: Python hides
#: a DeprecationWarning raised outside ``__main__``).
_DEPRECATED = {
  "UnderflowReport": "jax_lossscale.diagnostics",
  "check_underflow": "jax_lossscale.diagnostics",
  "grad_diagnostics": "jax_lossscale.diagnostics",
  "grad_leaf_names": "jax_lossscale.diagnostics",
  "nonfinite_leaves": "jax_lossscale.diagnostics",
  "check_scale_config": "jax_lossscale.checkpoint",
  "scale_config_metadata": "jax_lossscale.checkpoint",
  "from_torch_state_dict": "jax_lossscale.torch",
  "to_torch_state_dict": "jax_lossscale.torch",
}


#: Top-level names of 0.1.0 that were renamed: old name -> new name (same module).
#: They keep working for one release, with a FutureWarning (shown by default: Python hides
#: a DeprecationWarning raised outside ``__main__``).
_RENAMED = {
  # It read like the field LossScaleState.inner_state; named like get_scale_state now.
  "inner_state": "get_inner_state",
}


def __getattr__(name: str) -> object:
  """``jax_lossscale.flax`` imported on first use (Flax is an optional extra), and the moved
  names of :data:`_DEPRECATED` and the renamed ones of :data:`_RENAMED`, with a
  ``FutureWarning`` (visible by default, as a removal should be)."""
  if name == "flax":
    try:
      return _importlib.import_module("jax_lossscale.flax")
    except ImportError as e:
      raise AttributeError(
        f"jax_lossscale.flax is not available: {e} (pip install 'jax-lossscale[flax]')"
      ) from e
  module, new = _DEPRECATED.get(name), _RENAMED.get(name)
  if module is not None:
    message = f"jax_lossscale.{name} moved to {module}.{name}"
  elif new is not None:
    module, message = "jax_lossscale", f"jax_lossscale.{name} is now jax_lossscale.{new}"
  else:
    raise AttributeError(f"module 'jax_lossscale' has no attribute {name!r}")
  _warnings.warn(
    f"{message}; the old name is deprecated and will be removed in the next release.",
    FutureWarning,
    stacklevel=2,
  )
  return getattr(_importlib.import_module(module), new or name)
