"""The loss scaler's state in a loop's own metrics log: ``jls.flax.log_loss_scale``.

On ``StandInTrainer.train`` (tunix 0.1.7's ``PeftTrainer`` loop: its hooks, its one-step-late
metrics writes, its logger; see ``loop_you_do_not_own.py``), always run; the tunix tests in
``test_loop_you_do_not_own.py`` run the same on tunix itself when it is installed. Checked:
the logged scale, skip count and retries are the scaler's after each step, at the step
number of the trainer's loss; nothing is read from the device before a step (the stand-in
runs the hooks' step start under ``no_device_reads``); the copy compiles once.
"""

from flax import nnx
from helpers import standard_promotion
import jax
import jax.numpy as jnp
from loop_you_do_not_own import StandInTrainer
from loop_you_do_not_own import TinyLM
from loop_you_do_not_own import batches
from loop_you_do_not_own import no_device_reads
import numpy as np
import optax
import pytest

import jax_lossscale as jls
from jax_lossscale._integrations import _shared_metrics
from jax_lossscale.flax import link_loss_scale
from jax_lossscale.flax import log_loss_scale


def _recorded(trainer, data, after):
  """``data``, recording the scaler's (scale, skip count) after each step into ``after``."""
  for b in data:
    yield b
    s = jls.get_scale_state(trainer.optimizer.opt_state)
    after.append((float(s.scale[...]), int(s.skipped_steps[...])))


def _history(trainer, name):
  return trainer.metrics_logger.get_metric_history("", name, "train")


def _steps(trainer, name):
  return [step for step, _ in trainer.metrics_logger.logged[("", "train", name)]]


def test_logged_values_are_the_scalers_after_each_step():
  """A scale far too high for float16: skipped steps, then applied ones; each step's logged
  scale and skip count are the scaler's after that step, logged at the loss's step."""
  tx = jls.dynamic_loss_scale(optax.adam(3e-3), init_scale=2.0**30, growth_interval=3)
  trainer = StandInTrainer(TinyLM(nnx.Rngs(0)), tx)
  link_loss_scale(trainer.model, trainer.optimizer, output_dtype=jnp.float32)
  hooks = log_loss_scale(trainer)
  _shared_metrics._snapshot.clear_cache()  # counted below: one compilation for the whole run
  after = []
  with standard_promotion():  # optax.adam is not strict-clean
    trainer.train(_recorded(trainer, batches(16), after))
  scales, skips = _history(trainer, "loss_scale"), _history(trainer, "skipped_steps")
  np.testing.assert_array_equal(scales, [s for s, _ in after])
  np.testing.assert_array_equal(skips, [k for _, k in after])
  assert scales.dtype == np.float32 and skips.dtype == np.int32
  assert 0 < skips[-1] < 16 and scales[0] == 2.0**29  # skipped steps, and applied ones
  np.testing.assert_array_equal(_history(trainer, "retries"), np.zeros(16, np.int32))
  assert _steps(trainer, "loss_scale") == _steps(trainer, "loss") == list(range(1, 17))
  # A second call of train goes on from where the first stopped.
  with standard_promotion():
    trainer.train(_recorded(trainer, batches(2, seed=1), after))
  np.testing.assert_array_equal(_history(trainer, "skipped_steps"), [k for _, k in after])
  assert _steps(trainer, "loss_scale") == list(range(1, 19))
  assert hooks._pending == [] and _shared_metrics._snapshot._cache_size() == 1


class RetryingTrainer(StandInTrainer):
  """Its train step retries an overflowing batch (``retry_value_and_grad``)."""

  def create_train_step_fn(self):
    grad_fn = jls.flax.retry_value_and_grad(self.loss_fn, max_retries=8)

    def step(model, optimizer, inputs):
      out = grad_fn(model, optimizer, **inputs)
      optimizer.update(model, out.grads)
      return out.value, None, optax.tree.norm(out.grads)

    return step


def test_retries_are_logged():
  """2**24 overflows float16's backward pass: the first step is retried at lower scales and
  applied; the log says how many times each step was, and no step is skipped."""
  tx = jls.dynamic_loss_scale(optax.sgd(0.1), init_scale=2.0**24)
  trainer = RetryingTrainer(TinyLM(nnx.Rngs(0)), tx)
  link_loss_scale(trainer.model, trainer.optimizer)
  log_loss_scale(trainer)
  after = []
  trainer.train(_recorded(trainer, batches(4), after))
  retries = _history(trainer, "retries")
  r = int(retries[0])
  assert r > 0
  # Every skip counted was a retry of a step then applied: the skip count is their sum.
  np.testing.assert_array_equal(_history(trainer, "skipped_steps"), np.cumsum(retries))
  np.testing.assert_array_equal(_history(trainer, "loss_scale"), [s for s, _ in after])
  assert after[0][0] == 2.0**24 / 2**r
  state = jls.get_scale_state(trainer.optimizer.opt_state)
  assert int(state.consecutive_skips[...]) == 0


def test_each_steps_values_are_written_right_after_its_loss():
  """Step k's values follow the trainer's write of step k's loss, one step late as the loss
  is; the last step's are written at ``on_train_end``, just before the trainer closes with
  its last loss."""
  trainer = StandInTrainer(TinyLM(nnx.Rngs(0)), jls.dynamic_loss_scale(optax.sgd(0.1)))
  link_loss_scale(trainer.model, trainer.optimizer)
  log_loss_scale(trainer)
  trainer.train(batches(3))
  order = trainer.metrics_logger.order
  assert sorted(order) == sorted(
    [("loss", k) for k in (1, 2, 3)]
    + [(name, k) for name in _shared_metrics.LOGGED for k in (1, 2, 3)]
  )
  ours = ("scaler", "scaler", "scaler")
  assert [name if name == "loss" else "scaler" for name, _ in order] == [
    "loss",
    *ours,
    "loss",
    *ours,
    *ours,
    "loss",
  ]
  assert [step for _, step in order] == [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]


def test_one_copy_of_the_state_per_step(monkeypatch):
  """The scaler's state is copied once before the first step and once after each step: a
  hook called again at the same step (``on_train_start``, then ``on_train_step_start``)
  dispatches no second copy."""
  copies = []

  def counted(*args):
    copies.append(len(copies))
    return snapshot(*args)

  snapshot = _shared_metrics._snapshot
  monkeypatch.setattr(_shared_metrics, "_snapshot", counted)
  trainer = StandInTrainer(TinyLM(nnx.Rngs(0)), jls.dynamic_loss_scale(optax.sgd(0.1)))
  link_loss_scale(trainer.model, trainer.optimizer)
  log_loss_scale(trainer)
  trainer.train(batches(3))
  assert len(copies) == 4
  assert _steps(trainer, "loss_scale") == [1, 2, 3]


def test_accumulation_steps_after_a_skip_log_no_retries():
  """``multi_steps``: a skipped update leaves ``consecutive_skips`` at 1 through the next
  micro-batches, whose skip count does not move. They were not retried: 0 is logged, never
  -1."""
  tx = jls.multi_steps(jls.dynamic_loss_scale(optax.sgd(0.1), init_scale=2.0**30), 2)
  trainer = StandInTrainer(TinyLM(nnx.Rngs(0)), tx)
  link_loss_scale(trainer.model, trainer.optimizer)
  log_loss_scale(trainer)
  after = []
  with standard_promotion():  # optax.MultiSteps mixes int32 and floats
    trainer.train(_recorded(trainer, batches(4), after))
  skips = _history(trainer, "skipped_steps")
  np.testing.assert_array_equal(skips, [k for _, k in after])
  assert list(skips) == [0, 1, 1, 2]  # 2**30 overflows: both updates skipped
  state = jls.get_scale_state(trainer.optimizer.opt_state)
  assert int(state.consecutive_skips[...]) == 2
  np.testing.assert_array_equal(_history(trainer, "retries"), np.zeros(4, np.int32))


class _Hooks:
  def __init__(self):
    self.calls = []

  def __getattr__(self, name):
    return lambda *args: self.calls.append(name)


def test_the_trainers_own_hooks_keep_running():
  trainer = StandInTrainer(TinyLM(nnx.Rngs(0)), jls.dynamic_loss_scale(optax.sgd(0.1)))
  link_loss_scale(trainer.model, trainer.optimizer)
  mine = _Hooks()
  trainer.with_training_hooks(mine)
  hooks = log_loss_scale(trainer)
  assert trainer.training_hooks is hooks and hooks.inner is mine
  trainer.train(batches(2))
  assert mine.calls == [
    "on_train_start",
    "on_train_step_start",
    "on_train_step_start",
    "on_train_step_end",
    "on_train_end",
    "on_train_step_end",
  ]
  assert list(_history(trainer, "skipped_steps")) == [0, 0]
  # Evaluation: the trainer's own hooks are called; ours log nothing there.
  hooks.on_eval_step_start(trainer)
  hooks.on_eval_step_end(trainer, np.float32(1.0))
  assert mine.calls[-2:] == ["on_eval_step_start", "on_eval_step_end"]


def test_no_hooks_of_the_trainers_own():
  """Without hooks set before, every hook runs alone, evaluation's included."""
  trainer = StandInTrainer(TinyLM(nnx.Rngs(0)), jls.dynamic_loss_scale(optax.sgd(0.1)))
  link_loss_scale(trainer.model, trainer.optimizer)
  hooks = log_loss_scale(trainer)
  assert hooks.inner is None
  trainer.train(batches(2))
  hooks.on_eval_step_start(trainer)
  hooks.on_eval_step_end(trainer, np.float32(1.0))
  assert _steps(trainer, "skipped_steps") == [1, 2]


def test_no_device_reads_catches_a_host_read():
  """The check the stand-in's loop relies on."""
  x = jnp.ones(()) + 1
  for read in (float, int, lambda a: a.item(), jax.device_get, jax.block_until_ready):
    with no_device_reads(), pytest.raises(AssertionError, match="read on the host"):
      read(x)
  assert float(x) == 2.0


def test_errors():
  with pytest.raises(TypeError, match=r"tunix PeftTrainer.*has no optimizer"):
    log_loss_scale(object())
  plain = StandInTrainer(TinyLM(nnx.Rngs(0)), optax.sgd(0.1))
  with pytest.raises(ValueError, match="No DynamicScaleState"):
    log_loss_scale(plain)
  trainer = StandInTrainer(TinyLM(nnx.Rngs(0)), jls.dynamic_loss_scale(optax.sgd(0.1)))
  log_loss_scale(trainer)
  with pytest.raises(ValueError, match="already logs its loss scale"):
    log_loss_scale(trainer)
