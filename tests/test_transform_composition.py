"""Optax composition: clipping, schedules, Adam's count, inject_hyperparams, MultiSteps, dtypes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_lossscale as jls

SCALE = 2.0**10  # a power of two: scaling and unscaling are exact


def _bits(tree):
  return [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(tree)]


def _true_grads(i):
  rng = np.random.default_rng(i)
  return {
    "a": jnp.asarray(rng.normal(size=(3,)) * 4.0, jnp.float32),
    "b": jnp.asarray(rng.normal(size=(2, 2)), jnp.float32),
  }


def _scaled(grads, scale=SCALE):
  """Gradients of the loss scaled by ``scale`` (a float or an optimizer state)."""
  if not isinstance(scale, float):
    scale = jls.get_scale_state(scale).scale
  return jax.tree_util.tree_map(lambda g: g * jnp.asarray(scale, g.dtype), grads)


def _poisoned(grads):
  return {**grads, "b": grads["b"].at[0, 1].set(jnp.inf)}


def _close(a, b):
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=1e-6)


PARAMS = {"a": jnp.zeros(3, jnp.float32), "b": jnp.ones((2, 2), jnp.float32)}


def test_clip_by_global_norm_inside_sees_true_magnitudes(maybe_jit):
  inner = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
  tx = jls.dynamic_loss_scale(inner, init_scale=SCALE)
  state, ref_state = tx.init(PARAMS), inner.init(PARAMS)
  update = maybe_jit(tx.update)
  for i in range(3):
    g = _true_grads(i)
    assert float(optax.tree.norm(g)) > 1.0  # clipping is active
    updates, state = update(_scaled(g), state, PARAMS)
    ref, ref_state = inner.update(g, ref_state, PARAMS)
    _close(updates, ref)
    # Clipping the scaled gradients would have given a norm of 1 / SCALE.
    np.testing.assert_allclose(float(optax.tree.norm(updates)), 1.0, rtol=1e-6)


def test_schedule_does_not_advance_on_skipped_steps(maybe_jit):
  schedule = optax.linear_schedule(1.0, 0.0, transition_steps=10)
  inner = optax.sgd(schedule)
  tx = jls.dynamic_loss_scale(inner, init_scale=SCALE)
  state, ref_state = tx.init(PARAMS), inner.init(PARAMS)
  update = maybe_jit(tx.update)
  pattern = [True, False, False, True, False, True]
  for i, ok in enumerate(pattern):
    g = _true_grads(i)
    updates, state = update(_scaled(g if ok else _poisoned(g), state), state, PARAMS)
    if ok:  # the reference only sees the applied steps
      ref, ref_state = inner.update(g, ref_state, PARAMS)
      assert _bits(updates) == _bits(ref)
    else:  # -0.0 everywhere, so p + u == p bit for bit
      assert all(
        np.all(np.asarray(u) == 0.0) and np.all(np.signbit(np.asarray(u)))
        for u in jax.tree_util.tree_leaves(updates)
      )
  count = optax.tree_utils.tree_get(state, "count")
  assert int(count) == sum(pattern) == 3
  assert int(jls.metrics(state)["skipped_steps"]) == 3


def test_adam_count_and_moments_frozen_on_skipped_steps(maybe_jit):
  with jax.numpy_dtype_promotion("standard"):  # optax.adam is not strict-promotion clean
    inner = optax.adam(1e-2)
    tx = jls.dynamic_loss_scale(inner, init_scale=SCALE)
    state, ref_state = tx.init(PARAMS), inner.init(PARAMS)
    update = maybe_jit(tx.update)
    for i, ok in enumerate([True, True, False, True]):
      g = _true_grads(i)
      before = state.inner_state
      updates, state = update(_scaled(g if ok else _poisoned(g), state), state, PARAMS)
      if ok:
        ref, ref_state = inner.update(g, ref_state, PARAMS)
        np.testing.assert_allclose(
          np.concatenate([np.ravel(u) for u in jax.tree_util.tree_leaves(updates)]),
          np.concatenate([np.ravel(u) for u in jax.tree_util.tree_leaves(ref)]),
          rtol=1e-6,
        )
      else:
        assert _bits(state.inner_state) == _bits(before)
  assert int(state.inner_state[0].count) == int(ref_state[0].count) == 3


def test_inject_hyperparams_changes_lr_without_recompiling():
  inner = optax.inject_hyperparams(optax.sgd)(learning_rate=0.5)
  tx = jls.dynamic_loss_scale(inner, init_scale=SCALE)
  state = tx.init(PARAMS)
  update = jax.jit(lambda g, s, p: tx.update(g, s, p))
  g = _true_grads(0)
  updates, state = update(_scaled(g), state, PARAMS)
  np.testing.assert_allclose(updates["a"], -0.5 * g["a"], rtol=1e-6)
  # The optax way of changing a hyperparameter: edit it in the state.
  state.inner_state.hyperparams["learning_rate"] = jnp.asarray(0.125, jnp.float32)
  updates, state = update(_scaled(g), state, PARAMS)
  np.testing.assert_allclose(updates["a"], -0.125 * g["a"], rtol=1e-6)
  updates, state = update(_scaled(_poisoned(g)), state, PARAMS)  # a skip: same program
  assert float(jls.get_scale_state(state).scale) == SCALE / 2
  assert float(state.inner_state.hyperparams["learning_rate"]) == 0.125
  assert update._cache_size() == 1


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16], ids=["f32", "f16"])
def test_multisteps_accumulates_with_constant_scale(dtype):
  k = 3
  tx = optax.MultiSteps(jls.dynamic_loss_scale(optax.sgd(1.0), init_scale=SCALE), k)
  ref_tx = optax.MultiSteps(optax.sgd(1.0), k)
  params = jax.tree_util.tree_map(lambda p: p.astype(dtype), PARAMS)
  with jax.numpy_dtype_promotion("standard"):  # MultiSteps mixes int32 and floats
    state, ref_state = tx.init(params), ref_tx.init(params)
    update, ref_update = jax.jit(tx.update), jax.jit(ref_tx.update)
    scales = []
    for i in range(2 * k):
      g = jax.tree_util.tree_map(lambda x: (x / 8.0).astype(dtype), _true_grads(i))
      updates, state = update(_scaled(g, state), state, params)
      ref, ref_state = ref_update(g, ref_state, params)
      scales.append(float(jls.get_scale_state(state).scale))
      # The accumulated mean of scaled gradients, unscaled once: the reference's mean
      # (bit for bit; micro-steps emit zeros, whose sign may differ).
      if i % k == k - 1:
        assert _bits(updates) == _bits(ref)
      for u, r in zip(jax.tree_util.tree_leaves(updates), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_array_equal(u, r)
      assert all(u.dtype == dtype for u in jax.tree_util.tree_leaves(updates))
      assert any(np.any(np.asarray(u) != 0) for u in jax.tree_util.tree_leaves(updates)) == (
        i % k == k - 1
      )
  assert scales == [SCALE] * (2 * k)  # one constant scale for every micro-batch
  assert int(jls.metrics(state)["growth_tracker"]) == 2  # one per accumulated step


def _run_overflowing_accumulation(tx, k, rounds):
  """Round 0: the second micro-batch overflows; later rounds are clean."""
  state, params, history = tx.init(PARAMS), PARAMS, []
  update = jax.jit(tx.update)
  for r in range(rounds):
    for i in range(k):
      g = _scaled(_true_grads(i), state)
      updates, state = update(_poisoned(g) if (r, i) == (0, 1) else g, state, params)
      params = optax.apply_updates(params, updates)
      history.append((float(jls.get_scale_state(state).scale), _bits(params)))
  return history, jls.metrics(state)


@pytest.mark.parametrize("make", [optax.MultiSteps, jls.multi_steps], ids=["optax", "resetting"])
def test_multisteps_skips_whole_step_if_any_microbatch_overflowed(make):
  k = 3
  tx = make(jls.dynamic_loss_scale(optax.sgd(1.0), init_scale=SCALE), k)
  with jax.numpy_dtype_promotion("standard"):  # MultiSteps mixes int32 and floats
    history, m = _run_overflowing_accumulation(tx, k, rounds=3)
  # Round 0: one constant scale while accumulating, then the whole step is skipped
  # (params bit-identical) and the scale backs off once.
  assert [h[0] for h in history[:k]] == [SCALE, SCALE, SCALE / 2]
  assert all(h[1] == _bits(PARAMS) for h in history[:k])
  if make is optax.MultiSteps:
    # Known optax limitation: (1 - emit) * inf = NaN stays in the accumulator, so
    # every later accumulated step is skipped too. jls.multi_steps resets it.
    assert int(m["skipped_steps"]) == 3 and int(m["consecutive_skips"]) == 3
    return
  # Rounds 1 and 2 are clean and applied.
  assert history[2 * k - 1][1] != _bits(PARAMS)
  assert history[3 * k - 1][1] != history[2 * k - 1][1]
  assert int(m["skipped_steps"]) == 1 and not bool(m["last_step_skipped"])
  assert [h[0] for h in history[k:]] == [SCALE / 2] * (2 * k)


def test_mixed_precision_params(maybe_jit):
  params = {
    "f32": jnp.ones(3, jnp.float32),
    "bf16": jnp.ones(3, jnp.bfloat16),
    "f16": jnp.ones(3, jnp.float16),
  }
  inner = optax.sgd(0.25, momentum=0.5)
  tx = jls.dynamic_loss_scale(inner, init_scale=SCALE)
  state = tx.init(params)
  assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(state.inner_state))
  true = {"f32": [1.0, 2.0, 3.0], "bf16": [0.5, -1.0, 4.0], "f16": [2.0, -0.25, 1.0]}
  grads = {
    k: (jnp.asarray(v, jnp.float32) * SCALE).astype(params[k].dtype) for k, v in true.items()
  }
  update = maybe_jit(tx.update)
  updates, state = update(grads, state, params)
  ref, _ = inner.update(
    {k: jnp.asarray(v, jnp.float32) for k, v in true.items()},
    inner.init(jax.tree_util.tree_map(lambda p: p.astype(jnp.float32), params)),
  )
  for k in params:
    assert updates[k].dtype == params[k].dtype
    np.testing.assert_array_equal(
      np.asarray(updates[k], np.float32), np.asarray(ref[k].astype(params[k].dtype), np.float32)
    )
  new = optax.apply_updates(params, updates)
  assert {k: v.dtype for k, v in new.items()} == {k: v.dtype for k, v in params.items()}
  # An overflow in the float16 leaf skips every leaf, bit for bit.
  bad = {**grads, "f16": grads["f16"].at[0].set(jnp.inf)}
  skipped, state2 = update(bad, state, new)
  assert _bits(optax.apply_updates(new, skipped)) == _bits(new)
  assert _bits(state2.inner_state) == _bits(state.inner_state)


def test_inner_transformation_sees_float32_params(maybe_jit):
  """Weight decay reads the params: it gets them promoted to float32, as it gets
  the gradients (float16 params and float32 gradients would not even mix under
  strict promotion, and 1e-4 * p would be rounded to float16)."""
  params = {"w": jnp.asarray([1.0, -3.0], jnp.float16)}
  inner = optax.chain(optax.add_decayed_weights(1e-4), optax.sgd(1.0))
  tx = jls.dynamic_loss_scale(inner, init_scale=SCALE)
  grads = {"w": jnp.asarray([0.5 * SCALE, 0.25 * SCALE], jnp.float16)}
  updates, _ = maybe_jit(tx.update)(grads, tx.init(params), params)
  p32 = {"w": params["w"].astype(jnp.float32)}
  ref, _ = inner.update({"w": jnp.asarray([0.5, 0.25], jnp.float32)}, inner.init(p32), p32)
  assert updates["w"].dtype == jnp.float16
  assert _bits(updates) == _bits({"w": ref["w"].astype(jnp.float16)})


def test_trainstate_hands_tx_float32_params(maybe_jit):
  """``jax_lossscale.flax.TrainState.apply_gradients``, like the Optax wrapper, gives
  ``tx`` the float16 params promoted to float32: weight decay is computed in float32
  (in float16, 0.1 * 3.3 would be rounded to float16's 0.33)."""
  from jax_lossscale.flax import TrainState

  params = {"w": jnp.asarray([3.3, -1.7], jnp.float16)}
  tx = optax.chain(optax.add_decayed_weights(0.1), optax.sgd(1.0, momentum=0.5))
  ts = TrainState.create(apply_fn=None, params=params, tx=tx)
  grads = {"w": jnp.asarray([0.5, 0.25], jnp.float32)}
  with jax.numpy_dtype_promotion("standard"):  # a float16 leak would then be a value
    new = maybe_jit(lambda ts, g: ts.apply_gradients(grads=g))(ts, grads)
  trace = jax.tree_util.tree_leaves(new.opt_state)[0]
  p32 = params["w"].astype(jnp.float32)
  want = grads["w"] + jnp.float32(0.1) * p32  # the momentum trace after one step
  assert trace.dtype == jnp.float32
  np.testing.assert_array_equal(trace, want)
  assert new.params["w"].dtype == jnp.float16


def test_multi_steps_forwards_its_keyword_arguments():
  """``use_grad_mean`` and ``should_skip_update_fn`` reach ``optax.MultiSteps``."""
  params = {"w": jnp.zeros(1)}
  grads = [{"w": jnp.asarray([2.0])}, {"w": jnp.asarray([4.0])}]

  def run(**kwargs):
    tx = jls.multi_steps(jls.dynamic_loss_scale(optax.sgd(1.0), init_scale=1.0), 2, **kwargs)
    state = tx.init(params)
    with jax.numpy_dtype_promotion("standard"):  # MultiSteps mixes int32 and floats
      for g in grads:
        updates, state = tx.update(g, state, params)
    return float(updates["w"][0]), state

  assert run()[0] == -3.0  # the mean by default
  assert run(use_grad_mean=False)[0] == -6.0  # the sum
  skip_all = lambda updates, gradient_step, params: (jnp.asarray(True), ())
  value, state = run(should_skip_update_fn=skip_all)
  assert value == 0.0 and int(state.mini_step) == 0 and int(state.gradient_step) == 0


def test_multi_steps_passes_extra_args_to_the_inner_transformation():
  def update_fn(updates, state, params=None, *, factor):
    return jax.tree_util.tree_map(lambda u: u * factor, updates), state

  inner = optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update_fn)
  tx = jls.multi_steps(jls.dynamic_loss_scale(inner, init_scale=2.0), 1)
  params = {"w": jnp.zeros(2)}
  with jax.numpy_dtype_promotion("standard"):  # MultiSteps mixes int32 and floats
    updates, _ = tx.update({"w": jnp.asarray([2.0, 4.0])}, tx.init(params), params, factor=3.0)
  np.testing.assert_array_equal(updates["w"], [3.0, 6.0])  # unscaled by 2, then times 3


def test_trainstate_adds_float32_updates_to_float16_params_once(maybe_jit):
  """``jax_lossscale.flax.TrainState`` applies an update as ``optax.apply_updates``
  does: ``p + u`` in float32, rounded to float16 once. Rounding ``u`` to float16
  first rounds twice: here 1 + (2**-11 + 2**-22) would become 1.0, not 1 + 2**-10."""
  from jax_lossscale.flax import TrainState

  u = 2.0**-11 + 2.0**-22  # float32-exact; above half a float16 ulp of 1.0
  params = {"w": jnp.ones(2, jnp.float16)}
  ts = TrainState.create(apply_fn=None, params=params, tx=optax.sgd(1.0))
  grads = {"w": jnp.full(2, -u, jnp.float32)}
  new = maybe_jit(lambda ts, g: ts.apply_gradients(grads=g))(ts, grads)
  assert new.params["w"].dtype == jnp.float16
  np.testing.assert_array_equal(np.asarray(new.params["w"], np.float32), [1.0 + 2.0**-10] * 2)
  with jax.numpy_dtype_promotion("standard"):
    ref = optax.apply_updates(params, {"w": jnp.full(2, u, jnp.float32)})
  assert _bits(new.params) == _bits(ref)


def test_bfloat16_no_loss_scale_runs_the_same_code(maybe_jit):
  # bfloat16 has float32's exponent range: no scaling needed; the same train step runs.
  params = {"w": jnp.ones(4, jnp.bfloat16)}
  tx = jls.no_loss_scale(optax.sgd(0.5))
  state = tx.init(params)

  def step(params, state, x):
    loss_fn = lambda p: jls.scale_loss(jnp.sum((p["w"] * x) ** 2), state)
    grads = jax.grad(loss_fn)(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  x = jnp.asarray([1.0, 0.5, 2.0, 0.0], jnp.bfloat16)
  new, state = maybe_jit(step)(params, state, x)
  ref_grads = jax.grad(lambda p: jnp.sum((p["w"] * x) ** 2))(params)
  ref = optax.apply_updates(
    params, optax.sgd(0.5).update(ref_grads, optax.sgd(0.5).init(params))[0]
  )
  assert new["w"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(new["w"], np.float32), np.asarray(ref["w"], np.float32))
  m = jls.metrics(state)
  assert float(m["scale"]) == 1.0 and int(m["skipped_steps"]) == 0
