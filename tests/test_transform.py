"""The Optax wrappers: skipping, bit-identity, dtypes, recompilation, validation."""

from helpers import import_optional
from helpers import standard_promotion
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_lossscale as jls

chex = import_optional("chex")


def bits(tree):
  """Float leaves as raw bit patterns (unsigned ints), so -0.0 != 0.0 and NaN == NaN."""

  def view(x):
    x = np.asarray(x)
    return x.view(np.dtype(f"u{x.dtype.itemsize}")) if x.dtype.kind == "f" else x

  return jax.tree_util.tree_map(view, tree)


def assert_bit_identical(a, b):
  """Same structure, shapes, dtypes and bits (chex alone treats -0.0 and 0.0 as equal)."""
  chex.assert_trees_all_equal(bits(a), bits(b), strict=True)


def test_assert_bit_identical_tells_signed_zeros_apart():
  assert_bit_identical({"w": jnp.asarray([-0.0, jnp.nan])}, {"w": jnp.asarray([-0.0, jnp.nan])})
  with pytest.raises(AssertionError):
    assert_bit_identical({"w": jnp.asarray([-0.0])}, {"w": jnp.asarray([0.0])})
  with pytest.raises(AssertionError):
    assert_bit_identical({"w": jnp.asarray([1.0], jnp.float32)}, {"w": jnp.asarray([1], jnp.int32)})


PARAMS = {
  "w": jnp.array([[0.5, -0.0], [1.5, -2.0]], jnp.float32),  # includes -0.0
  "b": jnp.array([0.1, -0.2], jnp.float32),
}


def _large_params():
  """Leaves of at least _skip.LARGE elements, which take the copy-free skip on CPU."""
  from jax_lossscale._scaler._skip import LARGE

  rng = np.random.default_rng(1)
  return {
    "w": jnp.asarray(rng.normal(size=(256, LARGE // 128)), jnp.float32),  # 2 * LARGE
    "b": jnp.zeros((LARGE // 128,), jnp.float32),
  }


PARAMS_BY_SIZE = pytest.mark.parametrize(
  "start_params", [PARAMS, _large_params()], ids=["small", "large"]
)


@pytest.fixture
def adam_promotion():
  """optax.adam is not strict-promotion clean (see conftest.standard_promotion)."""
  with standard_promotion():
    yield


def grads_like(params, value):
  return jax.tree_util.tree_map(lambda p: jnp.full_like(p, value), params)


@PARAMS_BY_SIZE
def test_skipped_step_leaves_params_and_adam_state_bit_identical(
  start_params, maybe_jit, adam_promotion
):
  tx = jls.dynamic_loss_scale(optax.adam(1e-2), init_scale=4.0, growth_interval=3)
  state = tx.init(start_params)
  update = maybe_jit(tx.update)
  params = start_params
  # Two clean steps so Adam's moments and count are non-trivial.
  for _ in range(2):
    updates, state = update(grads_like(params, 4.0), state, params)
    params = optax.apply_updates(params, updates)
  # A -0.0 param right before the skip: only -0.0 updates keep it bit for bit
  # (after the two Adam steps no param is -0.0 any more).
  params = {**params, "w": params["w"].at[0, 1].set(-0.0)}
  before_params, before_inner = params, state.inner_state
  bad = grads_like(params, 1.0)
  bad = {"w": bad["w"].at[0, 1].set(jnp.nan), "b": bad["b"].at[0].set(jnp.inf)}
  updates, state = update(bad, state, params)
  params = optax.apply_updates(params, updates)
  assert np.signbit(np.asarray(params["w"])[0, 1]) and params["w"][0, 1] == 0.0
  assert_bit_identical(params, before_params)
  assert_bit_identical(state.inner_state, before_inner)
  assert int(state.inner_state[0].count) == 2  # Adam's count did not advance
  s = state.loss_scale
  assert float(s.scale) == 2.0 and int(s.growth_tracker) == 0
  assert int(s.skipped_steps) == 1 and int(s.consecutive_skips) == 1
  for u in jax.tree_util.tree_leaves(updates):
    assert np.all(np.signbit(np.asarray(u))) and not np.any(np.asarray(u))  # -0.0


@PARAMS_BY_SIZE
def test_clean_steps_equal_inner_on_unscaled_grads(start_params, maybe_jit, adam_promotion):
  inner = optax.adam(1e-2)
  tx = jls.dynamic_loss_scale(inner, init_scale=1024.0)
  s_tx, s_in = tx.init(start_params), inner.init(start_params)
  p_tx = p_in = start_params
  rng = np.random.default_rng(0)
  for _ in range(5):
    g = jax.tree_util.tree_map(
      lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), start_params
    )
    scaled = jax.tree_util.tree_map(lambda x: x * jnp.float32(1024.0), g)  # exact (power of 2)
    u_tx, s_tx = maybe_jit(tx.update)(scaled, s_tx, p_tx)
    u_in, s_in = maybe_jit(inner.update)(g, s_in, p_in)
    p_tx, p_in = optax.apply_updates(p_tx, u_tx), optax.apply_updates(p_in, u_in)
  if maybe_jit is jax.jit:
    # Two different XLA programs may contract multiply-adds differently.
    for a, b in zip(
      jax.tree_util.tree_leaves((p_tx, s_tx.inner_state)), jax.tree_util.tree_leaves((p_in, s_in))
    ):
      np.testing.assert_allclose(a, b, rtol=1e-6, atol=0)
  else:
    assert_bit_identical(p_tx, p_in)
    assert_bit_identical(s_tx.inner_state, s_in)


def test_clean_step_with_plus_zero_first_outputs_advances_the_state(maybe_jit, adam_promotion):
  """The copy-free skip orders the state select after one element of each large
  output; that must never change the decision. Here the first element of every
  large output of a clean step is +0.0 (all bits 0): the state still advances."""
  from jax_lossscale._scaler._skip import LARGE
  from jax_lossscale.flax import TrainState

  n = LARGE + 1
  grads = jnp.full((n,), 4.0, jnp.float32).at[0].set(0.0)
  # Optax path: the output is the update; trace(0.9) of a +0.0 gradient is +0.0.
  tx = jls.dynamic_loss_scale(optax.trace(decay=0.9), init_scale=4.0)
  p = {"w": jnp.zeros((n,), jnp.float32)}
  updates, state = maybe_jit(tx.update)({"w": grads}, tx.init(p), p)
  assert np.asarray(updates["w"]).view(np.uint32)[0] == 0  # +0.0
  np.testing.assert_array_equal(state.inner_state.trace["w"][1:], 1.0)
  np.testing.assert_array_equal(updates["w"][1:], 1.0)
  # TrainState path: the output is the new params; a zero bias whose first unit
  # gets no gradient stays +0.0 (0.0 + -0.0).
  ts = TrainState.create(
    apply_fn=None, params={"b": jnp.zeros((n,), jnp.float32)}, tx=optax.adam(0.5)
  )
  ts = maybe_jit(lambda ts, g: ts.apply_gradients(grads=g))(ts, {"b": grads / 4.0})
  assert np.asarray(ts.params["b"]).view(np.uint32)[0] == 0
  assert int(ts.step) == 1 and int(ts.opt_state[0].count) == 1
  np.testing.assert_allclose(ts.opt_state[0].mu["b"][1:], 0.1, rtol=1e-6)
  np.testing.assert_allclose(ts.params["b"][1:], -0.5, rtol=1e-5)


def test_no_recompilation_and_no_dtype_drift(adam_promotion):
  tx = jls.dynamic_loss_scale(optax.adam(1e-3), init_scale=8.0, growth_interval=2)
  traces = []

  @jax.jit
  @chex.assert_max_traces(n=1)  # a second trace (e.g. on the second step) raises
  def step(params, state, grads):
    traces.append(1)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  params, state = PARAMS, tx.init(PARAMS)
  treedef = jax.tree_util.tree_structure(state)
  dtypes = [x.dtype for x in jax.tree_util.tree_leaves(state)]
  for value in [1.0, jnp.inf, 1.0, 1.0, 1.0, jnp.nan]:
    params, state = step(params, state, grads_like(params, value))
    assert jax.tree_util.tree_structure(state) == treedef
    assert [x.dtype for x in jax.tree_util.tree_leaves(state)] == dtypes
  assert len(traces) == 1
  s = state.loss_scale
  assert s.scale.dtype == jnp.float32 and s.growth_tracker.dtype == jnp.int32
  assert not s.scale.weak_type and not s.growth_tracker.weak_type


def test_extra_args_pass_through_to_inner():
  seen = {}

  def init_fn(params):
    return optax.EmptyState()

  def update_fn(updates, state, params=None, *, value=None, **extra):
    seen["value"] = value
    return jax.tree_util.tree_map(lambda u: u * value, updates), state

  inner = optax.GradientTransformationExtraArgs(init_fn, update_fn)
  tx = jls.dynamic_loss_scale(inner, init_scale=2.0)
  state = tx.init(PARAMS)
  updates, _ = tx.update(grads_like(PARAMS, 2.0), state, PARAMS, value=jnp.float32(3.0))
  assert float(seen["value"]) == 3.0
  np.testing.assert_array_equal(updates["b"], [3.0, 3.0])
  # Inside optax.chain, extra args reach the wrapped transformation too.
  chained = optax.chain(optax.identity(), tx)
  updates, _ = chained.update(
    grads_like(PARAMS, 2.0), chained.init(PARAMS), PARAMS, value=jnp.float32(5.0)
  )
  np.testing.assert_array_equal(updates["b"], [5.0, 5.0])


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_dtypes_of_updates_inner_state_and_unscaled(
  dtype, maybe_jit, adam_promotion, fresh_warnings
):
  params = {"w": jnp.ones(3, dtype)}
  tx = jls.dynamic_loss_scale(optax.adam(1e-1), init_scale=2.0**10)
  state = tx.init(params)
  # The inner transformation sees float32 (its state is float32).
  assert state.inner_state[0].mu["w"].dtype == jnp.float32
  grads = {"w": jnp.full(3, 2.0**-5 * 2.0**10, dtype)}
  if dtype == jnp.bfloat16:  # bfloat16 gradients alone: the no_loss_scale hint, every time
    with pytest.warns(jls.LossScaleWarning, match="no_loss_scale"):
      updates, state = maybe_jit(tx.update)(grads, state, params)
  else:
    updates, state = maybe_jit(tx.update)(grads, state, params)
  assert updates["w"].dtype == dtype
  assert state.inner_state[0].mu["w"].dtype == jnp.float32
  unscaled, _ = jls.unscale_and_check(grads, state.loss_scale)
  assert unscaled["w"].dtype == jnp.float32
  np.testing.assert_array_equal(
    np.asarray(state.inner_state[0].mu["w"]), np.full(3, 0.1 * 2.0**-5, np.float32)
  )


def test_tiny_float16_gradients_survive_in_float32():
  """A float16 gradient whose true value is below float16's range is not lost."""
  true = np.float32(1e-9)  # float16's smallest subnormal is ~6e-8
  scale = 2.0**16
  g16 = jnp.asarray(true * np.float32(scale), jnp.float16)
  unscaled, ok = jls.unscale_and_check(g16, scale)
  assert bool(ok) and unscaled.dtype == jnp.float32
  np.testing.assert_allclose(float(unscaled), 1e-9, rtol=1e-3)
  assert float(jnp.asarray(true, jnp.float16)) == 0.0  # without scaling: lost


def test_non_float_and_none_leaves_pass_through():
  grads = {
    "f": jnp.array([2.0, 4.0]),
    "i": jnp.array([3, 4], jnp.int32),
    "b": jnp.array(True),
    "n": None,
  }
  out, ok = jls.unscale_and_check(grads, 2.0)
  assert bool(ok)
  assert out["i"] is grads["i"] and out["b"] is grads["b"] and out["n"] is None
  np.testing.assert_array_equal(out["f"], [1.0, 2.0])
  empty, ok = jls.unscale_and_check({}, 2.0)
  assert empty == {} and bool(ok)


def test_overflow_created_by_unscaling_is_caught():
  """scale < 1: a finite scaled gradient can overflow when unscaled (torch misses it)."""
  big = jnp.array([3e38], jnp.float32)
  out, ok = jls.unscale_and_check(big, 0.5)
  assert np.isinf(np.asarray(out)).all() and not bool(ok)
  tx = jls.dynamic_loss_scale(optax.sgd(1.0), init_scale=0.5)
  p = jnp.zeros(1)
  u, state = tx.update(big, tx.init(p), p)
  assert np.isfinite(np.asarray(optax.apply_updates(p, u))).all()
  assert int(state.loss_scale.skipped_steps) == 1


@pytest.mark.parametrize("tracker", [2, 3, 10])
def test_growth_when_the_tracker_reaches_or_passes_the_interval(tracker, maybe_jit):
  """Growth rule ``tracker + 1 >= interval`` (torch: ``==``): a state loaded with a
  tracker at or past the interval grows on its next clean step and resets."""
  s = jls.DynamicScaleState.create(init_scale=8.0, growth_interval=3)
  s = s.replace(growth_tracker=jnp.asarray(tracker, jnp.int32))
  out = maybe_jit(jls.update_scale)(s, True)
  assert float(out.scale) == 16.0 and int(out.growth_tracker) == 0
  # The same through the Optax wrapper, with a state from a longer interval.
  tx = jls.dynamic_loss_scale(optax.sgd(1.0), init_scale=8.0, growth_interval=3)
  p = {"w": jnp.zeros(2, jnp.float32)}
  state = tx.init(p)
  state = state._replace(
    loss_scale=state.loss_scale.replace(growth_tracker=jnp.asarray(tracker, jnp.int32))
  )
  u, state = maybe_jit(tx.update)({"w": jnp.full(2, 8.0, jnp.float32)}, state, p)
  np.testing.assert_array_equal(u["w"], [-1.0, -1.0])  # unscaled by 8, the scale used
  assert float(state.loss_scale.scale) == 16.0 and int(state.loss_scale.growth_tracker) == 0
  # One short of the interval: counts up, no growth.
  s = s.replace(growth_tracker=jnp.asarray(1, jnp.int32))
  out = maybe_jit(jls.update_scale)(s, True)
  assert float(out.scale) == 8.0 and int(out.growth_tracker) == 2


def test_scale_never_below_min_scale():
  state = jls.DynamicScaleState.create(init_scale=1.0)
  step = jax.jit(jls.update_scale)
  for _ in range(300):
    state = step(state, False)
  assert float(state.scale) == np.finfo(np.float32).tiny
  state = jls.DynamicScaleState.create(init_scale=1.0, min_scale=0.25)
  for _ in range(5):
    state = jls.update_scale(state, False)
  assert float(state.scale) == 0.25


def test_scale_loss_promotes_half_precision():
  state = jls.DynamicScaleState.create()
  out = jls.scale_loss(jnp.float16(60000.0), state)
  assert out.dtype == jnp.float32 and float(out) == 60000.0 * 65536
  assert jls.scale_loss(jnp.bfloat16(1.5), state).dtype == jnp.float32
  with pytest.raises(ValueError, match="loss must be a floating-point"):
    jls.scale_loss(jnp.int32(1), state)


def test_get_scale_state_through_nested_optax_states():
  base = jls.dynamic_loss_scale(optax.adam(1e-3), init_scale=32.0)
  wrapped = [
    optax.chain(optax.clip(1.0), base),
    optax.MultiSteps(base, every_k_schedule=2),
    optax.masked(base, {"w": True, "b": False}),
    optax.partition({"a": base, "b": optax.sgd(0.1)}, {"w": "a", "b": "b"}),
  ]
  for tx in wrapped:
    state = tx.init(PARAMS)
    assert float(jls.get_scale_state(state).scale) == 32.0
  hyper = optax.inject_hyperparams(
    lambda learning_rate: jls.dynamic_loss_scale(optax.sgd(learning_rate), init_scale=32.0)
  )(learning_rate=0.1)
  assert float(jls.get_scale_state(hyper.init(PARAMS)).scale) == 32.0
  with pytest.raises(ValueError, match="No DynamicScaleState"):
    jls.get_scale_state(optax.adam(1e-3).init(PARAMS))
  two = optax.partition({"a": base, "b": base}, {"w": "a", "b": "b"}).init(PARAMS)
  with pytest.raises(ValueError, match="holds 2 loss scalers"):
    jls.get_scale_state(two)


@pytest.mark.parametrize(
  "kwargs,name",
  [
    (dict(growth_factor=1.0), "growth_factor"),
    (dict(growth_factor=0.5), "growth_factor"),
    (dict(growth_factor=float("inf")), "growth_factor"),
    (dict(backoff_factor=1.0), "backoff_factor"),
    (dict(backoff_factor=0.0), "backoff_factor"),
    (dict(backoff_factor=-0.5), "backoff_factor"),
    (dict(growth_interval=0), "growth_interval"),
    (dict(init_scale=0.0), "init_scale"),
    (dict(init_scale=-1.0), "init_scale"),
    (dict(init_scale=float("nan")), "init_scale"),
    (dict(init_scale=float("inf")), "init_scale"),
    (dict(init_scale=1e39), "init_scale"),
    (dict(min_scale=0.0), "min_scale"),
    (dict(min_scale=1e-40), "min_scale"),
    (dict(min_scale=float("nan")), "min_scale"),
    (dict(init_scale=1.0, min_scale=2.0), "min_scale"),
    (dict(max_scale=float("inf")), "max_scale"),
    (dict(init_scale=4.0, max_scale=2.0), "init_scale"),
    (dict(hysteresis=0), "hysteresis"),
  ],
)
def test_bad_config_raises_value_error_naming_the_argument(kwargs, name):
  with pytest.raises(ValueError, match=name):
    jls.dynamic_loss_scale(optax.sgd(1.0), **kwargs)
  with pytest.raises(ValueError, match=name):
    jls.DynamicScaleState.create(**kwargs)


@pytest.mark.parametrize(
  "kwargs,name",
  [
    (dict(growth_interval=2.5), "growth_interval"),
    (dict(growth_interval=True), "growth_interval"),
    (dict(init_scale="8"), "init_scale"),
    (dict(hysteresis="2"), "hysteresis"),
    (dict(dynamic="yes"), "dynamic"),
  ],
)
def test_a_config_value_of_the_wrong_type_raises_type_error_naming_the_argument(kwargs, name):
  with pytest.raises(TypeError, match=name):
    jls.dynamic_loss_scale(optax.sgd(1.0), **kwargs)
  with pytest.raises(TypeError, match=name):
    jls.DynamicScaleState.create(**kwargs)


def test_bad_arguments_of_the_functions():
  with pytest.raises(TypeError, match="inner"):
    jls.dynamic_loss_scale(lambda g: g)
  with pytest.raises(ValueError, match="scale"):
    jls.static_loss_scale(optax.sgd(1.0), 0.0)
  with pytest.raises(ValueError, match="grads_finite"):
    jls.update_scale(jls.DynamicScaleState.create(), jnp.array([True, False]))
  with pytest.raises(TypeError, match="state"):
    jls.update_scale({"scale": 1.0}, True)


def test_static_and_disabled_scaling_keep_the_scale(maybe_jit):
  p = jnp.zeros(2)
  for tx, scale in [
    (jls.static_loss_scale(optax.sgd(1.0), 256.0), 256.0),
    (jls.no_loss_scale(optax.sgd(1.0)), 1.0),
  ]:
    state = tx.init(p)
    update = maybe_jit(tx.update)
    for value in [1.0, jnp.inf, 1.0]:
      u, state = update(jnp.full(2, value * scale, jnp.float32), state, p)
    s = state.loss_scale
    assert float(s.scale) == scale and int(s.growth_tracker) == 0
    assert int(s.skipped_steps) == 1 and int(s.consecutive_skips) == 0
    np.testing.assert_array_equal(u, [-1.0, -1.0])


def test_state_round_trips_through_tree_map_and_jit():
  """Config is static metadata: it survives every pytree round trip (jmp#44)."""
  s = jls.DynamicScaleState.create(init_scale=8.0, min_scale=0.5, growth_interval=7, hysteresis=2)
  for t in (jax.tree_util.tree_map(lambda x: x, s), jax.jit(lambda x: x)(s)):
    assert t.config == s.config and isinstance(t, jls.DynamicScaleState)
  leaves = jax.tree_util.tree_leaves(s)
  assert len(leaves) == 5 and all(isinstance(x, jax.Array) for x in leaves)


def test_inner_sees_integer_and_boolean_leaves_as_they_are():
  """Only float16/bfloat16 leaves are promoted for ``inner``: an int32 or bool param (a
  step counter, a mask) reaches it in its own dtype, in init and in update."""
  seen = []

  def init_fn(params):
    seen.append({k: v.dtype for k, v in params.items()})
    return optax.EmptyState()

  def update_fn(updates, state, params=None):
    seen.append({k: v.dtype for k, v in params.items()})
    return updates, state

  tx = jls.dynamic_loss_scale(optax.GradientTransformation(init_fn, update_fn), init_scale=2.0)
  params = {
    "i": jnp.arange(2, dtype=jnp.int32),
    "b": jnp.asarray([True, False]),
    "h": jnp.ones(2, jnp.float16),
  }
  grads = {"i": jnp.zeros(2, jnp.int32), "b": jnp.asarray([False, False]), "h": params["h"]}
  tx.update(grads, tx.init(params), params)
  want = {"i": jnp.int32, "b": jnp.bool_, "h": jnp.float32}
  assert seen == [want, want]
