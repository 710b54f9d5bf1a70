"""tunix itself, where ``google-tunix`` is installed (it is not a test dependency): what the
loop-you-do-not-own guide tells a tunix user to write, run on tunix's unedited trainers.

* ``jls.flax.log_loss_scale`` on tunix's ``PeftTrainer``: after a forced overflow, the
  logged scale and skip count are the scaler's after each step.
* tunix's ``gradient_accumulation_steps`` (a stock ``optax.MultiSteps``) is refused with an
  error naming ``jls.multi_steps``.
* tunix's ``GRPOLearner`` with the guide's retried train step: the overflowing update is
  recomputed at a lower scale and applied, where tunix's own step skips it.
* tunix's ``DPOTrainer`` builds its attention mask with the linked model's
  ``get_attention_mask``.
* ``benchmarks/tunix_settings.py`` (the measurement behind the guide's settings) runs.
"""

from flax import nnx
from helpers import ROOT
from helpers import python_blocks
from helpers import standard_promotion
import jax
import jax.numpy as jnp
from loop_you_do_not_own import T
from loop_you_do_not_own import TinyLM
from loop_you_do_not_own import batches
from loop_you_do_not_own import no_device_reads
from loop_you_do_not_own import tunix_toy_grpo
import numpy as np
import optax
import pytest

import jax_lossscale as jls
from jax_lossscale.flax import link_loss_scale
from jax_lossscale.flax import log_loss_scale

pytest.importorskip("tunix", reason="google-tunix is not installed")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # tunix 0.1.7 on JAX 0.10


def _guide_block(marker):
  page = ROOT / "docs" / "guides" / "loop-you-do-not-own.md"
  (code,) = [code for _, code in python_blocks(page.read_text()) if marker in code]
  return code


def test_logged_scale_and_skips_after_a_forced_overflow():
  """2**30 overflows float16 at once: skipped steps, then applied ones; tunix's metrics log
  holds, at each step's number, the scaler's scale and skip count after that step, and the
  copy taken before each step reads nothing from the device."""
  from tunix.sft import peft_trainer

  config = peft_trainer.TrainingConfig(eval_every_n_steps=1000, max_steps=14)
  tx = jls.dynamic_loss_scale(optax.adam(3e-3), init_scale=2.0**30, growth_interval=3)
  trainer = peft_trainer.PeftTrainer(TinyLM(nnx.Rngs(0)), tx, config)
  link_loss_scale(trainer.model, trainer.optimizer, output_dtype=jnp.float32)
  hooks = log_loss_scale(trainer)
  copy = hooks._copy  # called before each step: it must not read from the device

  def guarded(t):
    with no_device_reads():
      copy(t)

  hooks._copy = guarded
  trainer.with_gen_model_input_fn(lambda x: x)
  after = []

  def recorded():
    for b in batches(14):
      yield b
      s = jls.get_scale_state(trainer.optimizer.opt_state)
      after.append((float(s.scale[...]), int(s.skipped_steps[...])))

  with standard_promotion():  # tunix's code and optax.adam are not strict-clean
    trainer.train(recorded())
  logged = lambda name: trainer.metrics_logger.get_metric_history("", name, "train")
  np.testing.assert_array_equal(logged("loss_scale"), [s for s, _ in after])
  np.testing.assert_array_equal(logged("skipped_steps"), [k for _, k in after])
  np.testing.assert_array_equal(logged("retries"), np.zeros(14))
  assert 0 < logged("skipped_steps")[-1] < 14 and len(logged("loss")) == 14
  m = jls.metrics(nnx.as_pure(trainer.optimizer.opt_state))
  assert logged("loss_scale")[-1] == float(m["scale"])
  assert logged("skipped_steps")[-1] == int(m["skipped_steps"])


def test_gradient_accumulation_steps_is_refused():
  """tunix wraps the optimizer in a stock ``optax.MultiSteps``, which keeps the NaN of an
  overflowing micro-batch: the link raises and names the replacement."""
  from tunix.sft import peft_trainer

  config = peft_trainer.TrainingConfig(
    eval_every_n_steps=1000, max_steps=4, gradient_accumulation_steps=2
  )
  model = TinyLM(nnx.Rngs(0))
  trainer = peft_trainer.PeftTrainer(model, jls.dynamic_loss_scale(optax.sgd(0.1)), config)
  with pytest.raises(ValueError, match=r"gradient_accumulation_steps.*jls\.multi_steps\("):
    link_loss_scale(trainer.model, trainer.optimizer)
  assert type(model) is TinyLM  # left as it was
  # The replacement: jls.multi_steps as the optimizer, tunix's accumulation unset.
  config = peft_trainer.TrainingConfig(eval_every_n_steps=1000, max_steps=4)
  tx = jls.multi_steps(jls.dynamic_loss_scale(optax.sgd(0.1)), 2)
  trainer = peft_trainer.PeftTrainer(model, tx, config)
  link_loss_scale(trainer.model, trainer.optimizer)
  trainer.with_gen_model_input_fn(lambda x: x)
  with standard_promotion():
    trainer.train(batches(4))
  assert int(jls.get_scale_state(trainer.optimizer.opt_state).skipped_steps[...]) == 0


def _grpo_run(retried):
  """4 GRPO steps of tunix's learner on its toy float32 transformer at scale 2**127: the
  third update's gradients overflow float32 once scaled. ``retried``: the guide's block
  gives the actor's trainer the retried step."""
  # tunix's code is not strict-clean, and runs in its own threads: the global setting.
  promotion = jax.config.jax_numpy_dtype_promotion
  jax.config.update("jax_numpy_dtype_promotion", "standard")
  try:
    rl_cluster, learner, data = tunix_toy_grpo(2.0**127)
    trainer = rl_cluster.actor_trainer
    link_loss_scale(trainer.model, trainer.optimizer, output_dtype=jnp.float32)
    if retried:
      exec(
        _guide_block("retried_train_step_fn"),
        {"rl_cluster": rl_cluster, "jls": jls, "optax": optax},
      )
    else:
      log_loss_scale(trainer)
    learner.train(data)
  finally:
    jax.config.update("jax_numpy_dtype_promotion", promotion)
  logged = lambda name: trainer.metrics_logger.get_metric_history("actor", name, "train")
  state = jls.get_scale_state(trainer.optimizer.opt_state)
  return logged, state, trainer


def test_grpo_update_retried_instead_of_skipped():
  """The same overflowing GRPO update (the third): tunix's own step skips it, so the rollout is
  lost; the guide's step recomputes it at half the scale and applies it. Both logged by
  ``log_loss_scale`` under the actor's prefix, next to GRPO's own metrics."""
  skip_log, skip_state, _ = _grpo_run(retried=False)
  retry_log, retry_state, trainer = _grpo_run(retried=True)
  scales = [2.0**127, 2.0**127, 2.0**126, 2.0**126]
  for log, state in ((skip_log, skip_state), (retry_log, retry_state)):
    assert len(log("loss")) == len(log("kl")) == 4  # GRPO's own metrics, as before
    np.testing.assert_array_equal(log("loss_scale"), np.float32(scales))
    np.testing.assert_array_equal(log("skipped_steps"), [0, 0, 1, 1])
    assert float(state.scale[...]) == 2.0**126 and int(state.consecutive_skips[...]) == 0
  np.testing.assert_array_equal(skip_log("retries"), [0, 0, 0, 0])  # skipped
  np.testing.assert_array_equal(retry_log("retries"), [0, 0, 1, 0])  # retried once, applied
  # The first three losses are those of the same params; the fourth follows an update that
  # only the retried run applied.
  np.testing.assert_array_equal(skip_log("loss")[:3], retry_log("loss")[:3])
  assert skip_log("loss")[3] != retry_log("loss")[3]
  assert int(trainer.optimizer.step[...]) == 4


class _CountingLM(TinyLM):
  """TinyLM that counts the calls of its ``get_attention_mask``."""

  mask_calls = 0

  def get_attention_mask(self, tokens, inputs_mask):
    _CountingLM.mask_calls += 1  # on this class (the linked model's is a subclass)
    return super().get_attention_mask(tokens, inputs_mask)


def test_dpo_uses_the_linked_models_attention_mask():
  """tunix's ``DPOTrainer`` picks the mask with ``hasattr(model, "get_attention_mask")``: after
  the link the model still has it, and DPO calls it for every batch."""
  from tunix.sft.dpo import dpo_trainer

  model = _CountingLM(nnx.Rngs(0))
  config = dpo_trainer.DPOTrainingConfig(eval_every_n_steps=1000, max_steps=3)
  trainer = dpo_trainer.DPOTrainer(model, None, jls.dynamic_loss_scale(optax.sgd(0.1)), config)
  link_loss_scale(trainer.model, trainer.optimizer, output_dtype=jnp.float32)
  assert (
    hasattr(trainer.model, "get_attention_mask") and type(trainer.model).__name__ == "_CountingLM"
  )
  half = T // 2
  ones = np.ones((4, half), np.int32)

  def example(b):
    tokens = np.asarray(b["input_tokens"][:4])
    prompt_mask = ones.copy()
    prompt_mask[:, :2] = 0  # left padding
    return dpo_trainer.TrainingInput(
      prompt_ids=tokens[:, :half] * prompt_mask,
      prompt_mask=prompt_mask,
      chosen_ids=tokens[:, half:],
      chosen_mask=ones,
      rejected_ids=(tokens[:, half:] + 1) % 32,
      rejected_mask=ones,
    )

  before = jax.tree_util.tree_leaves(nnx.to_pure_dict(nnx.state(trainer.model, nnx.Param)))
  before = [np.asarray(x).copy() for x in before]
  _CountingLM.mask_calls = 0
  with standard_promotion():
    trainer.train([example(b) for b in batches(3)])
  assert _CountingLM.mask_calls == 3  # once per batch, in DPOTrainer._prepare_inputs
  state = jls.get_scale_state(trainer.optimizer.opt_state)
  assert int(state.skipped_steps[...]) == 0 and int(trainer.optimizer.step[...]) == 3
  after = jax.tree_util.tree_leaves(nnx.to_pure_dict(nnx.state(trainer.model, nnx.Param)))
  assert any(not np.array_equal(a, b) for a, b in zip(after, before))


def test_settings_benchmark_runs_and_renders(tmp_path):
  """``benchmarks/tunix_settings.py``, which measured the guide's settings, on 2 steps."""
  import sys

  sys.path.insert(0, str(ROOT / "benchmarks"))
  try:
    import tunix_settings
  finally:
    sys.path.remove(str(ROOT / "benchmarks"))
  out = tmp_path / "tunix-settings.md"
  promotion = jax.config.jax_numpy_dtype_promotion
  try:
    tunix_settings.main(["--steps", "2", "--seeds", "0", "--out", str(out)])
  finally:
    jax.config.update("jax_numpy_dtype_promotion", promotion)
  rows = [line for line in out.read_text().splitlines() if line.startswith("| 2**")]
  assert len(rows) == len(tunix_settings.SETTINGS) and "torch's defaults" in rows[1]
