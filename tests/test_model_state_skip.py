"""A skipped step leaves the model's own state as it was: BatchNorm statistics and other collections.

For every route: ``jax_lossscale.flax.TrainState.apply_gradients`` (its extra fields), Flax's stock
``TrainState`` with the scaler in the optimizer, an ``nnx.Optimizer`` (``BatchStat`` variables) and
Equinox (``eqx.nn.State``), via :func:`jax_lossscale.keep_if_skipped`. Three ways to skip: an inf in
the input (the forward's statistics are NaN), an overflow in the backward only (the forward's
statistics are finite: ``replace_on_skip`` keeps them if asked), and a sharded model. The kept
state is bit-identical to the state before the step, and the second call of a jitted step does not
recompile.
"""

import contextlib
import pathlib
import sys

import equinox as eqx
from flax import nnx
from flax import struct
import flax.linen as nn
import flax.training.train_state
from helpers import assert_bits_equal
import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import jax_lossscale as jls
from jax_lossscale.flax import TrainState

ROOT = pathlib.Path(__file__).resolve().parents[1]
B, D = 8, 4


def assert_all_finite(tree):
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree_util.tree_leaves(tree))


class Net(nn.Module):
  """float16 compute, a BatchNorm and a second mutable collection (a batch counter)."""

  @nn.compact
  def __call__(self, x, train: bool = True):
    h = nn.Dense(8, dtype=jnp.float16)(x)
    h = nn.BatchNorm(use_running_average=not train, momentum=0.9)(h.astype(jnp.float32))
    seen = self.variable("counters", "seen", lambda: jnp.zeros([], jnp.float32))
    if train:
      seen.value = seen.value + jnp.sum(jnp.abs(x.astype(jnp.float32)))  # NaN with an inf
    return nn.Dense(1, dtype=jnp.float16)(nn.relu(h))


class BNState(TrainState):
  batch_stats: dict = struct.field(default_factory=dict)
  counters: dict = struct.field(default_factory=dict)


def _data(kind):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(B, D)).astype(np.float32)
  if kind == "inf_input":
    x[3, 1] = np.inf  # one inf pixel: the batch's statistics are NaN
  return jnp.asarray(x)


def _loss(pred, kind):
  pred = pred.astype(jnp.float32)
  if kind == "backward_overflow":
    # d(scale * sum(pred)) / d pred = 65536 in float16: inf in the backward only.
    return jnp.sum(pred)
  return jnp.mean(pred**2)


def _linen_state(**create):
  model = Net()
  variables = model.init(jax.random.key(0), jnp.ones((B, D)))
  state = BNState.create(
    apply_fn=model.apply,
    params=variables["params"],
    tx=optax.sgd(1e-2, momentum=0.9),
    batch_stats=variables["batch_stats"],
    counters=variables["counters"],
    **create,
  )
  return state


def _linen_step(kind, replace_on_skip=()):
  def step(state, x):
    def loss_fn(params):
      variables = {"params": params, "batch_stats": state.batch_stats, "counters": state.counters}
      pred, updates = state.apply_fn(variables, x, mutable=["batch_stats", "counters"])
      return _loss(pred, kind), updates

    out = state.value_and_grad(loss_fn, has_aux=True)(state.params)
    new = state.apply_gradients(
      grads=out.grads,
      finite=out.finite,
      batch_stats=out.aux["batch_stats"],
      counters=out.aux["counters"],
      replace_on_skip=replace_on_skip,
    )
    return new, out.aux

  return step


@pytest.mark.parametrize("kind", ["inf_input", "backward_overflow"])
def test_trainstate_skipped_step_keeps_batch_stats_and_every_collection(kind, maybe_jit):
  state = _linen_state()
  step = maybe_jit(_linen_step(kind))
  new, aux = step(state, _data(kind))
  assert int(new.dynamic_scale.skipped_steps) == 1 and int(new.step) == 0
  if kind == "inf_input":  # what the step would have written
    assert not bool(jnp.all(jnp.isfinite(aux["batch_stats"]["BatchNorm_0"]["mean"])))
  else:
    assert_all_finite(aux["batch_stats"])
  assert_bits_equal(new.batch_stats, state.batch_stats)
  assert_bits_equal(new.counters, state.counters)
  assert_bits_equal((new.params, new.opt_state), (state.params, state.opt_state))
  step(new, _data(kind))
  if hasattr(step, "_cache_size"):
    assert step._cache_size() == 1  # the skip is data, not a retrace
  # The next clean step takes its own statistics.
  clean, aux = maybe_jit(_linen_step("clean"))(new, _data("clean"))
  assert int(clean.step) == 1
  assert_bits_equal(clean.batch_stats, aux["batch_stats"])
  assert_bits_equal(clean.counters, aux["counters"])


def test_replace_on_skip_keeps_the_statistics_of_a_finite_forward(maybe_jit):
  """The opt-out: a batch whose backward overflowed still updates the running statistics."""
  state = _linen_state()
  step = maybe_jit(_linen_step("backward_overflow", replace_on_skip=("batch_stats",)))
  new, aux = step(state, _data("backward_overflow"))
  assert int(new.dynamic_scale.skipped_steps) == 1
  assert_bits_equal(new.batch_stats, aux["batch_stats"])  # taken although skipped
  assert not np.array_equal(
    np.asarray(new.batch_stats["BatchNorm_0"]["mean"]),
    np.asarray(state.batch_stats["BatchNorm_0"]["mean"]),
  )
  assert_bits_equal(new.counters, state.counters)  # not named: kept
  assert_bits_equal(new.params, state.params)
  # A single name as a string.
  one = maybe_jit(_linen_step("backward_overflow", replace_on_skip="batch_stats"))
  assert_bits_equal(one(state, _data("backward_overflow"))[0].batch_stats, aux["batch_stats"])


def test_replace_on_skip_takes_the_nan_statistics_of_an_inf_input_as_documented(maybe_jit):
  """``replace_on_skip`` is for backward overflows: an inf input's NaN statistics are taken
  too (what the docs say, next to the option)."""
  state = _linen_state()
  new, aux = maybe_jit(_linen_step("inf_input", replace_on_skip="batch_stats"))(
    state, _data("inf_input")
  )
  assert int(new.dynamic_scale.skipped_steps) == 1
  assert_bits_equal(new.params, state.params)
  assert_bits_equal(new.batch_stats, aux["batch_stats"])
  assert not bool(jnp.isfinite(new.batch_stats["BatchNorm_0"]["mean"]).all())  # inf/NaN taken
  said = "a batch with an inf or NaN *input* writes its NaN statistics in"
  for page in ("flax-linen.md", "flax-dynamic-scale.md"):
    text = " ".join((ROOT / "docs" / "guides" / page).read_text().split())
    assert said in text, page
  doc = " ".join(TrainState.apply_gradients.__doc__.split())
  assert "Only for backward overflows" in doc and "writes its NaN statistics in" in doc


def test_replace_on_skip_and_field_mismatches_are_refused():
  state = _linen_state()
  grads = jax.tree.map(jnp.zeros_like, state.params)
  with pytest.raises(ValueError, match=r"replace_on_skip names \['batch_stat'\]"):
    state.apply_gradients(grads=grads, batch_stats=state.batch_stats, replace_on_skip="batch_stat")
  with pytest.raises(TypeError, match="replace_on_skip must be a field name"):
    state.apply_gradients(grads=grads, batch_stats=state.batch_stats, replace_on_skip=1)
  half = jax.tree.map(lambda a: a.astype(jnp.float16), state.batch_stats)
  with pytest.raises(ValueError, match=r"batch_stats\['BatchNorm_0'\]\['mean'\].*float16"):
    state.apply_gradients(grads=grads, batch_stats=half)
  with pytest.raises(ValueError, match="batch_stats: the new value's structure"):
    state.apply_gradients(grads=grads, batch_stats={})
  # Refused even on a finite step: the check is on types, never on the traced decision.
  assert int(state.apply_gradients(grads=grads, batch_stats=state.batch_stats).step) == 1


def test_a_finite_step_replaces_the_fields_as_before():
  state = _linen_state()
  new, aux = jax.jit(_linen_step("clean"))(state, _data("clean"))
  assert int(new.step) == 1
  assert_bits_equal(new.batch_stats, aux["batch_stats"])
  assert_bits_equal(new.counters, aux["counters"])


def test_stock_trainstate_with_the_scaler_in_the_optimizer(maybe_jit):
  """Flax's own TrainState: ``keep_if_skipped`` after ``apply_gradients``."""
  model = Net()
  variables = model.init(jax.random.key(0), jnp.ones((B, D)))

  class Stock(flax.training.train_state.TrainState):
    batch_stats: dict

  state = Stock.create(
    apply_fn=model.apply,
    params=variables["params"],
    tx=jls.dynamic_loss_scale(optax.sgd(1e-2, momentum=0.9)),
    batch_stats=variables["batch_stats"],
  )

  def step(state, x):
    def loss_fn(params):
      pred, upd = state.apply_fn(
        {"params": params, "batch_stats": state.batch_stats, "counters": variables["counters"]},
        x,
        mutable=["batch_stats", "counters"],
      )
      return jls.scale_loss(_loss(pred, "inf_input"), state), upd["batch_stats"]

    grads, stats = jax.grad(loss_fn, has_aux=True)(state.params)
    new = state.apply_gradients(grads=grads)
    return new.replace(batch_stats=jls.keep_if_skipped(new, stats, state.batch_stats))

  step = maybe_jit(step)
  new = step(state, _data("inf_input"))
  assert bool(jls.metrics(new)["last_step_skipped"])
  assert_bits_equal(new.batch_stats, state.batch_stats)
  clean = step(new, _data("clean"))
  assert not bool(jls.metrics(clean)["last_step_skipped"])
  assert_all_finite(clean.batch_stats)
  assert not np.array_equal(
    np.asarray(clean.batch_stats["BatchNorm_0"]["var"]),
    np.asarray(state.batch_stats["BatchNorm_0"]["var"]),
  )


def test_keep_if_skipped_reads_the_decision_and_checks_its_arguments():
  tx = jls.dynamic_loss_scale(optax.sgd(0.1))
  opt_state = tx.init({"w": jnp.zeros(2)})
  old = {"m": jnp.array([-0.0, 1e-40], jnp.float32), "n": jnp.int32(3)}
  new = {"m": jnp.array([jnp.nan, 2.0], jnp.float32), "n": jnp.int32(4)}
  _, skipped = tx.update({"w": jnp.array([jnp.inf, 0.0])}, opt_state)
  assert_bits_equal(jls.keep_if_skipped(skipped, new, old), old)  # -0.0 and the subnormal
  _, applied = tx.update({"w": jnp.ones(2)}, skipped)
  assert_bits_equal(jls.keep_if_skipped(applied, new, old), new)
  assert_bits_equal(jax.jit(jls.keep_if_skipped)(skipped, new, old), old)
  with pytest.raises(ValueError, match=r"new\['n'\]: the new value is int16"):
    jls.keep_if_skipped(skipped, {**new, "n": jnp.int16(4)}, old)
  with pytest.raises(ValueError, match="No DynamicScaleState"):
    jls.keep_if_skipped({"not": jnp.zeros(())}, new, old)
  with pytest.raises(ValueError, match="a leaf that is not an array changed"):
    jls.keep_if_skipped(skipped, {"f": "relu"}, {"f": "gelu"})
  assert jls.keep_if_skipped(skipped, {"f": "relu"}, {"f": "relu"}) == {"f": "relu"}


# NNX: BatchStat variables.


class NNXNet(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(D, 8, dtype=jnp.float16, rngs=rngs)
    self.bn = nnx.BatchNorm(8, momentum=0.9, rngs=rngs)
    self.l2 = nnx.Linear(8, 1, dtype=jnp.float16, rngs=rngs)

  def __call__(self, x):
    return self.l2(nnx.relu(self.bn(self.l1(x).astype(jnp.float32))))


@pytest.mark.parametrize("kind", ["inf_input", "backward_overflow"])
def test_nnx_skipped_step_keeps_batch_stats(kind):
  model = NNXNet(nnx.Rngs(0))
  optimizer = nnx.Optimizer(
    model, jls.dynamic_loss_scale(optax.sgd(1e-2, momentum=0.9)), wrt=nnx.Param
  )

  def make_step(kind):
    @nnx.jit
    def train_step(model, optimizer, x):
      before = nnx.clone(nnx.state(model, nnx.BatchStat))  # a copy: the forward pass mutates
      grads = nnx.grad(lambda m: jls.scale_loss(_loss(m(x), kind), optimizer.opt_state))(model)
      optimizer.update(model, grads)
      after = nnx.state(model, nnx.BatchStat)
      written = nnx.clone(after)  # what the forward pass wrote (nnx.update writes `after`)
      nnx.update(model, jls.keep_if_skipped(optimizer.opt_state, after, before))
      return written

    return train_step

  train_step = make_step(kind)
  stats0 = jax.tree.map(jnp.copy, nnx.state(model, nnx.BatchStat))
  params0 = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
  written = train_step(model, optimizer, _data(kind))
  assert bool(jls.metrics(optimizer.opt_state)["last_step_skipped"])
  if kind == "inf_input":
    assert not bool(jnp.all(jnp.isfinite(written["bn"]["mean"][...])))
  assert_bits_equal(nnx.state(model, nnx.BatchStat), stats0)
  assert_bits_equal(nnx.state(model, nnx.Param), params0)
  make_step("clean")(model, optimizer, _data("clean"))
  assert not bool(jls.metrics(optimizer.opt_state)["last_step_skipped"])
  assert_all_finite(nnx.state(model, nnx.BatchStat))
  assert not np.array_equal(np.asarray(model.bn.mean[...]), np.asarray(stats0["bn"]["mean"][...]))


# Equinox: eqx.nn.State.


@pytest.mark.parametrize("kind", ["inf_input", "backward_overflow"])
def test_equinox_skipped_step_keeps_the_state(kind, maybe_jit):
  key = jax.random.key(0)
  model, state = eqx.nn.make_with_state(eqx.nn.Sequential)(
    [
      eqx.nn.Linear(D, 8, key=key),
      eqx.nn.BatchNorm(8, axis_name="batch", momentum=0.9, mode="batch"),
      eqx.nn.Linear(8, 1, key=key),
    ]
  )
  tx = jls.dynamic_loss_scale(optax.sgd(1e-2, momentum=0.9))
  opt_state = tx.init(eqx.filter(model, eqx.is_array))

  def train_step(model, state, opt_state, x, kind):
    def scaled_loss(model):
      pred, new_state = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
        x, state
      )
      return jls.scale_loss(_loss(pred.astype(jnp.float16), kind), opt_state), new_state

    grads, new_state = eqx.filter_grad(scaled_loss, has_aux=True)(model)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    state = jls.keep_if_skipped(opt_state, new_state, state)
    return eqx.apply_updates(model, updates), state, opt_state

  step = eqx.filter_jit(train_step) if maybe_jit is jax.jit else train_step
  new_model, new_state, opt_state = step(model, state, opt_state, _data(kind), kind)
  assert bool(jls.metrics(opt_state)["last_step_skipped"])
  assert_bits_equal(new_state, state)
  assert_bits_equal(eqx.filter(new_model, eqx.is_array), eqx.filter(model, eqx.is_array))
  _, clean_state, opt_state = step(new_model, new_state, opt_state, _data("clean"), "clean")
  assert not bool(jls.metrics(opt_state)["last_step_skipped"])
  assert_all_finite(clean_state)
  assert not all(
    np.array_equal(a, b)
    for a, b in zip(jax.tree_util.tree_leaves(clean_state), jax.tree_util.tree_leaves(state))
  )


# A sharded model: 8 devices, the batch split over them, BatchNorm's statistics replicated.

N_DEV = 8


@pytest.mark.skipif(jax.device_count() < N_DEV, reason="needs 8 devices (conftest)")
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
@pytest.mark.parametrize("kind", ["inf_input", "backward_overflow"])
def test_sharded_trainstate_skip_keeps_batch_stats_and_their_sharding(kind, axis_type):
  mesh = jax.make_mesh((N_DEV,), ("data",), axis_types=(axis_type,))
  in_mesh = jax.set_mesh(mesh) if axis_type == AxisType.Explicit else contextlib.nullcontext()
  with in_mesh:
    state = _linen_state()
    # Replicated with the spec jit gives back (P(None,) under Explicit axes, P() under Auto),
    # so that a recompilation can only come from the step itself.
    spec = (lambda a: P(*[None] * a.ndim)) if axis_type == AxisType.Explicit else (lambda a: P())
    state = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, spec(a))), state)
    x = jax.device_put(
      jnp.tile(_data(kind), (N_DEV, 1)), NamedSharding(mesh, P("data", None))
    )  # the inf lands on one device's shard
    step = jax.jit(_linen_step(kind))
    new, _ = step(state, x)
    assert int(new.dynamic_scale.skipped_steps) == 1
    assert_bits_equal(new.batch_stats, state.batch_stats)
    assert_bits_equal(new.counters, state.counters)
    assert_bits_equal(new.params, state.params)
    for a, b in zip(jax.tree.leaves(new.batch_stats), jax.tree.leaves(state.batch_stats)):
      assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
    step(new, x)
    assert step._cache_size() == 1
    clean_x = jax.device_put(jnp.tile(_data("clean"), (N_DEV, 1)), x.sharding)
    clean, aux = jax.jit(_linen_step("clean"))(new, clean_x)
    assert int(clean.step) == 1
    assert_bits_equal(clean.batch_stats, aux["batch_stats"])


def test_a_field_that_was_none_says_how_to_fix_it():
  class Lazy(TrainState):
    batch_stats: dict | None = None

  state = Lazy.create(apply_fn=None, params=jnp.ones(2), tx=optax.sgd(0.1))
  stats = {"mean": jnp.zeros(2)}
  with pytest.raises(ValueError, match=r"initial value in TrainState\.create.*replace_on_skip"):
    state.apply_gradients(grads=jnp.ones(2), batch_stats=stats)
  new = state.apply_gradients(grads=jnp.ones(2), batch_stats=stats, replace_on_skip="batch_stats")
  assert new.batch_stats is stats


@pytest.mark.slow
def test_the_inf_pixel_benchmark_keeps_the_statistics_only_with_the_guard(monkeypatch):
  """``benchmarks/inf_pixel_batchnorm.py`` in miniature: the two arms differ as its results say."""
  import importlib.util
  import pathlib

  pytest.importorskip("sklearn")
  path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "inf_pixel_batchnorm.py"
  spec = importlib.util.spec_from_file_location("inf_pixel_batchnorm", path)
  bench = importlib.util.module_from_spec(spec)
  monkeypatch.setitem(sys.modules, spec.name, bench)  # its dataclasses look their module up
  spec.loader.exec_module(bench)
  with jax.numpy_dtype_promotion("standard"):  # Flax's float16 BatchNorm is not strict-clean
    guard = bench.run(0, True, clean_steps=3, after_steps=2, batch=16)
    no_guard = bench.run(0, False, clean_steps=3, after_steps=2, batch=16)
  assert guard["stats_kept"] and guard["stats_finite"]
  assert not no_guard["stats_kept"] and not no_guard["stats_finite"]
  assert no_guard["after"] == pytest.approx(0.1, abs=0.02)  # one class for every image
