"""Interop with ``torch.amp.GradScaler``: its ``state_dict()`` to and from a scale state.

A run moved either way mid-training continues with the identical scale
trajectory. torch is never imported: the state dict holds Python floats and ints.

Examples:
  >>> import jax_lossscale as jls
  >>> sd = jls.torch.to_torch_state_dict(jls.DynamicScaleState.create(init_scale=8.0))
  >>> sd["scale"], sd["growth_interval"]
  (8.0, 2000)
  >>> float(jls.torch.from_torch_state_dict(sd).scale)
  8.0
"""

from jax_lossscale._integrations._torch_interop import (
  from_torch_state_dict as from_torch_state_dict,
)
from jax_lossscale._integrations._torch_interop import to_torch_state_dict as to_torch_state_dict

__all__ = (
  "from_torch_state_dict",
  "to_torch_state_dict",
)
