"""A loss scale per layer group: the boundary, the per-group unscaling, the rule, the skip.

The scaler is measured and not shipped: it lives beside its benchmark, in
``benchmarks/layer_scales.py``, outside the package.
"""

import doctest

from helpers import load_benchmark_module
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jax_lossscale.diagnostics import check_underflow

lg = load_benchmark_module("layer_scales")

F16, F32 = jnp.float16, jnp.float32


def _state(scales, headroom=1):
  tx = lg.layer_loss_scale(optax.sgd(1.0), [0] * len(scales))
  st = tx.init([jnp.zeros(1)] * len(scales))
  return st._replace(scales=jnp.asarray(scales, F32), headroom=jnp.int32(headroom))


def test_boundary_is_the_identity_forward_and_scales_the_cotangent_exactly(maybe_jit):
  st = _state([2.0**20, 2.0**4])
  x = jnp.asarray([1.5, -3.0, 6e-8], F16)  # 6e-8: a float16 subnormal
  out = maybe_jit(lambda x: lg.layer_boundary(x, st, 0))(x)
  assert out.dtype == F16 and np.array_equal(np.asarray(out), np.asarray(x))
  ct = jnp.asarray([2.0**-10, -(2.0**-24), 1.0], F16)
  _, vjp = jax.vjp(lambda x: lg.layer_boundary(x, st, 0), x)
  (g,) = maybe_jit(vjp)(ct)
  # times 2**16: applied in float32 (2**16 is not a float16), cast back; 2**16 overflows.
  assert g.dtype == F16
  np.testing.assert_array_equal(np.asarray(g, np.float32), [2.0**6, -(2.0**-8), np.inf])


def test_boundary_passes_integer_leaves_and_pytrees():
  st = _state([4.0, 1.0])

  def f(x):
    y = lg.layer_boundary({"a": x, "n": jnp.int32(3)}, st, 0)
    return jnp.sum(y["a"] * 3.0) + y["n"].astype(F32)

  np.testing.assert_array_equal(jax.grad(f)(jnp.ones(2, F32)), [12.0, 12.0])


def test_each_group_is_scaled_by_its_own_scale_and_unscaled_exactly(maybe_jit):
  params = {"a": jnp.asarray([1.0, 2.0], F32), "b": jnp.asarray([3.0], F32)}
  tx = lg.layer_loss_scale(optax.sgd(1.0), {"a": 0, "b": 1})
  st = tx.init(params)._replace(scales=jnp.asarray([2.0**30, 2.0**3], F32))

  def loss(p, marked=True):
    h = jnp.sum(p["a"] * 1e-6)
    h = lg.layer_boundary(h, st, 0) if marked else h
    return h * p["b"][0]

  grads = jax.grad(lambda p: lg.scale_loss_by_layers(loss(p), st))(params)
  true = jax.grad(lambda p: loss(p, False))(params)
  np.testing.assert_array_equal(grads["a"], true["a"] * 2.0**30)
  np.testing.assert_array_equal(grads["b"], true["b"] * 2.0**3)
  updates, new = maybe_jit(tx.update)(grads, st, params)
  np.testing.assert_array_equal(updates["a"], -true["a"])
  np.testing.assert_array_equal(updates["b"], -true["b"])
  # The rule: 3e-6 is in [2**-19, 2**-18): 2**(15 + 18 - 1); 1e-6 * 3 -> the same group 0.
  assert new.scales.dtype == F32 and new.headroom.dtype == jnp.int32
  k_a = int(np.frexp(np.float32(np.max(np.abs(true["a"]))))[1])
  k_b = int(np.frexp(np.float32(np.max(np.abs(true["b"]))))[1])
  np.testing.assert_array_equal(new.scales, [2.0 ** (15 - k_a - 1), 2.0 ** (15 - k_b - 1)])
  assert int(new.skipped_steps) == 0


def test_float16_gradients_under_strict_promotion_and_their_dtypes(maybe_jit):
  assert jax.config.jax_numpy_dtype_promotion == "strict"
  params = {"w": jnp.ones(3, F32), "h": jnp.ones(2, F16)}
  tx = lg.layer_loss_scale(optax.sgd(1.0, momentum=0.9), {"w": 0, "h": 1})
  st = tx.init(params)
  grads = {"w": jnp.full(3, 2.0**15, F16), "h": jnp.full(2, 2.0**14, F16)}
  updates, new = maybe_jit(tx.update)(grads, st, params)
  assert updates["w"].dtype == F32 and updates["h"].dtype == F16
  np.testing.assert_array_equal(updates["w"], [-0.5] * 3)
  np.testing.assert_array_equal(updates["h"], [-0.25] * 2)
  # 2**-1 and 2**-2 are in [2**-1, 2**0) and [2**-2, 2**-1): 2**(15 - 0 - 1), 2**(15 + 1 - 1).
  np.testing.assert_array_equal(new.scales, [2.0**14, 2.0**15])


def test_a_non_finite_gradient_skips_the_step_for_every_group():
  params = {"a": jnp.asarray([1.0, -0.0, 1e-30], F32), "b": jnp.ones(2, F32)}
  tx = lg.layer_loss_scale(optax.sgd(0.1, momentum=0.9), {"a": 0, "b": 1}, init_scale=2.0**10)
  st = tx.init(params)
  step = jax.jit(tx.update)
  grads = {"a": jnp.ones(3, F32), "b": jnp.asarray([1.0, jnp.inf], F32)}
  updates, new = step(grads, st, params)
  after = optax.apply_updates(params, updates)
  for k in params:
    assert np.array_equal(
      np.asarray(after[k]).view(np.uint32), np.asarray(params[k]).view(np.uint32)
    )
  # The inner state (the momentum) is untouched.
  for a, b in zip(jax.tree_util.tree_leaves(new.inner_state), jax.tree_util.tree_leaves(st)[5:]):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(new.scales, [2.0**9, 2.0**9])  # every scale halves
  assert int(new.headroom) == 2 and int(new.skipped_steps) == 1
  assert int(new.consecutive_skips) == 1 and int(new.growth_tracker) == 0


def test_headroom_shrinks_after_growth_interval_clean_steps_and_bounds_hold():
  tx = lg.layer_loss_scale(
    optax.sgd(1.0), [0, 1], growth_interval=2, max_scale=2.0**20, min_scale=2.0**-4
  )
  st = tx.init([jnp.zeros(1), jnp.zeros(1)])
  st = st._replace(scales=jnp.asarray([1.0, 1.0], F32))
  grads = [jnp.asarray([2.0**-30], F32), jnp.asarray([2.0**40], F32)]
  st = tx.update(grads, st)[1]
  assert int(st.headroom) == 1 and int(st.growth_tracker) == 1
  # 2**-30 wants 2**(15 + 29 - 1), clipped at max_scale; 2**40 wants 2**-27, clipped too.
  np.testing.assert_array_equal(st.scales, [2.0**20, 2.0**-4])
  zero = [jnp.zeros(1, F32), jnp.asarray([2.0**40], F32)]  # all zero: the scale doubles
  st = st._replace(scales=jnp.asarray([2.0**10, 2.0**-4], F32))
  st = tx.update(zero, st)[1]
  np.testing.assert_array_equal(st.scales, [2.0**11, 2.0**-4])
  assert int(st.headroom) == 0 and int(st.growth_tracker) == 0


def test_no_recompilation_on_the_second_step():
  params = {"a": jnp.ones(2, F32), "b": jnp.ones(2, F32)}
  tx = lg.layer_loss_scale(optax.sgd(1e-3, momentum=0.9), {"a": 0, "b": 1})
  traces = []

  @jax.jit
  def step(params, st):
    traces.append(1)

    def loss(p):
      h = lg.layer_boundary(jnp.sum(p["a"]), st, 0)
      return lg.scale_loss_by_layers(h * jnp.sum(p["b"]), st)

    updates, st = tx.update(jax.grad(loss)(params), st, params)
    return optax.apply_updates(params, updates), st

  st = tx.init(params)
  for _ in range(3):
    params, st = step(params, st)
  assert len(traces) == 1


def _branch_loss(p, x, dtype, st=None):
  """A layer, a residual branch of gain 2**-32 on a float32 stream, a head."""
  mark = (lambda h, g: h) if st is None else (lambda h, g: lg.layer_boundary(h, st, g))
  h = mark(jnp.tanh(x.astype(dtype) @ p["w0"].astype(dtype)).astype(F32), 0)
  branch = jnp.tanh(h.astype(dtype) @ p["w1"].astype(dtype)).astype(F32)
  h = mark(h + np.float32(2.0**-32) * branch, 1)
  return jnp.mean((h.astype(dtype) @ p["w2"].astype(dtype)).astype(F32) ** 2)


def test_the_small_gradient_branch_flushes_with_one_scale_and_not_with_its_own():
  rng = np.random.default_rng(0)
  p = {k: jnp.asarray(rng.standard_normal((16, 16)), F32) / 4 for k in ("w0", "w1", "w2")}
  x = jnp.asarray(rng.standard_normal((64, 16)), F32)
  one = check_underflow(lambda q, b, dt: _branch_loss(q, b, dt), p, x, scale=2.0**12)
  tx = lg.layer_loss_scale(optax.sgd(1.0), {"w0": 0, "w1": 1, "w2": 2}, init_scale=2.0**12)
  st = tx.init(p)
  step = jax.jit(tx.update)
  for _ in range(40):  # all flushed at 2**12: the branch's scale doubles until it sees some
    grads = jax.grad(lambda q, s=st: lg.scale_loss_by_layers(_branch_loss(q, x, F16, s), s))(p)
    st = step(grads, st)[1]
  assert float(st.scales[1]) >= 2.0**40  # the branch's own, far above the others'
  per = check_underflow(lambda q, b, dt: _branch_loss(q, b, dt, st), p, x, scale=st.scales[-1])
  assert one.fractions(scaled=True)["w1"] > 0.5
  assert per.fractions(scaled=True)["w1"] == 0.0
  assert bool(per.finite_scaled)


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    ({"inner": lambda g: g}, TypeError, "inner"),
    ({"init_scale": "8"}, TypeError, "init_scale"),
    ({"init_scale": 3.0}, ValueError, "init_scale"),
    ({"min_scale": 0.0}, ValueError, "min_scale"),
    ({"max_scale": 2.0**200}, ValueError, "max_scale"),
    ({"init_scale": 2.0**60}, ValueError, "init_scale"),
    ({"init_headroom": -1}, ValueError, "init_headroom"),
    ({"init_headroom": 1.5}, TypeError, "init_headroom"),
    ({"growth_interval": 0}, ValueError, "growth_interval"),
    ({"num_groups": 0}, ValueError, "num_groups"),
    ({"groups": {"a": 0.5}}, TypeError, "groups"),
    ({"groups": {"a": -1}}, ValueError, "groups"),
  ],
)
def test_bad_arguments_raise_naming_the_argument(kwargs, error, match):
  kwargs = {"inner": optax.sgd(1.0), "groups": {"a": 0}, **kwargs}
  with pytest.raises(error, match=match):
    lg.layer_loss_scale(kwargs.pop("inner"), kwargs.pop("groups"), **kwargs)


def test_bad_boundary_and_update_arguments():
  st = _state([2.0, 1.0])
  with pytest.raises(ValueError, match="group"):
    lg.layer_boundary(jnp.ones(2), st, 1)
  with pytest.raises(TypeError, match="group"):
    lg.layer_boundary(jnp.ones(2), st, 0.0)
  with pytest.raises(ValueError, match="LayerScaleState"):
    lg.layer_boundary(jnp.ones(2), {"no": jnp.ones(2)}, 0)
  tx = lg.layer_loss_scale(optax.sgd(1.0), {"a": 0, "b": 1})
  with pytest.raises(TypeError, match="state"):
    tx.update({"a": jnp.ones(1), "b": jnp.ones(1)}, optax.EmptyState())
  with pytest.raises(ValueError, match="groups"):
    tx.update({"a": jnp.ones(1)}, tx.init({"a": jnp.ones(1), "b": jnp.ones(1)}))


def test_inside_multi_steps_the_accumulated_step_uses_one_set_of_scales():
  """``jls.multi_steps`` around it: micro-batch gradients are accumulated at the same scales
  (they only change on the real step), unscaled per group once, and an overflowing
  micro-batch skips the accumulated step without poisoning the next one."""
  import jax_lossscale as jls

  params = {"a": jnp.zeros(1, F32), "b": jnp.zeros(1, F32)}
  inner = lg.layer_loss_scale(optax.sgd(1.0), {"a": 0, "b": 1}, init_scale=2.0**4)
  tx = jls.multi_steps(inner, 2)
  st = tx.init(params)
  step = jax.jit(tx.update)
  scales = lambda s: np.asarray(lg.get_layer_scale_state(s).scales)
  with jax.numpy_dtype_promotion("standard"):  # optax.MultiSteps mixes int32 and floats
    st = st._replace(
      inner_opt_state=st.inner_opt_state._replace(scales=jnp.asarray([2.0**8, 2.0**2], F32))
    )
    # Two micro-batches, scaled by each group's scale: the update is their unscaled mean.
    for a, b in [(1.0, 4.0), (3.0, 8.0)]:
      assert np.array_equal(scales(st), [2.0**8, 2.0**2])
      grads = {"a": jnp.asarray([a * 2.0**8], F32), "b": jnp.asarray([b * 2.0**2], F32)}
      updates, st = step(grads, st, params)
    np.testing.assert_array_equal(updates["a"], [-2.0])
    np.testing.assert_array_equal(updates["b"], [-6.0])
    # amax 2 is in [2, 4) and 6 in [4, 8): 2**(15 - 2 - 1) and 2**(15 - 3 - 1).
    np.testing.assert_array_equal(scales(st), [2.0**12, 2.0**11])
    # An overflowing micro-batch: the accumulated step is skipped, every scale halves.
    for g in [jnp.inf, 1.0]:
      updates, st = step({"a": jnp.asarray([g], F32), "b": jnp.ones(1, F32)}, st, params)
    np.testing.assert_array_equal(updates["a"], [0.0])
    assert int(lg.get_layer_scale_state(st).skipped_steps) == 1
    np.testing.assert_array_equal(scales(st), [2.0**11, 2.0**10])
    # The accumulator restarted from zeros: the next accumulated step is clean.
    for _ in range(2):
      updates, st = step({"a": jnp.full(1, 2.0**11, F32), "b": jnp.zeros(1, F32)}, st, params)
    np.testing.assert_array_equal(updates["a"], [-1.0])
    assert int(lg.get_layer_scale_state(st).skipped_steps) == 1


def test_retry_on_overflow_does_not_take_the_layer_scales():
  """Not integrated: ``retry_on_overflow`` looks for one ``DynamicScaleState``."""
  import jax_lossscale as jls

  tx = lg.layer_loss_scale(optax.sgd(1.0), {"a": 0})
  st = tx.init({"a": jnp.ones(1, F32)})
  with pytest.raises(ValueError, match="No DynamicScaleState"):
    jls.retry_on_overflow(lambda p: jnp.sum(p["a"]), st)


def test_the_module_examples_run():
  result = doctest.testmod(lg, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  assert result.attempted >= 4 and result.failed == 0, result
