"""``check_skips`` on a batch of states (``vmap``): each limit applies to the worst state."""

import jax
import jax.numpy as jnp
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
