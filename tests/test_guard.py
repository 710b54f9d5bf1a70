"""``check_skips`` (``_guard``), the opt-in host-side limit: the counts, the limits, a batch of states."""

import jax
import jax.numpy as jnp
import optax
import pytest

import jax_lossscale as jls


def test_the_total_limit_applies_to_the_worst_state_not_the_sum():
  batch = jax.tree_util.tree_map(lambda x: jnp.stack([x] * 2), jls.DynamicScaleState.create())
  for flags in ([False, False], [False, True], [False, True]):  # 3 and 1 skipped steps
    batch = jax.vmap(jls.update_scale)(batch, jnp.asarray(flags))
  assert batch.skipped_steps.tolist() == [3, 1]
  assert jls.check_skips(batch, max_skipped_steps=3) == 3  # 3 at worst (4 summed)
  with pytest.raises(jls.LossScaleError, match="3 steps skipped in total"):
    jls.check_skips(batch, max_skipped_steps=2)


def _skipped(n, **kwargs):
  s = jls.DynamicScaleState.create(**kwargs)
  for _ in range(n):
    s = jls.update_scale(s, False)
  return s


def test_check_skips_raises_naming_count_limit_and_scale():
  tx = jls.dynamic_loss_scale(optax.sgd(1.0), init_scale=8.0)
  state = tx.init({"w": jnp.zeros(2, jnp.float32)})
  for _ in range(5):
    _, state = tx.update({"w": jnp.full(2, jnp.nan, jnp.float32)}, state)
  assert jls.check_skips(state, max_consecutive_skips=5) == 5
  with pytest.raises(jls.LossScaleError, match=r"5 consecutive steps skipped \(limit 4\).*0\.25"):
    jls.check_skips(state, max_consecutive_skips=4)
  assert issubclass(jls.LossScaleError, RuntimeError)
  # It does not change the state, and a clean step resets the run.
  _, state = tx.update({"w": jnp.ones(2, jnp.float32)}, state)
  assert jls.check_skips(state, max_consecutive_skips=0) == 0


def test_check_skips_total_limit():
  s = _skipped(3)
  s = jls.update_scale(s, True)
  s = jls.update_scale(s, False)
  assert jls.check_skips(s, max_consecutive_skips=1, max_skipped_steps=4) == 1
  with pytest.raises(jls.LossScaleError, match=r"4 steps skipped in total \(limit 3\)"):
    jls.check_skips(s, max_skipped_steps=3)


def test_check_skips_on_a_batch_of_states():
  batch = jax.tree_util.tree_map(lambda x: jnp.stack([x] * 3), _skipped(0))
  states = jax.vmap(jls.update_scale)(batch, jnp.asarray([True, True, False]))
  states = jax.vmap(jls.update_scale)(states, jnp.asarray([True, False, False]))
  assert states.consecutive_skips.tolist() == [0, 1, 2]
  assert jls.check_skips(states, max_consecutive_skips=2) == 2
  with pytest.raises(jls.LossScaleError, match="2 consecutive"):
    jls.check_skips(states, max_consecutive_skips=1)


def test_check_skips_rejects_traced_state_and_bad_limits():
  s = _skipped(1)
  with pytest.raises(ValueError, match="outside jit"):
    jax.jit(lambda s: jls.check_skips(s, max_consecutive_skips=1))(s)
  with pytest.raises(ValueError, match="max_consecutive_skips"):
    jls.check_skips(s, max_consecutive_skips=-1)
  for bad in (1.5, True, "3"):
    with pytest.raises(TypeError, match="max_consecutive_skips"):
      jls.check_skips(s, max_consecutive_skips=bad)
  with pytest.raises(ValueError, match="No DynamicScaleState"):
    jls.check_skips({"w": jnp.zeros(2)}, max_consecutive_skips=1)
