"""Bad and unusual input: a correct result or a clear error, never corrupt state."""

import os
import subprocess
import sys
import textwrap

from helpers import assert_bits_equal
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_lossscale as jls


def _tx(**kwargs):
  kwargs.setdefault("init_scale", 4.0)
  return jls.dynamic_loss_scale(optax.sgd(0.5, momentum=0.9), **kwargs)


def _state_dtypes_ok(loss_scale):
  assert loss_scale.scale.dtype == jnp.float32
  for name in ("growth_tracker", "hysteresis_tracker", "skipped_steps", "consecutive_skips"):
    assert getattr(loss_scale, name).dtype == jnp.int32, name


# --- structure ------------------------------------------------------------------


def test_mismatched_tree_structure_raises_naming_the_keys(maybe_jit):
  tx = _tx()
  params = {"w": jnp.ones(3, jnp.float32)}
  state = tx.init(params)
  snapshot = jax.tree_util.tree_map(jnp.copy, state)
  with pytest.raises(ValueError, match=r"(?s)'v'.*'w'|'w'.*'v'"):
    maybe_jit(tx.update)({"v": jnp.ones(3, jnp.float32)}, state, params)
  with pytest.raises((TypeError, ValueError), match="shape"):
    maybe_jit(tx.update)({"w": jnp.ones(4, jnp.float32)}, state, params)
  assert_bits_equal(state, snapshot, structure=True)  # the failed calls touched nothing


def test_foreign_state_is_rejected():
  tx = _tx()
  params = {"w": jnp.ones(3, jnp.float32)}
  other = optax.sgd(0.1).init(params)
  with pytest.raises(TypeError, match="LossScaleState"):
    tx.update(params, other, params)
  with pytest.raises(TypeError, match="DynamicScaleState"):
    jls.update_scale(other, True)


def test_none_leaves_pass_through(maybe_jit):
  tx = _tx()
  params = {"w": jnp.ones(3, jnp.float32), "frozen": None}
  state = tx.init(params)
  grads = {"w": jnp.full(3, 8.0, jnp.float32), "frozen": None}
  updates, state = maybe_jit(tx.update)(grads, state, params)
  assert updates["frozen"] is None
  np.testing.assert_array_equal(updates["w"], np.full(3, -1.0, np.float32))  # -0.5 * 8 / 4
  grads = {"w": jnp.asarray([1.0, jnp.nan, 1.0], jnp.float32), "frozen": None}
  updates, state = maybe_jit(tx.update)(grads, state, params)
  assert updates["frozen"] is None and int(state.loss_scale.skipped_steps) == 1


def test_integer_and_bool_leaves_take_no_part_in_the_check(maybe_jit):
  # Integer/bool leaves (step counters, masks) need an inner transform that
  # leaves them alone; the scaler passes them through unscaled and unchecked.
  labels = {"w": "train", "count": "frozen", "mask": "frozen"}
  inner = optax.multi_transform({"train": optax.sgd(0.5), "frozen": optax.set_to_zero()}, labels)
  tx = jls.dynamic_loss_scale(inner, init_scale=4.0)
  params = {
    "w": jnp.ones(2, jnp.float32),
    "count": jnp.asarray([3, 7], jnp.int32),
    "mask": jnp.asarray([True, False]),
  }
  state = tx.init(params)
  grads = {
    "w": jnp.full(2, 4.0, jnp.float32),
    "count": jnp.asarray([2**30, -5], jnp.int32),
    "mask": jnp.asarray([True, True]),
  }
  updates, state = maybe_jit(tx.update)(grads, state, params)
  assert int(state.loss_scale.skipped_steps) == 0  # the huge int is not an overflow
  assert updates["count"].dtype == jnp.int32 and updates["mask"].dtype == jnp.bool_
  np.testing.assert_array_equal(updates["w"], np.full(2, -0.5, np.float32))
  np.testing.assert_array_equal(updates["count"], [0, 0])
  bad = dict(grads, w=jnp.asarray([jnp.inf, 1.0], jnp.float32))
  updates, state = maybe_jit(tx.update)(bad, state, params)
  assert int(state.loss_scale.skipped_steps) == 1
  new = optax.apply_updates(params, updates)
  assert_bits_equal(new, params, structure=True)
  assert jls.all_finite({"i": jnp.asarray([2**31 - 1]), "b": jnp.asarray([True])})


@pytest.mark.parametrize(
  "step",
  [
    "dynamic_loss_scale",
    "static_loss_scale",
    "no_loss_scale",
    "multi_steps",
    "unscale_and_check",
    "all_finite",
  ],
)
def test_complex_gradients_are_refused_naming_the_leaf(step, maybe_jit):
  # A complex leaf would pass through like an integer one: still scaled, never checked
  # (an inf gradient applied instead of a skipped step). It is refused instead.
  params = {"w": jnp.ones(2), "z": jnp.ones(2, jnp.complex64)}
  grads = {"w": jnp.ones(2), "z": jnp.array([4 + 4j, jnp.inf], jnp.complex64)}
  if step in ("dynamic_loss_scale", "static_loss_scale", "no_loss_scale", "multi_steps"):
    tx = {
      "dynamic_loss_scale": lambda: jls.dynamic_loss_scale(optax.sgd(1.0), init_scale=4.0),
      "static_loss_scale": lambda: jls.static_loss_scale(optax.sgd(1.0), 4.0),
      "no_loss_scale": lambda: jls.no_loss_scale(optax.sgd(1.0)),
      "multi_steps": lambda: jls.multi_steps(jls.dynamic_loss_scale(optax.sgd(1.0)), 2),
    }[step]()
    run = lambda: maybe_jit(tx.update)(grads, tx.init(params), params)
  elif step == "unscale_and_check":
    run = lambda: maybe_jit(jls.unscale_and_check)(grads, 4.0)
  else:
    run = lambda: maybe_jit(jls.all_finite)(grads)
  with pytest.raises(TypeError, match=r"gradient leaf \['z'\] is complex64: complex gradients"):
    run()


def test_complex_gradients_are_refused_by_an_nnx_optimizer():
  from flax import nnx

  class Model(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(jnp.ones(2))
      self.z = nnx.Param(jnp.ones(2, jnp.complex64))

  model = Model()
  opt = nnx.Optimizer(model, jls.dynamic_loss_scale(optax.sgd(1.0)), wrt=nnx.Param)
  grads = jax.tree_util.tree_map(lambda p: p * 4, nnx.state(model, nnx.Param))
  with pytest.raises(TypeError, match=r"gradient leaf .*'z'.* is complex64"):
    opt.update(model, grads)


def test_complex_gradients_are_refused_by_the_flax_paths():
  from jax_lossscale.flax import TrainState
  from jax_lossscale.flax import value_and_grad

  ds = jls.DynamicScaleState.create(init_scale=4.0)
  loss = lambda z: jnp.sum(jnp.abs(z) ** 2)
  with pytest.raises(TypeError, match=r"gradient leaf .* is complex64"):
    value_and_grad(loss, ds)(jnp.ones(2, jnp.complex64))
  state = TrainState.create(
    apply_fn=None, params={"z": jnp.ones(2, jnp.complex64)}, tx=optax.sgd(1.0), dynamic_scale=ds
  )
  with pytest.raises(TypeError, match=r"gradient leaf \['z'\] is complex64"):
    state.apply_gradients(grads={"z": jnp.ones(2, jnp.complex64)})


def test_empty_trees(maybe_jit):
  tx = _tx(growth_interval=1)
  for empty in ({}, [], ()):
    state = tx.init(empty)
    updates, new_state = maybe_jit(tx.update)(empty, state, empty)
    assert updates == empty
    # An empty gradient is finite: a clean step (the scale grows at interval 1).
    assert float(new_state.loss_scale.scale) == 8.0
    assert int(new_state.loss_scale.skipped_steps) == 0
    _state_dtypes_ok(new_state.loss_scale)
  g, ok = jls.unscale_and_check({}, 2.0)
  assert g == {} and bool(ok)


# --- scalars and Python numbers -------------------------------------------------


def test_python_floats_where_arrays_are_expected(maybe_jit):
  tx = _tx()
  state = tx.init({"w": 1.0})
  updates, state = maybe_jit(tx.update)({"w": 8.0}, state, {"w": 1.0})
  assert updates["w"].dtype == jnp.float32 and float(updates["w"]) == -1.0
  _state_dtypes_ok(state.loss_scale)
  updates, state = maybe_jit(tx.update)({"w": float("inf")}, state, {"w": 1.0})
  assert float(updates["w"]) == 0.0 and np.signbit(updates["w"])
  assert int(state.loss_scale.skipped_steps) == 1
  assert jls.scale_loss(2.0, state).dtype == jnp.float32
  g, ok = jls.unscale_and_check([8.0, 2], 4.0)
  assert float(g[0]) == 2.0 and g[1] == 2 and bool(ok)


def test_python_float_flag_is_rejected_python_bool_accepted():
  s = jls.DynamicScaleState.create(init_scale=4.0)
  with pytest.raises(ValueError, match="grads_finite must be a boolean scalar"):
    jls.update_scale(s, 1.0)
  with pytest.raises(ValueError, match="grads_finite must be a boolean scalar"):
    jls.update_scale(s, jnp.asarray([True, False]))
  assert float(jls.update_scale(s, False).scale) == 2.0
  assert float(jls.update_scale(s, np.bool_(False)).scale) == 2.0


def test_python_float_state_leaf_keeps_float32():
  s = jls.DynamicScaleState.create(init_scale=4.0).replace(scale=2.0)
  for finite in (False, True):
    out = jls.update_scale(s, finite)
    _state_dtypes_ok(out)
    assert not out.scale.weak_type


@pytest.mark.parametrize(
  ("bad", "error"),
  [
    ("8", TypeError),
    (None, TypeError),
    (True, TypeError),
    (float("nan"), ValueError),
    (float("inf"), ValueError),
    (-1.0, ValueError),
    (0.0, ValueError),
  ],
)
def test_bad_config_values_name_the_argument(bad, error):
  with pytest.raises(error, match="init_scale"):
    jls.dynamic_loss_scale(optax.sgd(1.0), init_scale=bad)


def test_integer_loss_is_rejected():
  # A single loss gets no location; a loss inside a tree is named by its path.
  with pytest.raises(ValueError, match=r"floating-point array, got dtype int32\. Scale only"):
    jls.scale_loss(jnp.asarray(3, jnp.int32), jls.DynamicScaleState.create())
  with pytest.raises(ValueError, match=r"got dtype int32 \(at loss\['n'\]\)\. Scale only"):
    jls.scale_loss({"l": jnp.float32(1), "n": jnp.int32(3)}, jls.DynamicScaleState.create())


# --- NaN loss on every step ---------------------------------------------------------


def test_nan_loss_on_every_step():
  tx = _tx(min_scale=1.0)
  params = {"w": jnp.asarray([1.0, -2.0, -0.0], jnp.float32)}  # -0.0 before every skip
  state = tx.init(params)

  @jax.jit
  def step(params, state):
    loss = lambda p: jnp.sum(p["w"]) * jnp.float32(jnp.nan)
    grads = jax.grad(lambda p: jls.scale_loss(loss(p), state))(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  first = (params, state)
  for _ in range(20):
    params, state = step(params, state)
  assert_bits_equal(params, first[0], structure=True)
  assert np.signbit(np.asarray(params["w"])[2])
  assert_bits_equal(state.inner_state, first[1].inner_state, structure=True)
  assert float(state.loss_scale.scale) == 1.0  # at the floor
  assert int(state.loss_scale.consecutive_skips) == 20
  with pytest.raises(jls.LossScaleError, match="20 consecutive steps skipped"):
    jls.check_skips(state, max_consecutive_skips=10)


# --- vmap over a batch of states ---------------------------------------------------


def test_vmap_over_a_batch_of_states():
  tx = _tx(growth_interval=2)
  n = 4
  params = {"w": jnp.tile(jnp.asarray([[1.0, 2.0]], jnp.float32), (n, 1))}
  states = jax.vmap(tx.init)(params)
  assert states.loss_scale.scale.shape == (n,)
  assert states.loss_scale.config == tx.init({"w": jnp.ones(2)}).loss_scale.config
  grads = {"w": jnp.asarray([[4.0, 4.0], [jnp.inf, 4.0], [4.0, jnp.nan], [8.0, 8.0]], jnp.float32)}
  update = jax.jit(jax.vmap(tx.update))
  updates, new = update(grads, states, params)
  np.testing.assert_array_equal(new.loss_scale.skipped_steps, [0, 1, 1, 0])
  np.testing.assert_array_equal(new.loss_scale.scale, [4.0, 2.0, 2.0, 4.0])
  for i in range(n):  # each member equals its own unbatched run
    one = jax.tree_util.tree_map(lambda x, i=i: x[i], (grads, states, params))
    u, s = tx.update(*one)
    assert_bits_equal(u, jax.tree_util.tree_map(lambda x, i=i: x[i], updates), structure=True)
    assert_bits_equal(s, jax.tree_util.tree_map(lambda x, i=i: x[i], new), structure=True)
  # The skipped members' params and inner state are untouched.
  new_params = optax.apply_updates(params, updates)
  for i in (1, 2):
    np.testing.assert_array_equal(
      np.asarray(new_params["w"][i]).view(np.uint32), np.asarray(params["w"][i]).view(np.uint32)
    )
  _state_dtypes_ok(new.loss_scale)
  rule = jax.vmap(jls.update_scale)(states.loss_scale, jnp.asarray([True, False, True, False]))
  np.testing.assert_array_equal(rule.scale, [4.0, 2.0, 4.0, 2.0])


# --- float64 under jax_enable_x64 (in a subprocess: the flag is process-wide) ----

_X64_SCRIPT = textwrap.dedent("""
    import jax
    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_numpy_dtype_promotion", "strict")
    import jax.numpy as jnp, numpy as np, optax
    import jax_lossscale as jls

    tx = jls.dynamic_loss_scale(optax.sgd(0.5, momentum=0.9), init_scale=2.0**10,
                                growth_interval=1, growth_factor=1.1, backoff_factor=0.3)
    params = {"w": jnp.asarray([1.0, -2.0], jnp.float64), "h": jnp.ones(2, jnp.float16)}
    state = tx.init(params)
    grads = {"w": jnp.asarray([3.0, 1e300], jnp.float64), "h": jnp.ones(2, jnp.float16)}
    for g in (grads, dict(grads, w=jnp.asarray([jnp.inf, 1.0], jnp.float64))):
      updates, state = jax.jit(tx.update)(g, state, params)
      params = optax.apply_updates(params, updates)
      ls = state.loss_scale
      assert ls.scale.dtype == jnp.float32, ls.scale.dtype
      for name in ("growth_tracker", "hysteresis_tracker", "skipped_steps",
                   "consecutive_skips"):
        assert getattr(ls, name).dtype == jnp.int32, name
      assert updates["w"].dtype == jnp.float64 and updates["h"].dtype == jnp.float16
      assert params["w"].dtype == jnp.float64
    # 1e300 is finite in float64: the first step applied, the second skipped.
    assert int(state.loss_scale.skipped_steps) == 1
    # torch's float32(float64(1024) * 1.1), then * 0.3
    want = np.float32(np.float64(np.float32(1024 * 1.1)) * 0.3)
    assert float(state.loss_scale.scale) == want, float(state.loss_scale.scale)
    assert np.all(np.isfinite(np.asarray(params["w"])))
    # scale_loss keeps a float64 loss in float64 (1/3 is not a float32)
    loss = jls.scale_loss(jnp.asarray(1.0 / 3.0, jnp.float64), state)
    assert loss.dtype == jnp.float64, loss.dtype
    assert float(loss) == (1.0 / 3.0) * float(state.loss_scale.scale), float(loss)
    print("x64 ok")
""")


def test_float64_with_x64_keeps_state_dtypes():
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
  proc = subprocess.run(
    [sys.executable, "-c", _X64_SCRIPT], env=env, capture_output=True, text=True, timeout=120
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "x64 ok" in proc.stdout


def test_float64_in_process_under_enable_x64():
  """The same promise in this process (``jax.enable_x64`` as a context), so that the
  mutation runner's coverage map sees these lines run with float64."""
  from jax_lossscale.flax import value_and_grad

  third = 1.0 / 3.0  # not a float32: any float32 round trip changes it
  with jax.enable_x64(True):
    tx = jls.dynamic_loss_scale(optax.sgd(1.0), init_scale=2.0**10)
    params = {"w": jnp.zeros(2, jnp.float64)}
    state = tx.init(params)
    loss = jls.scale_loss(jnp.asarray(third, jnp.float64), state)
    assert loss.dtype == jnp.float64 and float(loss) == third * 2.0**10
    grads = {"w": jnp.asarray([third * 2.0**10, 2.0**10], jnp.float64)}
    updates, state = tx.update(grads, state, params)
    assert updates["w"].dtype == jnp.float64
    np.testing.assert_array_equal(np.asarray(updates["w"]), [-third, -1.0])
    assert state.loss_scale.scale.dtype == jnp.float32
    assert state.loss_scale.growth_tracker.dtype == jnp.int32
    out = value_and_grad(lambda w: jnp.sum(w * third), state)(jnp.ones(2, jnp.float64))
    assert out.grads.dtype == jnp.float64
    np.testing.assert_array_equal(np.asarray(out.grads), [third, third])
