"""``metrics`` and ``nonfinite_leaves``: jit-safe values for loggers, no host sync."""

import time

from helpers import calibrated_iterations
from helpers import slow_batch
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
    "scale": jnp.float32,
    "growth_tracker": jnp.int32,
    "last_step_skipped": jnp.bool_,
    "skipped_steps": jnp.int32,
    "consecutive_skips": jnp.int32,
  }
  assert all(v.shape == () for v in m.values())
  assert jls.metrics(jls.DynamicScaleState.create())["scale"].item() == 2.0**16
  with pytest.raises(ValueError, match="No DynamicScaleState"):
    jls.metrics(optax.sgd(0.1).init({"w": jnp.zeros(2)}))


def test_metrics_and_report_do_not_wait_for_the_device():
  """Reading metrics (jitted and eager) and the per-leaf report never syncs.

  The gradients come out of :func:`conftest.slow_batch`, so the step, the
  metrics and the report all depend on a ~1 s device computation: had any of
  them waited for a device value, the calls could only return after it.
  """
  tx = jls.dynamic_loss_scale(optax.sgd(0.1))
  state = tx.init({"w": jnp.zeros(2, jnp.float32)})

  @jax.jit
  def step(state, g):
    grads_report = jls.diagnostics.nonfinite_leaves(g)
    _, state = tx.update(g, state)
    return state, jls.metrics(state), grads_report

  g = jnp.asarray([1.0, jnp.nan], jnp.float32)
  step(state, {"w": g})  # compile first, and warm the eager paths
  jls.metrics(state), jls.diagnostics.nonfinite_leaves({"w": g})
  n = calibrated_iterations(g)

  t0 = time.perf_counter()
  slow = slow_batch(g, n)
  new_state, m, report = step(state, {"w": slow})
  m2 = jls.metrics(new_state)  # eager, on device values
  report2 = jls.diagnostics.nonfinite_leaves({"w": slow})
  returned_s = time.perf_counter() - t0
  still_running = not slow.is_ready() and not m2["scale"].is_ready()
  jax.block_until_ready((m, m2, report, report2))
  total_s = time.perf_counter() - t0
  assert still_running, (returned_s, total_s)
  assert returned_s < total_s / 2, (returned_s, total_s)
  assert bool(m["last_step_skipped"]) and bool(m2["last_step_skipped"])
  assert m2["scale"].item() == 2.0**15 and int(m2["skipped_steps"]) == 1
  assert bool(report["w"]) and bool(report2["w"])


def test_nonfinite_leaves_reports_each_leaf(maybe_jit):
  grads = {
    "dense": {
      "kernel": jnp.asarray([[1.0, jnp.inf]], jnp.float32),
      "bias": jnp.zeros(2, jnp.float16),
    },
    "out": jnp.asarray([jnp.nan], jnp.bfloat16),
    "count": jnp.asarray(3, jnp.int32),
  }
  report = maybe_jit(jls.diagnostics.nonfinite_leaves)(grads)
  assert jax.tree_util.tree_structure(report) == jax.tree_util.tree_structure(grads)
  flat = {jax.tree_util.keystr(p): bool(v) for p, v in jax.tree_util.tree_leaves_with_path(report)}
  assert flat == {
    "['count']": False,
    "['dense']['bias']": False,
    "['dense']['kernel']": True,
    "['out']": True,
  }
  assert all(v.dtype == jnp.bool_ and v.shape == () for v in jax.tree_util.tree_leaves(report))
  assert jls.diagnostics.nonfinite_leaves({"a": None, "b": jnp.ones(1, jnp.float32)})["a"] is None


def test_metrics_of_flax_trainstate_field():
  from jax_lossscale.flax import TrainState

  state = TrainState.create(
    apply_fn=None, params={"w": jnp.ones(2, jnp.float32)}, tx=optax.sgd(0.1)
  )
  new = state.apply_gradients(grads={"w": jnp.asarray([np.inf, 0.0], jnp.float32)})
  m = jls.metrics(new)
  assert bool(m["last_step_skipped"]) and m["scale"].item() == 2.0**15
