"""Flax integration: a ``TrainState`` carrying the scaler, and a scaled ``value_and_grad``.

Three ways to use loss scaling with Flax:

* **Scaler inside the optimizer** (linen and NNX): build the optimizer with
  :func:`jax_lossscale.dynamic_loss_scale` and use Flax's stock
  ``TrainState`` or ``nnx.Optimizer`` unchanged; multiply the loss with
  ``jax_lossscale.scale_loss(loss, state)`` and hand the (scaled) gradients to
  ``apply_gradients`` / ``update``. Nothing from this module is needed.
* **Scaler as a TrainState field** (this module, the pattern of Flax's
  ``DynamicScale``): :class:`TrainState` has a ``dynamic_scale`` field, any
  plain Optax optimizer, and :func:`value_and_grad` returns unscaled
  gradients plus a finiteness flag that :meth:`TrainState.apply_gradients`
  uses to skip the step (keeping ``batch_stats`` and any other field passed
  to it as they were).

Coming from ``flax.training.dynamic_scale.DynamicScale``: see the guide
"Coming from Flax's DynamicScale" (the result is read by name, not unpacked,
and Flax's skip block after ``apply_gradients`` is to be deleted). After ``import
jax_lossscale as jls``, this module is ``jls.flax`` (imported on first use).

* **A loop you do not own** (NNX: tunix's ``PeftTrainer`` and ``RLCluster``, any trainer
  that builds its ``nnx.Optimizer`` and calls ``loss_fn(model, batch)``):
  :func:`link_loss_scale` installs the scaling in the model, in place (a
  :class:`LossScaledModel`), and links it to the optimizer; the model's backward pass is
  then scaled by the optimizer's own scale variable. :func:`log_loss_scale` puts the
  scale, the skips and the retries in a tunix trainer's own metrics log.

Needs Flax (``pip install 'jax-lossscale[flax]'``). The implementation lives in
:mod:`jax_lossscale._integrations._flax`.
"""

from jax_lossscale._integrations._flax import ScaledValueAndGrad as ScaledValueAndGrad
from jax_lossscale._integrations._flax import TrainState as TrainState
from jax_lossscale._integrations._flax import value_and_grad as value_and_grad

# A loop you do not own (tunix, any NNX trainer): the scale shared by the model and its optimizer.
from jax_lossscale._integrations._shared_metrics import LossScaleHooks as LossScaleHooks
from jax_lossscale._integrations._shared_metrics import log_loss_scale as log_loss_scale
from jax_lossscale._integrations._shared_retry import retry_value_and_grad as retry_value_and_grad
from jax_lossscale._integrations._shared_scale import LossScaledModel as LossScaledModel
from jax_lossscale._integrations._shared_scale import install_loss_scale as install_loss_scale
from jax_lossscale._integrations._shared_scale import link_loss_scale as link_loss_scale

__all__ = (
  "LossScaleHooks",
  "LossScaledModel",
  "ScaledValueAndGrad",
  "TrainState",
  "install_loss_scale",
  "link_loss_scale",
  "log_loss_scale",
  "retry_value_and_grad",
  "value_and_grad",
)
