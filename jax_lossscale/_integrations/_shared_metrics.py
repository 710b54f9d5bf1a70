"""The loss scaler's state in a trainer's own metrics log, read as the trainer reads its loss.

tunix's ``PeftTrainer`` (and the RL actor trainer built on it) logs each step's loss and
``grad_norm`` one step late: it dispatches step ``k + 1``, then converts step ``k``'s
device values and writes them to its ``metrics_logger``, so the host never waits for the
step in flight. :func:`log_loss_scale` puts the scaler's values in the same log at the same
moment, through the trainer's public hooks (``with_training_hooks``): before each step it
copies the scaler's state on the device (a small dispatched program, no wait; the copy
outlives the step's donation of the optimizer's buffers), and when the trainer has written
step ``k``'s loss, it writes step ``k``'s copies next to it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_lossscale._scaler._state import get_scale_state

#: The names :func:`log_loss_scale` logs under, in the trainer's metrics prefix and ``train`` mode.
LOGGED = ("loss_scale", "skipped_steps", "retries")

_NEEDS = ("optimizer", "metrics_logger", "metrics_prefix", "train_steps", "with_training_hooks")


@jax.jit
def _snapshot(scale, skipped, consecutive, skipped_before):
  """Copies of the scale and the skip count, and this step's retries (fresh buffers)."""
  skipped = jnp.asarray(skipped, jnp.int32)
  # An applied step that counted r skips was retried r times (retry_value_and_grad); a
  # skipped step counts one skip more than its retries.
  retries = skipped - skipped_before - (consecutive > 0).astype(jnp.int32)
  return {
    "loss_scale": jnp.copy(jnp.asarray(scale, jnp.float32)),
    "skipped_steps": jnp.copy(skipped),
    "retries": jnp.maximum(retries, 0),
  }


class LossScaleHooks:
  """tunix ``TrainingHooks`` that log the loss scaler's state with the trainer's loss.

  Built and installed by :func:`log_loss_scale`; calls the hooks it replaced (``inner``)
  first, so a trainer's own hooks keep running.

  Attributes:
    inner: the trainer's hooks before :func:`log_loss_scale`, or ``None``.
  """

  def __init__(self, inner: Any = None):
    self.inner = inner
    self._step: int | None = None  # the train step of the last copy
    self._skipped: jax.Array | None = None  # its skip count (device)
    self._pending: list[tuple[int, dict[str, jax.Array]]] = []

  def _copy(self, trainer: Any) -> None:
    """Copies the scaler's state after ``trainer.train_steps`` steps (dispatch, no wait)."""
    step = trainer.train_steps
    if self._step == step:
      return
    s = get_scale_state(trainer.optimizer.opt_state)
    before = self._skipped if self._skipped is not None else s.skipped_steps[...]
    values = _snapshot(s.scale[...], s.skipped_steps[...], s.consecutive_skips[...], before)
    if self._step is not None and step > self._step:  # a step ran since the last copy
      self._pending.append((step, values))
    self._step, self._skipped = step, values["skipped_steps"]

  def _write(self, trainer: Any, through: int | None) -> None:
    """Writes the copies of the steps up to ``through`` (all if ``None``) to the log."""
    while self._pending and (through is None or self._pending[0][0] <= through):
      step, values = self._pending.pop(0)
      for name, v in values.items():
        trainer.metrics_logger.log(trainer.metrics_prefix, name, np.asarray(v), "train", step)

  def on_train_start(self, train_ctx: Any) -> None:
    if self.inner is not None:
      self.inner.on_train_start(train_ctx)
    self._copy(train_ctx)  # the state the run starts from: nothing to log

  def on_train_step_start(self, train_ctx: Any) -> None:
    if self.inner is not None:
      self.inner.on_train_step_start(train_ctx)
    self._copy(train_ctx)  # after the previous step, before this one donates it

  def on_train_step_end(self, train_ctx: Any, train_step: int, train_loss: Any) -> None:
    if self.inner is not None:
      self.inner.on_train_step_end(train_ctx, train_step, train_loss)
    self._write(train_ctx, train_step)  # the trainer has just written this step's loss

  def on_train_end(self, train_ctx: Any) -> None:
    if self.inner is not None:
      self.inner.on_train_end(train_ctx)
    self._copy(train_ctx)  # after the last step; the trainer has waited for every step
    self._write(train_ctx, None)

  def on_eval_step_start(self, train_ctx: Any) -> None:
    if self.inner is not None:
      self.inner.on_eval_step_start(train_ctx)

  def on_eval_step_end(self, train_ctx: Any, eval_loss: Any) -> None:
    if self.inner is not None:
      self.inner.on_eval_step_end(train_ctx, eval_loss)


def log_loss_scale(trainer: Any) -> LossScaleHooks:
  """Logs the loss scale, the skip count and the retries in a tunix trainer's own metrics.

  For tunix's ``PeftTrainer`` and the trainers built on it (``rl_cluster.actor_trainer``):
  after each step the trainer's ``metrics_logger`` gets, under the trainer's
  ``metrics_prefix`` in ``train`` mode and at the step number of its ``loss``:

  * ``loss_scale``: the scale after the step (float32);
  * ``skipped_steps``: the skip count after the step (the scaler's ``skipped_steps``);
  * ``retries``: how many times the step's gradients were recomputed at a lower scale
    (:func:`retry_value_and_grad`; 0 for a step that does not retry).

  No host sync per step: the values are copied on the device before each step and
  converted when the trainer converts its own loss for that step (one step late, after the
  next step is dispatched), and the last step's at the end of ``train``, after the trainer
  has waited for all of them. Installed through the trainer's
  ``with_training_hooks``; hooks set before are kept and called first. Call it once, after
  building the trainer (``link_loss_scale`` first or after: either order).

  Args:
    trainer: a tunix ``PeftTrainer`` (or subclass) whose optimizer holds a loss scaler
      (:func:`jax_lossscale.dynamic_loss_scale`, possibly inside
      :func:`jax_lossscale.multi_steps`).

  Returns:
    The installed :class:`LossScaleHooks`.

  Raises:
    TypeError: ``trainer`` lacks what a tunix trainer has (``optimizer``,
      ``metrics_logger``, ``metrics_prefix``, ``train_steps``, ``with_training_hooks``).
    ValueError: ``trainer.optimizer`` holds no loss scaler, or several; ``trainer``
      already logs its loss scale.
  """
  missing = [name for name in _NEEDS if not hasattr(trainer, name)]
  if missing:
    raise TypeError(
      f"trainer must be a tunix PeftTrainer (or one built on it); a {type(trainer).__name__} "
      f"has no {', '.join(missing)}."
    )
  get_scale_state(trainer.optimizer.opt_state)  # raises ValueError unless exactly one scaler
  inner = getattr(trainer, "training_hooks", None)
  if isinstance(inner, LossScaleHooks):
    raise ValueError("trainer already logs its loss scale (log_loss_scale was called before).")
  hooks = LossScaleHooks(inner)
  trainer.with_training_hooks(hooks)
  return hooks
