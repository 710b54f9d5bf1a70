"""Flax linen: the ``dynamic_scale`` TrainState field, scaled value_and_grad, stock TrainState."""

import dataclasses

from flax import struct
import flax.linen as nn
from flax.training import train_state
from helpers import assert_bits_equal
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import jax_lossscale as jls
from jax_lossscale.flax import TrainState
from jax_lossscale.flax import value_and_grad


def _close(a, b, rtol=1e-6):
  assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=1e-7)


class MLP(nn.Module):
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(8, dtype=self.dtype)(x)
    x = nn.relu(x)
    return nn.Dense(1, dtype=self.dtype)(x)


def _data():
  x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 4)), jnp.float32)
  return x, jnp.sum(x, axis=1, keepdims=True)


# -- value_and_grad --------------------------------------------------------------


def test_value_and_grad_matches_unscaled_gradients(maybe_jit):
  ds = jls.DynamicScaleState.create(init_scale=2.0**12)
  w = jnp.asarray([0.5, -1.5, 3.0], jnp.float32)
  x = jnp.asarray([1.0, 2.0, 4.0], jnp.float32)

  def loss_fn(w, x):
    return jnp.sum((w * x) ** 2), {"pred": w * x}

  out = maybe_jit(value_and_grad(loss_fn, ds, has_aux=True))(w, x)
  (ref_loss, ref_aux), ref_grads = jax.value_and_grad(loss_fn, has_aux=True)(w, x)
  # The scale is a power of two: unscaled gradients equal the true ones bit for bit.
  assert_bits_equal(out.grads, ref_grads, structure=True, dtypes=True)
  assert_bits_equal(out.value, ref_loss, structure=True, dtypes=True)  # the loss, not loss * scale
  assert_bits_equal(out.aux, ref_aux, structure=True, dtypes=True)  # aux is never scaled
  assert out.finite.dtype == jnp.bool_ and bool(out.finite)


def test_value_and_grad_argnums_and_overflow(maybe_jit):
  ds = jls.DynamicScaleState.create(init_scale=2.0**10)
  f = lambda a, b: jnp.sum(a * b)
  out = maybe_jit(value_and_grad(f, ds, argnums=(0, 1)))(
    jnp.ones(2, jnp.float32), jnp.asarray([2.0, 3.0], jnp.float32)
  )
  assert out.aux is None
  np.testing.assert_array_equal(out.grads[0], [2.0, 3.0])
  np.testing.assert_array_equal(out.grads[1], [1.0, 1.0])
  assert bool(out.finite)
  bad = maybe_jit(value_and_grad(f, ds, argnums=(0, 1)))(
    jnp.ones(2, jnp.float32), jnp.asarray([jnp.inf, 3.0], jnp.float32)
  )
  assert not bool(bad.finite)


def test_value_and_grad_half_precision_overflow_is_caught():
  # float16 compute: the scaled cotangent 2**17 overflows float16 in the backward pass.
  f = lambda w: jnp.sum(w.astype(jnp.float16) * jnp.float16(3.0)).astype(jnp.float32)
  w = jnp.ones(3, jnp.float16)
  too_big = value_and_grad(f, jls.DynamicScaleState.create(init_scale=2.0**17))(w)
  assert not bool(too_big.finite)
  ok = value_and_grad(f, jls.DynamicScaleState.create(init_scale=2.0**10))(w)
  assert bool(ok.finite)
  assert ok.grads.dtype == jnp.float32  # unscaled in float32, not float16
  np.testing.assert_array_equal(ok.grads, [3.0, 3.0, 3.0])


def test_value_and_grad_axis_name_skips_on_every_device():
  mesh = Mesh(np.array(jax.devices()[:8]), ("batch",))
  ds = jls.DynamicScaleState.create(init_scale=2.0**8)
  w = jnp.ones(3, jnp.float32)

  def per_device(w, x):
    out = value_and_grad(lambda w: jnp.sum(w * x), ds, axis_name="batch")(w)
    return out.grads[None], out.finite[None]

  # check_vma=False: per-device gradients, as under pmap (with check_vma JAX itself
  # already sums the cotangent of the replicated ``w`` across devices).
  f = jax.jit(
    jax.shard_map(
      per_device,
      mesh=mesh,
      in_specs=(P(), P("batch")),
      out_specs=P("batch"),
      check_vma=False,
    )
  )
  x = jnp.arange(24, dtype=jnp.float32).reshape(8, 3)
  grads, finite = f(w, x)
  # pmean over devices: every device holds the mean gradient.
  np.testing.assert_allclose(grads, np.broadcast_to(np.mean(np.asarray(x), 0), (8, 3)))
  assert np.all(np.asarray(finite))
  x = x.at[5, 1].set(jnp.inf)  # one device overflows: all skip together
  _, finite = f(w, x)
  assert not np.any(np.asarray(finite))


def test_value_and_grad_rejects_bad_arguments():
  ds = jls.DynamicScaleState.create()
  with pytest.raises(TypeError, match="fun must be callable"):
    value_and_grad(3.0, ds)
  with pytest.raises(ValueError, match="No DynamicScaleState"):
    value_and_grad(jnp.sum, {"not": jnp.zeros(1)})
  with pytest.raises(TypeError, match="has_aux=True"):
    value_and_grad(jnp.sum, ds, has_aux=True)(jnp.ones(2, jnp.float32))


# -- jax_lossscale.flax.TrainState ----------------------------------------------


def _linen_state(tx, dtype=jnp.float32, **kwargs):
  x, _ = _data()
  model = MLP(dtype=dtype)
  params = model.init(jax.random.key(0), x)["params"]
  params = jax.tree_util.tree_map(lambda p: p.astype(dtype), params)
  return TrainState.create(apply_fn=model.apply, params=params, tx=tx, **kwargs)


def _train_step(state, x, y):
  def loss_fn(params):
    pred = state.apply_fn({"params": params}, x)
    return jnp.mean((pred.astype(jnp.float32) - y) ** 2)

  out = state.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=out.grads, finite=out.finite), out.value


def test_trainstate_create_and_fields():
  state = _linen_state(optax.sgd(0.1))
  assert state.step.dtype == jnp.int32 and int(state.step) == 0
  assert isinstance(state.dynamic_scale, jls.DynamicScaleState)
  assert float(state.dynamic_scale.scale) == 2.0**16
  assert isinstance(state, train_state.TrainState)
  custom = jls.DynamicScaleState.create(init_scale=8.0, growth_interval=3)
  state = _linen_state(optax.sgd(0.1), dynamic_scale=custom)
  assert jls.get_scale_state(state) is state.dynamic_scale
  assert jls.get_scale_state(state).config.growth_interval == 3


def test_trainstate_rejects_double_scaling_and_bad_args():
  with pytest.raises(ValueError, match="already holds a loss scaler"):
    _linen_state(jls.dynamic_loss_scale(optax.sgd(0.1)))
  with pytest.raises(TypeError, match="dynamic_scale must be a DynamicScaleState"):
    _linen_state(optax.sgd(0.1), dynamic_scale=65536.0)
  state = _linen_state(optax.sgd(0.1))
  with pytest.raises(ValueError, match="finite must be a boolean scalar"):
    state.apply_gradients(grads=state.params, finite=jnp.ones(2, jnp.bool_))


def test_trainstate_finite_step_matches_stock_trainstate():
  tx = optax.sgd(0.05, momentum=0.9)
  ours = _linen_state(tx, dynamic_scale=jls.DynamicScaleState.create(init_scale=2.0**8))
  stock = train_state.TrainState.create(apply_fn=ours.apply_fn, params=ours.params, tx=tx)
  x, y = _data()
  step = jax.jit(_train_step)
  for _ in range(3):
    ours, loss = step(ours, x, y)

    def loss_fn(params, apply_fn=stock.apply_fn):
      return jnp.mean((apply_fn({"params": params}, x) - y) ** 2)

    ref_loss, grads = jax.value_and_grad(loss_fn)(stock.params)
    stock = stock.apply_gradients(grads=grads)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  # Power-of-two scale: unscaled gradients are exact, so training is identical.
  _close(ours.params, stock.params)
  assert int(ours.step) == 3 and int(jls.metrics(ours)["skipped_steps"]) == 0


def test_trainstate_skipped_step_is_bit_identical():
  with jax.numpy_dtype_promotion("standard"):  # optax.adam is not strict-promotion clean
    state = _linen_state(
      optax.adam(1e-2),
      dynamic_scale=jls.DynamicScaleState.create(init_scale=2.0**10, growth_interval=2),
    )
    x, y = _data()
    step = jax.jit(_train_step)  # (eager linen + Adam is slow; eager is covered below)
    state, _ = step(state, x, y)  # a real step first: non-trivial Adam state
    bad_x = x.at[3, 2].set(jnp.nan)
    new, loss = step(state, bad_x, y)
  assert not np.isfinite(float(loss))
  assert_bits_equal(new.params, state.params, structure=True, dtypes=True)
  assert_bits_equal(new.opt_state, state.opt_state, structure=True, dtypes=True)
  assert_bits_equal(new.step, state.step, structure=True, dtypes=True)
  expected = jls.update_scale(state.dynamic_scale, False)
  assert_bits_equal(new.dynamic_scale, expected, structure=True, dtypes=True)
  assert float(new.dynamic_scale.scale) == 2.0**9
  m = jls.metrics(new)
  assert bool(m["last_step_skipped"]) and int(m["skipped_steps"]) == 1


def test_trainstate_computes_finite_when_not_given():
  state = _linen_state(optax.sgd(0.1))
  bad = jax.tree_util.tree_map(lambda p: jnp.full_like(p, jnp.inf), state.params)
  new = jax.jit(lambda s, g: s.apply_gradients(grads=g))(state, bad)
  assert_bits_equal(new.params, state.params, structure=True, dtypes=True)
  assert int(new.step) == 0 and int(new.dynamic_scale.skipped_steps) == 1


def test_trainstate_no_recompilation_across_skips():
  state = _linen_state(
    optax.sgd(0.1), dynamic_scale=jls.DynamicScaleState.create(init_scale=2.0**4, growth_interval=2)
  )
  x, y = _data()
  step = jax.jit(lambda *a: _train_step(*a))  # a fresh function: its own jit cache
  scales = []
  for i in range(6):
    state, _ = step(state, x.at[0, 0].set(jnp.inf) if i == 2 else x, y)
    scales.append(float(state.dynamic_scale.scale))
  assert step._cache_size() == 1
  assert scales == [16.0, 32.0, 16.0, 16.0, 32.0, 32.0]
  assert int(state.step) == 5


def test_trainstate_half_precision_params_keep_dtype():
  # float16 params: tx state is float32, params stay float16, an overflow is skipped.
  state = _linen_state(
    optax.sgd(0.01, momentum=0.9),
    dtype=jnp.float16,
    dynamic_scale=jls.DynamicScaleState.create(init_scale=2.0**24),
  )
  assert all(p.dtype == jnp.float16 for p in jax.tree_util.tree_leaves(state.params))
  assert all(s.dtype == jnp.float32 for s in jax.tree_util.tree_leaves(state.opt_state))
  x, y = _data()
  step = jax.jit(_train_step)
  before = state
  state, _ = step(state, x, y)  # 2**24 overflows the float16 backward pass
  assert_bits_equal(state.params, before.params, structure=True, dtypes=True)
  assert float(state.dynamic_scale.scale) == 2.0**23
  for _ in range(12):
    state, _ = step(state, x, y)
  assert int(state.step) > 0  # the scale came down far enough for real steps
  assert all(p.dtype == jnp.float16 for p in jax.tree_util.tree_leaves(state.params))
  assert all(s.dtype == jnp.float32 for s in jax.tree_util.tree_leaves(state.opt_state))


# -- stock flax TrainState with the scaler inside the optimizer ---------------------


def test_stock_trainstate_with_dynamic_loss_scale(maybe_jit):
  x, y = _data()
  model = MLP()
  params = model.init(jax.random.key(0), x)["params"]
  tx = jls.dynamic_loss_scale(optax.sgd(0.1), init_scale=2.0**10, growth_interval=2)
  state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

  def train_step(state, x, y):
    def loss_fn(params):
      loss = jnp.mean((state.apply_fn({"params": params}, x) - y) ** 2)
      return jls.scale_loss(loss, state), loss  # the one call that reads the scale

    (_, loss), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads), loss

  step = maybe_jit(train_step)
  new, _loss = step(state, x, y)
  _, ref_grads = jax.value_and_grad(lambda p: jnp.mean((model.apply({"params": p}, x) - y) ** 2))(
    params
  )
  ref = optax.apply_updates(
    params, optax.sgd(0.1).update(ref_grads, optax.sgd(0.1).init(params))[0]
  )
  _close(new.params, ref)
  assert int(jls.metrics(new)["growth_tracker"]) == 1
  skipped, _ = step(new, x.at[1, 1].set(jnp.inf), y)
  assert_bits_equal(skipped.params, new.params, structure=True, dtypes=True)
  assert_bits_equal(
    skipped.opt_state.inner_state, new.opt_state.inner_state, structure=True, dtypes=True
  )
  assert float(jls.get_scale_state(skipped).scale) == 2.0**9
  # Flax's own ``step`` counts calls; the optimizer's state did not advance.
  assert int(skipped.step) == 2


def test_create_passes_dynamic_false_to_the_config():
  ds = jls.DynamicScaleState.create(init_scale=8.0, dynamic=False)
  assert ds.config.dynamic is False
  assert jls.DynamicScaleState.create(init_scale=8.0).config.dynamic is True
  # A static scaler keeps its scale after growth_interval finite steps.
  state = TrainState.create(
    apply_fn=None,
    params={"w": jnp.ones(2)},
    tx=optax.sgd(0.1),
    dynamic_scale=jls.DynamicScaleState.create(init_scale=8.0, growth_interval=1, dynamic=False),
  )
  new = state.apply_gradients(grads={"w": jnp.ones(2)})
  assert float(new.dynamic_scale.scale) == 8.0
  np.testing.assert_array_equal(new.params["w"], np.full(2, np.float32(1) - np.float32(0.1)))


def test_value_and_grad_forwards_keyword_arguments():
  ds = jls.DynamicScaleState.create(init_scale=1024.0)
  loss_fn = lambda w, *, k=1.0: k * jnp.sum(w**2)
  out = value_and_grad(loss_fn, ds)(jnp.array([1.0, 2.0]), k=3.0)
  assert float(out.value) == 15.0
  np.testing.assert_array_equal(out.grads, np.array([6.0, 12.0], np.float32))


class _StateWithFields(TrainState):
  extra: int = struct.field(pytree_node=False, default=0)
  batch_stats: dict = struct.field(default_factory=dict)


def test_create_passes_subclass_fields_through():
  state = _StateWithFields.create(
    apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd(0.1), extra=7
  )
  assert state.extra == 7


def test_a_subclass_passes_its_dataclass_options_to_flax_struct():
  class KwOnlyState(TrainState, kw_only=True):
    batch_stats: dict

  kw_only = [f.name for f in dataclasses.fields(KwOnlyState) if f.kw_only]
  assert kw_only == ["batch_stats"]
  state = KwOnlyState.create(
    apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd(0.1), batch_stats={"m": 1}
  )
  assert state.batch_stats == {"m": 1}


def test_create_without_a_dynamic_scale_uses_torchs_defaults():
  state = TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd(0.1))
  assert float(state.dynamic_scale.scale) == 2.0**16
  assert state.dynamic_scale.config == jls.DynamicScaleState.create().config


def test_the_states_value_and_grad_passes_argnums():
  state = TrainState.create(
    apply_fn=None,
    params={"w": jnp.ones(2)},
    tx=optax.sgd(0.1),
    dynamic_scale=jls.DynamicScaleState.create(init_scale=8.0),
  )
  f = lambda p, x: jnp.sum(p["w"] * x**2)
  out = state.value_and_grad(f, argnums=1)(state.params, jnp.array([1.0, 3.0]))
  np.testing.assert_array_equal(out.grads, np.array([2.0, 6.0], np.float32))


@pytest.mark.parametrize("replace_on_skip", [(), ("batch_stats",)], ids=["default", "opt-out"])
@pytest.mark.parametrize("g", [1.0, float("inf")], ids=["finite", "skipped"])
def test_apply_gradients_replaces_other_fields_unless_the_step_is_skipped(g, replace_on_skip):
  """Other fields are replaced on a finite step and kept on a skipped one (the model state
  stays with the params), unless named in ``replace_on_skip``."""
  state = _StateWithFields.create(
    apply_fn=None,
    params={"w": jnp.ones(2)},
    tx=optax.sgd(0.5),
    batch_stats={"mean": jnp.zeros(2)},
  )
  new = state.apply_gradients(
    grads={"w": jnp.full(2, g)}, batch_stats={"mean": jnp.ones(2)}, replace_on_skip=replace_on_skip
  )
  replaced = g == 1.0 or bool(replace_on_skip)
  np.testing.assert_array_equal(new.batch_stats["mean"], np.full(2, float(replaced), np.float32))
  assert int(new.step) == (1 if g == 1.0 else 0)


def test_apply_gradients_keeps_a_frozen_param_without_a_gradient():
  params = {"w": jnp.ones(2, jnp.float16), "frozen": jnp.full(3, 7.0)}
  state = TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.5))
  new = state.apply_gradients(grads={"w": jnp.full(2, 2.0, jnp.float32), "frozen": None})
  assert new.params["w"].dtype == jnp.float16
  np.testing.assert_array_equal(new.params["w"], np.zeros(2, np.float16))
  np.testing.assert_array_equal(new.params["frozen"], np.full(3, 7.0, np.float32))
