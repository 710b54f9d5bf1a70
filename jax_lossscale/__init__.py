"""jax_lossscale: PyTorch-exact dynamic loss scaling for JAX and Optax."""

from jax_lossscale._accumulation import multi_steps as multi_steps
from jax_lossscale._checkpoint import check_scale_config as check_scale_config
from jax_lossscale._checkpoint import scale_config_metadata as scale_config_metadata
from jax_lossscale._diagnostics import UnderflowReport as UnderflowReport
from jax_lossscale._diagnostics import check_underflow as check_underflow
from jax_lossscale._diagnostics import grad_diagnostics as grad_diagnostics
from jax_lossscale._diagnostics import grad_leaf_names as grad_leaf_names
from jax_lossscale._guard import LossScaleError as LossScaleError
from jax_lossscale._guard import check_skips as check_skips
from jax_lossscale._metrics import metrics as metrics
from jax_lossscale._metrics import nonfinite_leaves as nonfinite_leaves
from jax_lossscale._numerics import all_finite as all_finite
from jax_lossscale._numerics import fp16_roundtrip as fp16_roundtrip
from jax_lossscale._numerics import unscale_and_check as unscale_and_check
from jax_lossscale._product import scale_product as scale_product
from jax_lossscale._rule import update_scale as update_scale
from jax_lossscale._signals import LossScaleWarning as LossScaleWarning
from jax_lossscale._state import DynamicScaleConfig as DynamicScaleConfig
from jax_lossscale._state import DynamicScaleState as DynamicScaleState
from jax_lossscale._state import get_scale_state as get_scale_state
from jax_lossscale._torch_interop import from_torch_state_dict as from_torch_state_dict
from jax_lossscale._torch_interop import to_torch_state_dict as to_torch_state_dict
from jax_lossscale._transform import LossScaleState as LossScaleState
from jax_lossscale._transform import dynamic_loss_scale as dynamic_loss_scale
from jax_lossscale._transform import inner_state as inner_state
from jax_lossscale._transform import no_loss_scale as no_loss_scale
from jax_lossscale._transform import scale_loss as scale_loss
from jax_lossscale._transform import static_loss_scale as static_loss_scale

__version__ = "0.1.0"

__all__ = (
  "DynamicScaleConfig",
  "DynamicScaleState",
  "LossScaleError",
  "LossScaleState",
  "LossScaleWarning",
  "UnderflowReport",
  "all_finite",
  "check_scale_config",
  "check_skips",
  "check_underflow",
  "dynamic_loss_scale",
  "fp16_roundtrip",
  "from_torch_state_dict",
  "get_scale_state",
  "grad_diagnostics",
  "grad_leaf_names",
  "inner_state",
  "metrics",
  "multi_steps",
  "no_loss_scale",
  "nonfinite_leaves",
  "scale_config_metadata",
  "scale_loss",
  "scale_product",
  "static_loss_scale",
  "to_torch_state_dict",
  "unscale_and_check",
  "update_scale",
)
