"""Checkpoint helpers: save the scaler's static configuration beside a checkpoint.

The scale state's arrays (scale, trackers, counters) are ordinary pytree leaves
that Orbax saves and restores; its configuration is static metadata and is not
in the checkpoint. Save :func:`scale_config_metadata` beside it (for example as
Orbax ``custom_metadata``) and call :func:`check_scale_config` on restore.
"""

from jax_lossscale._integrations._checkpoint import check_scale_config as check_scale_config
from jax_lossscale._integrations._checkpoint import scale_config_metadata as scale_config_metadata

__all__ = (
  "check_scale_config",
  "scale_config_metadata",
)
