"""``metrics`` and ``nonfinite_leaves``: jit-safe values for loggers, no host sync."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_lossscale as jls

KEYS = ["scale", "growth_tracker", "last_step_skipped", "skipped_steps", "consecutive_skips"]


def _run(pattern, maybe_jit, wrap=lambda tx: tx):
  tx = wrap(jls.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0, growth_interval=2))
  state = tx.init({"w": jnp.zeros(2, jnp.float32)})
  update = maybe_jit(tx.update)
  read = maybe_jit(jls.metrics)
  seen = []
  for ok in pattern:
    g = {"w": jnp.asarray([1.0, 1.0 if ok else jnp.inf], jnp.float32)}
    _, state = update(g, state)
    seen.append({k: v.item() for k, v in read(state).items()})
  return state, seen


def test_metrics_values_follow_the_rule(maybe_jit):
  _, seen = _run([True, False, False, True, True, True], maybe_jit)
  # Reference: update_scale step by step.
  s = jls.DynamicScaleState.create(init_scale=8.0, growth_interval=2)
  for ok, m in zip([True, False, False, True, True, True], seen):
    s = jls.update_scale(s, ok)
    assert sorted(m) == sorted(KEYS)
    assert m["scale"] == float(s.scale) and m["growth_tracker"] == int(s.growth_tracker)
    assert m["skipped_steps"] == int(s.skipped_steps)
    assert m["consecutive_skips"] == int(s.consecutive_skips)
    assert m["last_step_skipped"] is (not ok)
  assert [m["consecutive_skips"] for m in seen] == [0, 1, 2, 0, 0, 0]
  assert [m["scale"] for m in seen] == [8.0, 4.0, 2.0, 2.0, 4.0, 4.0]


def test_metrics_dtypes_and_nested_states():
  state, _ = _run([True, False], jax.jit, wrap=lambda tx: optax.chain(optax.identity(), tx))
  m = jls.metrics(state)
  assert {k: v.dtype for k, v in m.items()} == {
      "scale": jnp.float32, "growth_tracker": jnp.int32, "last_step_skipped": jnp.bool_,
      "skipped_steps": jnp.int32, "consecutive_skips": jnp.int32,
  }
  assert all(v.shape == () for v in m.values())
  assert jls.metrics(jls.DynamicScaleState.create())["scale"].item() == 2.0**16
  with pytest.raises(ValueError, match="No DynamicScaleState"):
    jls.metrics(optax.sgd(0.1).init({"w": jnp.zeros(2)}))


def test_metrics_inside_jit_without_host_transfer():
  tx = jls.dynamic_loss_scale(optax.sgd(0.1))
  state = tx.init({"w": jnp.zeros(2, jnp.float32)})

  @jax.jit
  def step(state, g):
    grads_report = jls.nonfinite_leaves(g)
    _, state = tx.update(g, state)
    return state, jls.metrics(state), grads_report

  g = {"w": jnp.asarray([1.0, jnp.nan], jnp.float32)}
  step(state, g)  # compile first
  with jax.transfer_guard_device_to_host("disallow"):
    state, m, report = step(state, g)
    m2 = jls.metrics(state)  # eager: no device-to-host copy either
  assert bool(m["last_step_skipped"]) and bool(m2["last_step_skipped"])
  assert bool(report["w"])


def test_nonfinite_leaves_reports_each_leaf(maybe_jit):
  grads = {
      "dense": {"kernel": jnp.asarray([[1.0, jnp.inf]], jnp.float32), "bias": jnp.zeros(2, jnp.float16)},
      "out": jnp.asarray([jnp.nan], jnp.bfloat16),
      "count": jnp.asarray(3, jnp.int32),
  }
  report = maybe_jit(jls.nonfinite_leaves)(grads)
  assert jax.tree_util.tree_structure(report) == jax.tree_util.tree_structure(grads)
  flat = {jax.tree_util.keystr(p): bool(v) for p, v in jax.tree_util.tree_leaves_with_path(report)}
  assert flat == {
      "['count']": False, "['dense']['bias']": False, "['dense']['kernel']": True, "['out']": True,
  }
  assert all(v.dtype == jnp.bool_ and v.shape == () for v in jax.tree_util.tree_leaves(report))
  assert jls.nonfinite_leaves({"a": None, "b": jnp.ones(1, jnp.float32)})["a"] is None


def test_metrics_of_flax_trainstate_field():
  from jax_lossscale.flax import TrainState

  state = TrainState.create(apply_fn=None, params={"w": jnp.ones(2, jnp.float32)},
                            tx=optax.sgd(0.1))
  new = state.apply_gradients(grads={"w": jnp.asarray([np.inf, 0.0], jnp.float32)})
  m = jls.metrics(new)
  assert bool(m["last_step_skipped"]) and m["scale"].item() == 2.0**15
