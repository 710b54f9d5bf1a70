"""Many devices, one decision: every device skips together, scale states agree.

Eight CPU devices (conftest). The model is chosen so that its gradients are
exact in float32 whatever the reduction order (small integer data, power-of-two
scales), so sharded runs can be compared bit for bit with one device running
the same global batch. The sharded runs use both mesh axis types: Explicit
(``jax.make_mesh``'s default since JAX 0.7, under ``jax.set_mesh``) and Auto.
Many processes: tests/test_multiprocess.py.
"""

import contextlib
import importlib
import warnings

from helpers import assert_bits_equal
import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import jax_lossscale as jls

N_DEV = 8
D, K, B = 16, 4, 32  # features (sharded by FSDP), outputs, global batch
STEPS = 8
BAD_STEPS = {2: np.inf, 3: np.nan, 4: -np.inf}  # step -> value injected
BAD_ROW, BAD_COL = 9, 13  # batch row (device 2's data shard), feature (device 6's params)

# Written out by hand from the rule (init 2**10, growth_interval 2, hysteresis 2,
# backoff 0.5, growth 2; overflows at steps 2, 3, 4): (scale, growth_tracker,
# hysteresis_tracker, skipped_steps, consecutive_skips) after each step.
EXPECTED_TRAJECTORY = [
  (1024.0, 1, 2, 0, 0),  # clean
  (2048.0, 0, 2, 0, 0),  # clean: 2nd in a row, grows; hysteresis refilled
  (2048.0, 0, 1, 1, 1),  # overflow absorbed by hysteresis: skipped, scale kept
  (1024.0, 0, 0, 2, 2),  # overflow: hysteresis spent, backs off
  (512.0, 0, 0, 3, 3),  # overflow: backs off again (tracker stays at 0)
  (512.0, 1, 0, 3, 0),  # clean
  (1024.0, 0, 2, 3, 0),  # clean: grows, hysteresis refilled
  (1024.0, 1, 2, 3, 0),  # clean
]

pytestmark = pytest.mark.skipif(
  jax.device_count() < N_DEV, reason="needs 8 devices (set by conftest)"
)

AXIS_TYPES = [
  pytest.param(AxisType.Explicit, id="explicit"),
  pytest.param(AxisType.Auto, id="auto"),
]


def _mesh(axis_type):
  return Mesh(np.array(jax.devices()[:N_DEV]), ("d",), axis_types=(axis_type,))


def _in_mesh(mesh):
  """``jax.set_mesh(mesh)`` for Explicit axes (where users need it), a no-op for Auto."""
  if mesh.axis_types[0] == AxisType.Explicit:
    return jax.set_mesh(mesh)
  return contextlib.nullcontext()


def _shard_map_impls():
  """``jax.shard_map`` (jax >= 0.7) and the older ``jax.experimental.shard_map``."""
  impls = []
  if hasattr(jax, "shard_map"):
    impls.append(pytest.param(jax.shard_map, id="jax.shard_map"))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    try:
      experimental = importlib.import_module("jax.experimental.shard_map").shard_map
    except (ImportError, AttributeError):
      experimental = None
  if experimental is not None:
    impls.append(pytest.param(experimental, id="jax.experimental.shard_map"))
  return impls


def _make_tx(axis_name=None):
  return jls.dynamic_loss_scale(
    optax.sgd(2.0**-6, momentum=0.5),
    init_scale=2.0**10,
    growth_interval=2,
    hysteresis=2,
    axis_name=axis_name,
  )


def _data():
  rng = np.random.default_rng(0)
  xs = rng.integers(-3, 4, size=(STEPS, B, D)).astype(np.float32)
  for step, value in BAD_STEPS.items():
    xs[step, BAD_ROW, BAD_COL] = value
  w = (rng.integers(-8, 8, size=(D, K)) / 8).astype(np.float32)
  return jnp.asarray(xs), {"w": jnp.asarray(w)}


def _loss(params, x):
  return jnp.sum(x @ params["w"]) + 0.5 * jnp.sum(params["w"] ** 2)


def _jit_step(tx):
  def step(params, opt_state, x):
    grads = jax.grad(lambda p: jls.scale_loss(_loss(p, x), opt_state))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return jax.jit(step)


def _scale_fields(s):
  return (
    float(s.scale),
    int(s.growth_tracker),
    int(s.hysteresis_tracker),
    int(s.skipped_steps),
    int(s.consecutive_skips),
  )


def _run_single_device():
  xs, params = _data()
  tx = _make_tx()
  opt_state = tx.init(params)
  step = _jit_step(tx)
  trajectory = []
  for x in xs:
    params, opt_state = step(params, opt_state, x)
    trajectory.append(_scale_fields(opt_state.loss_scale))
  return params, opt_state, trajectory


@pytest.fixture(scope="module")
def reference():
  params, opt_state, trajectory = _run_single_device()
  # Skipping, hysteresis, backoff and growth, each at the step the rule says.
  assert trajectory == EXPECTED_TRAJECTORY
  return params, opt_state, trajectory


def _assert_same_on_every_device(tree):
  for leaf in jax.tree_util.tree_leaves(tree):
    assert leaf.sharding.is_fully_replicated
    shards = [np.asarray(s.data).reshape(-1).view(np.uint8) for s in leaf.addressable_shards]
    assert len(shards) == N_DEV
    for s in shards[1:]:
      np.testing.assert_array_equal(s, shards[0])


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
@pytest.mark.parametrize("layout", ["data_parallel", "fsdp"])
def test_jit_named_sharding_matches_single_device(reference, layout, axis_type):
  ref_params, ref_state, ref_trajectory = reference
  mesh = _mesh(axis_type)
  xs, params = _data()
  tx = _make_tx()
  batch_sharding = NamedSharding(mesh, P("d", None))  # the batch is always split
  param_sharding = NamedSharding(mesh, P("d", None) if layout == "fsdp" else P())
  replicated = NamedSharding(mesh, P())
  with _in_mesh(mesh):
    params = jax.device_put(params, param_sharding)
    opt_state = tx.init(params)
    # Eager init: momentum sharded like the params, the scale state replicated on their mesh.
    _assert_same_on_every_device(opt_state.loss_scale)
    for leaf in jax.tree_util.tree_leaves(opt_state.loss_scale):
      assert leaf.sharding.is_equivalent_to(replicated, 0)
    momentum = jax.tree_util.tree_leaves(opt_state.inner_state)[0]
    assert momentum.sharding.is_equivalent_to(param_sharding, 2)
    in_shardings = jax.tree_util.tree_map(lambda x: x.sharding, (params, opt_state))
    step = _jit_step(tx)
    step = jax.jit(step, in_shardings=(*in_shardings, batch_sharding), out_shardings=in_shardings)
    trajectory = []
    for x in xs:
      x = jax.device_put(x, batch_sharding)
      holders = [
        s.device for s in x.addressable_shards if not np.all(np.isfinite(np.asarray(s.data)))
      ]
      assert len(holders) in (0, 1)  # a bad value lies in one device's data shard only
      params, opt_state = step(params, opt_state, x)
      _assert_same_on_every_device(opt_state.loss_scale)
      trajectory.append(_scale_fields(opt_state.loss_scale))
  assert trajectory == ref_trajectory
  assert_bits_equal(params, ref_params)
  assert_bits_equal(opt_state, ref_state)
  assert params["w"].sharding.is_equivalent_to(param_sharding, 2)
  momentum = jax.tree_util.tree_leaves(opt_state.inner_state)[0]
  assert momentum.shape == (D, K) and momentum.sharding.is_equivalent_to(param_sharding, 2)


def _per_device_step(tx, axis):
  """One FSDP step run per device: params, grads and inner state are shards."""

  def step(w_shard, opt_state, x_shard):
    state = jax.tree_util.tree_map(lambda a: a[0], opt_state)  # drop the device axis
    w_full = jax.lax.all_gather(w_shard, axis, tiled=True)
    data_loss = lambda w: jls.scale_loss(jnp.sum(x_shard @ w), state)
    g_full = jax.grad(data_loss)(w_full)
    g_shard = jax.lax.psum_scatter(g_full, axis, scatter_dimension=0, tiled=True)
    g_shard = g_shard + jls.scale_loss(jnp.float32(1.0), state) * w_shard  # d/dw of 0.5 w^2
    updates, state = tx.update({"w": g_shard}, state, {"w": w_shard})
    new_w = optax.apply_updates({"w": w_shard}, updates)["w"]
    return new_w, jax.tree_util.tree_map(lambda a: a[None], state)

  return step


def _run_per_device(make_step, combine):
  xs, params = _data()
  tx = _make_tx(axis_name="d" if combine else None)
  w = params["w"]
  w_shards = w.reshape(N_DEV, D // N_DEV, K)
  state = tx.init({"w": w_shards[0]})  # every device starts from the same state
  state = jax.tree_util.tree_map(lambda a: jnp.stack([a] * N_DEV), state)
  run_step = make_step(tx)  # traced once for the whole run
  per_step = []
  for x in xs:
    w_shards, state = run_step(w_shards, state, x.reshape(N_DEV, B // N_DEV, D))
    per_step.append(jax.device_get(state.loss_scale))
  return w_shards.reshape(D, K), state, per_step


def _pmap_step(tx):
  step = jax.pmap(_per_device_step(tx, "d"), axis_name="d")

  def run(w_shards, state, x_shards):
    add_axis = lambda a: a[:, None]
    out_w, out_state = step(w_shards, jax.tree_util.tree_map(add_axis, state), x_shards)
    return out_w, jax.tree_util.tree_map(lambda a: a[:, 0], out_state)

  return run


def _shard_map_step(impl, axis_type=AxisType.Auto):
  mesh = _mesh(axis_type)

  def make(tx):
    f = jax.jit(
      impl(
        _per_device_step(tx, "d"),
        mesh=mesh,
        in_specs=(P("d"), P("d"), P("d")),
        out_specs=(P("d"), P("d")),
      )
    )

    def run(w_shards, state, x_shards):
      # Inputs placed as in_specs say (Explicit axes require it; Auto accepts it).
      split = lambda a: jax.device_put(a, NamedSharding(mesh, P("d")))
      args = (w_shards.reshape(D, K), state, x_shards.reshape(B, D))
      with _in_mesh(mesh):
        w, state = f(*jax.tree_util.tree_map(split, args))
      return w.reshape(N_DEV, D // N_DEV, K), state

    return run

  return make


def _check_per_device(reference, result):
  ref_params, ref_state, ref_trajectory = reference
  w, state, per_step = result
  for i, s in enumerate(per_step):
    for leaf in jax.tree_util.tree_leaves(s):
      assert np.all(leaf == leaf[0]), f"devices disagree at step {i}: {s}"
    device0 = jax.tree_util.tree_map(lambda a: a[0], s)
    assert _scale_fields(device0) == ref_trajectory[i], f"step {i}"
  np.testing.assert_array_equal(
    np.asarray(w).view(np.uint32), np.asarray(ref_params["w"]).view(np.uint32)
  )
  momentum = jax.tree_util.tree_leaves(state.inner_state)[0]
  ref_momentum = jax.tree_util.tree_leaves(ref_state.inner_state)[0]
  np.testing.assert_array_equal(
    np.asarray(momentum).reshape(D, K).view(np.uint32), np.asarray(ref_momentum).view(np.uint32)
  )


def test_pmap_axis_name_combines_overflow(reference):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    result = _run_per_device(_pmap_step, combine=True)
  _check_per_device(reference, result)


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
@pytest.mark.parametrize("impl", _shard_map_impls())
def test_shard_map_axis_name_combines_overflow(reference, impl, axis_type):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    result = _run_per_device(_shard_map_step(impl, axis_type), combine=True)
  _check_per_device(reference, result)


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
@pytest.mark.parametrize("impl", _shard_map_impls()[:1])
def test_without_axis_name_devices_diverge(reference, impl, axis_type):
  """The control: a local overflow flag lets the scale states drift apart."""
  _, _, per_step = _run_per_device(_shard_map_step(impl, axis_type), combine=False)
  first_bad = min(BAD_STEPS)
  skipped = np.asarray(per_step[first_bad].skipped_steps)
  assert skipped[BAD_COL // (D // N_DEV)] == 1  # the device holding the inf skipped
  assert int(skipped.sum()) == 1  # ... alone


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_axis_name_under_plain_jit_is_a_clear_value_error(axis_type, maybe_jit):
  """``axis_name`` is for per-device code (shard_map/pmap); under jit with sharded arrays
  the check already sees the global gradients, and the misuse says so."""
  from jax_lossscale.flax import value_and_grad

  mesh = _mesh(axis_type)
  xs, params = _data()
  tx = _make_tx(axis_name="d")
  message = r"(?s)axis_name='d' is not a bound axis.*shard_map.*pmap.*jit.*axis_name=None"
  with _in_mesh(mesh):
    params = jax.device_put(params, NamedSharding(mesh, P("d", None)))
    x = jax.device_put(xs[0], NamedSharding(mesh, P("d", None)))
    opt_state = tx.init(params)

    def step(params, opt_state, x):
      grads = jax.grad(lambda p: jls.scale_loss(_loss(p, x), opt_state))(params)
      return tx.update(grads, opt_state, params)

    with pytest.raises(ValueError, match=message):
      maybe_jit(step)(params, opt_state, x)
    scaled_grad = value_and_grad(lambda p: _loss(p, x), opt_state, axis_name="d")
    with pytest.raises(ValueError, match=message):
      maybe_jit(scaled_grad)(params)
