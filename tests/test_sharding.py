"""Explicit and Auto mesh axes: every entry point runs, keeps shardings, and agrees bit for bit.

JAX 0.10's ``jax.make_mesh`` gives ``AxisType.Explicit`` axes: shardings are
part of the types, and ``jnp.where`` refuses operands of different shardings.
Each path of the library (``dynamic_loss_scale``, ``static_loss_scale``,
``no_loss_scale``, ``multi_steps``, ``jax_lossscale.flax.TrainState``,
``nnx.Optimizer``, ``metrics``, ``nonfinite_leaves``, ``scale_loss``,
``check_skips``) trains the same FSDP model on 8 CPU devices with Explicit
axes (under ``jax.set_mesh``) and with Auto axes, and:

* updates, new params and the inner optimizer state are sharded as the
  params are (FSDP leaves split over ``d``; nothing silently replicated);
  the scale state is replicated on the params' mesh from ``init`` on;
* the two runs are bit-identical, over clean and skipped steps, with a
  subnormal and a -0.0 among the params (bit-identical through each skip).
"""

import contextlib
import inspect
from typing import NamedTuple

from flax import nnx
from helpers import assert_bits_equal
from helpers import standard_promotion
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

N_DEV = 8
D, K, B = 16, 4, 32
STEPS = 5
BAD_STEPS = {0: np.inf, 3: np.nan}  # a skip on the first step (initial params) and later
SUBNORMAL = np.float32(1e-40)
AXIS_TYPES = [
  pytest.param(AxisType.Explicit, id="explicit"),
  pytest.param(AxisType.Auto, id="auto"),
]
SPECS = {"w": P("d", None), "v": P("d"), "b": P()}  # FSDP leaves and a replicated one

pytestmark = pytest.mark.skipif(jax.device_count() < N_DEV, reason="needs 8 devices (conftest)")


def _mesh(axis_type):
  return jax.make_mesh((N_DEV,), ("d",), axis_types=(axis_type,))


def _in_mesh(mesh):
  """``jax.set_mesh(mesh)`` for Explicit axes (required there); nothing for Auto."""
  if mesh.axis_types[0] == AxisType.Explicit:
    return jax.set_mesh(mesh)
  return contextlib.nullcontext()


def _data():
  rng = np.random.default_rng(0)
  xs = rng.normal(size=(STEPS, B, D)).astype(np.float32)
  for step, value in BAD_STEPS.items():
    xs[step, 21, 5] = value  # one row of one device's batch shard
  v = rng.uniform(0.5, 1.5, size=D).astype(np.float32)
  v[3], v[12] = SUBNORMAL, -0.0  # in the shards of devices 1 and 6
  params = {
    "w": (rng.normal(size=(D, K)) / 4).astype(np.float32),
    "v": v,
    "b": np.zeros(K, np.float32),
  }
  return xs, params


def _put(mesh, params):
  return {k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in params.items()}


def _loss(params, x, mesh):
  """FSDP: the params are gathered (resharded to replicated) where they are used."""
  full = jax.tree_util.tree_map(lambda a: jax.sharding.reshard(a, NamedSharding(mesh, P())), params)
  h = jnp.tanh((x * full["v"]) @ full["w"] + full["b"])
  return jnp.mean(h**2)


def _spec(a):
  """The PartitionSpec of ``a`` without trailing ``None`` (``()``: replicated)."""
  assert isinstance(a.sharding, NamedSharding), a.sharding
  spec = list(a.sharding.spec)
  while spec and spec[-1] is None:
    spec.pop()
  return tuple(spec)


def _assert_like_params(tree, params):
  """Each leaf of ``tree`` sharded as the param it belongs to."""
  for t, p in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(params), strict=True):
    assert t.shape == p.shape and _spec(t) == _spec(p), (t.shape, t.sharding, p.sharding)


def _assert_replicated_on(tree, mesh):
  for leaf in jax.tree_util.tree_leaves(tree):
    assert isinstance(leaf.sharding, NamedSharding) and leaf.sharding.mesh == mesh, leaf.sharding
    assert _spec(leaf) == (), leaf.sharding


def _assert_params_kept(params, params_np):
  """A skipped first step: -0.0 and the subnormal still there, every bit unchanged."""
  v = np.asarray(params["v"])
  assert np.signbit(v[12]) and v[12] == 0.0
  assert v[3] == SUBNORMAL and v[3].view(np.uint32) == SUBNORMAL.view(np.uint32)
  for k in params_np:
    np.testing.assert_array_equal(
      np.asarray(params[k]).view(np.uint32), params_np[k].view(np.uint32), err_msg=k
    )


# -- the Optax wrappers -----------------------------------------------------------------

WRAPPERS = {
  "dynamic": lambda: jls.dynamic_loss_scale(
    optax.adam(1e-2), init_scale=2.0**10, growth_interval=2
  ),
  "static": lambda: jls.static_loss_scale(optax.adam(1e-2), 2.0**8),
  "none": lambda: jls.no_loss_scale(optax.adam(1e-2)),
  "multi_steps": lambda: jls.multi_steps(
    jls.dynamic_loss_scale(optax.adam(1e-2), init_scale=2.0**10, growth_interval=2), 2
  ),
}
# (scale, skipped_steps) after each step. multi_steps: micro-batches 0+1 skipped
# together (step 1), 2+3 skipped (step 3).
EXPECTED = {
  "dynamic": [(512.0, 1), (512.0, 1), (1024.0, 1), (512.0, 2), (512.0, 2)],
  "static": [(256.0, 1), (256.0, 1), (256.0, 1), (256.0, 2), (256.0, 2)],
  "none": [(1.0, 1), (1.0, 1), (1.0, 1), (1.0, 2), (1.0, 2)],
  "multi_steps": [(1024.0, 0), (512.0, 1), (512.0, 1), (256.0, 2), (256.0, 2)],
}


def _run_optax(axis_type, name):
  mesh = _mesh(axis_type)
  xs, params_np = _data()
  tx = WRAPPERS[name]()
  out = {"trajectory": [], "metrics": [], "nonfinite": []}
  with _in_mesh(mesh), standard_promotion():
    params = _put(mesh, params_np)
    opt_state = tx.init(params)  # eager init: the scale state lands on the params' mesh
    _assert_replicated_on(jls.get_scale_state(opt_state), mesh)

    @jax.jit
    def step(params, opt_state, x):
      def scaled(p):
        return jls.scale_loss(_loss(p, x, mesh), opt_state)

      grads = jax.grad(scaled)(params)
      updates, opt_state = tx.update(grads, opt_state, params)
      new = optax.apply_updates(params, updates)
      return (
        new,
        opt_state,
        updates,
        jls.metrics(opt_state),
        jls.diagnostics.nonfinite_leaves(grads),
      )

    for i, x in enumerate(xs):
      x = jax.device_put(x, NamedSharding(mesh, P("d", None)))
      new, opt_state, updates, m, bad = step(params, opt_state, x)
      _assert_like_params(updates, params)
      _assert_like_params(new, params)
      _assert_replicated_on(m, mesh)
      if i == 0:  # the first step is skipped
        _assert_params_kept(new, params_np)
        assert all(np.all(np.signbit(np.asarray(u))) for u in jax.tree_util.tree_leaves(updates))
      params = new
      s = jls.get_scale_state(opt_state)
      out["trajectory"].append((float(s.scale), int(s.skipped_steps)))
      out["metrics"].append({k: v.item() for k, v in m.items()})
      out["nonfinite"].append({k: bool(v) for k, v in bad.items()})
  out.update(mesh=mesh, params=params, opt_state=opt_state)
  return out


@pytest.fixture(scope="module")
def optax_runs():
  cache = {}

  def get(axis_type, name):
    if (axis_type, name) not in cache:
      cache[axis_type, name] = _run_optax(axis_type, name)
    return cache[axis_type, name]

  return get


def _inner_param_trees(opt_state):
  """Every subtree of ``opt_state`` with the params' structure (Adam's mu and nu, acc_grads)."""
  found = []

  def visit(x):
    if isinstance(x, dict) and set(x) == set(SPECS):
      found.append(x)
      return
    if isinstance(x, tuple) or hasattr(x, "_fields"):
      for y in x:
        visit(y)

  visit(opt_state)
  return found


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
@pytest.mark.parametrize("name", sorted(WRAPPERS))
def test_wrappers_keep_params_sharding(optax_runs, axis_type, name):
  run = optax_runs(axis_type, name)
  assert run["trajectory"] == EXPECTED[name]
  params = run["params"]
  assert {k: _spec(v) for k, v in params.items()} == {"w": ("d",), "v": ("d",), "b": ()}
  trees = _inner_param_trees(run["opt_state"])
  assert len(trees) == (3 if name == "multi_steps" else 2)  # mu, nu (+ acc_grads)
  for tree in trees:
    _assert_like_params(tree, params)
  _assert_replicated_on(jls.get_scale_state(run["opt_state"]), run["mesh"])


@pytest.mark.parametrize("name", sorted(WRAPPERS))
def test_wrappers_explicit_and_auto_are_bit_identical(optax_runs, name):
  explicit, auto = optax_runs(AxisType.Explicit, name), optax_runs(AxisType.Auto, name)
  assert_bits_equal(explicit["params"], auto["params"], structure=True)
  assert_bits_equal(explicit["opt_state"], auto["opt_state"], structure=True)
  assert explicit["metrics"] == auto["metrics"]
  assert explicit["nonfinite"] == auto["nonfinite"]


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_metrics_nonfinite_leaves_and_check_skips(optax_runs, axis_type):
  run = optax_runs(axis_type, "dynamic")
  assert run["metrics"][3] == {
    "scale": 512.0,
    "growth_tracker": 0,
    "last_step_skipped": True,
    "skipped_steps": 2,
    "consecutive_skips": 1,
  }
  assert run["metrics"][4]["last_step_skipped"] is False
  # Step 0: x[21, 5] = inf saturates tanh on row 21, so that row's error signal is
  # 0: b's gradient stays finite, w's and v's get inf * 0 = NaN. Step 3: NaN everywhere.
  assert run["nonfinite"][0] == {"w": True, "v": True, "b": False}
  assert run["nonfinite"][1] == {"w": False, "v": False, "b": False}
  assert run["nonfinite"][3] == {"w": True, "v": True, "b": True}
  state = run["opt_state"]
  assert jls.check_skips(state, max_consecutive_skips=0) == 0
  with pytest.raises(jls.LossScaleError, match=r"^2 steps skipped in total \(limit 1\)"):
    jls.check_skips(state, max_skipped_steps=1)


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_scale_loss_keeps_the_loss_sharding(axis_type):
  mesh = _mesh(axis_type)
  with _in_mesh(mesh):
    state = jls.dynamic_loss_scale(optax.sgd(1.0), init_scale=2.0**4).init(_put(mesh, _data()[1]))
    per_example = jax.device_put(jnp.arange(B, dtype=jnp.float16), NamedSharding(mesh, P("d")))
    scaled = jax.jit(jls.scale_loss)(per_example, state)
  assert scaled.dtype == jnp.float32 and _spec(scaled) == ("d",)
  np.testing.assert_array_equal(np.asarray(scaled), np.arange(B, dtype=np.float32) * 16)


# -- jax_lossscale.flax.TrainState ---------------------------------------------------------


def _run_trainstate(axis_type):
  mesh = _mesh(axis_type)
  xs, params_np = _data()
  with _in_mesh(mesh), standard_promotion():
    params = _put(mesh, params_np)
    state = TrainState.create(
      apply_fn=None,
      params=params,
      tx=optax.adam(1e-2),
      dynamic_scale=jls.DynamicScaleState.create(init_scale=2.0**10, growth_interval=2),
    )
    _assert_replicated_on((state.step, state.dynamic_scale), mesh)

    @jax.jit
    def step(state, x):
      out = state.value_and_grad(lambda p: _loss(p, x, mesh))(state.params)
      return state.apply_gradients(grads=out.grads, finite=out.finite), out.grads

    trajectory = []
    for i, x in enumerate(xs):
      state, grads = step(state, jax.device_put(x, NamedSharding(mesh, P("d", None))))
      _assert_like_params(grads, params)
      _assert_like_params(state.params, params)
      if i == 0:
        _assert_params_kept(state.params, params_np)
      trajectory.append(
        (float(state.dynamic_scale.scale), int(state.dynamic_scale.skipped_steps), int(state.step))
      )
  return mesh, params, state, trajectory


def test_trainstate_explicit_and_auto():
  results = [_run_trainstate(t) for t in (AxisType.Explicit, AxisType.Auto)]
  for mesh, params, state, trajectory in results:
    assert trajectory == [
      (512.0, 1, 0),
      (512.0, 1, 1),
      (1024.0, 1, 2),
      (512.0, 2, 2),
      (512.0, 2, 3),
    ]
    mu_nu = _inner_param_trees(state.opt_state)
    assert len(mu_nu) == 2
    for tree in mu_nu:
      _assert_like_params(tree, params)
    _assert_replicated_on(state.dynamic_scale, mesh)
  fields = lambda st: (st.step, st.params, st.opt_state, st.dynamic_scale)
  assert_bits_equal(fields(results[0][2]), fields(results[1][2]), structure=True)


# -- nnx.Optimizer ---------------------------------------------------------------------


class _Model(nnx.Module):
  def __init__(self, params):
    self.w, self.v, self.b = (nnx.Param(params[k]) for k in ("w", "v", "b"))

  def __call__(self, x, mesh):
    return _loss({"w": self.w[...], "v": self.v[...], "b": self.b[...]}, x, mesh)


def _run_nnx(axis_type):
  mesh = _mesh(axis_type)
  xs, params_np = _data()
  with _in_mesh(mesh), standard_promotion():
    params = _put(mesh, params_np)
    model = _Model(params)
    tx = jls.dynamic_loss_scale(optax.adam(1e-2), init_scale=2.0**10, growth_interval=2)
    if "wrt" in inspect.signature(nnx.Optimizer.__init__).parameters:
      optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    else:  # Flax < 0.11
      optimizer = nnx.Optimizer(model, tx)

    @nnx.jit
    def step(model, optimizer, x):
      def loss_fn(model):
        return jls.scale_loss(model(x, mesh), optimizer.opt_state)

      grads = nnx.grad(loss_fn)(model)
      if len(inspect.signature(optimizer.update).parameters) >= 2:
        optimizer.update(model, grads)
      else:
        optimizer.update(grads)
      return jls.metrics(optimizer.opt_state)

    trajectory = []
    for i, x in enumerate(xs):
      m = step(model, optimizer, jax.device_put(x, NamedSharding(mesh, P("d", None))))
      new = {k: getattr(model, k)[...] for k in ("w", "v", "b")}
      _assert_like_params(new, params)
      if i == 0:
        _assert_params_kept(new, params_np)
      trajectory.append((m["scale"].item(), m["skipped_steps"].item()))
  state = nnx.state(optimizer)
  return mesh, new, jax.tree_util.tree_map(lambda a: jnp.asarray(a), state), trajectory


def test_nnx_optimizer_explicit_and_auto(optax_runs):
  results = [_run_nnx(t) for t in (AxisType.Explicit, AxisType.Auto)]
  for mesh, _, state, trajectory in results:
    assert trajectory == EXPECTED["dynamic"]
    specs = {
      jax.tree_util.keystr(path): _spec(leaf)
      for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
    }
    for moment in ("mu", "nu"):  # Adam's moments sharded like the params
      assert {
        k: specs[f"['opt_state']['inner_state'][0]['{moment}']['{k}'].value"] for k in SPECS
      } == {"w": ("d",), "v": ("d",), "b": ()}
    scalars = [v for k, v in specs.items() if "loss_scale" in k or k == "['step'].value"]
    assert len(scalars) == 6 and set(scalars) == {()}
    _assert_replicated_on(state["opt_state"]["loss_scale"], mesh)
  assert_bits_equal(results[0][1], results[1][1], structure=True)
  assert_bits_equal(results[0][2], results[1][2], structure=True)
  # The same training as the plain Optax wrapper (same tx, loss and data), bit for bit.
  assert_bits_equal(
    results[0][1], optax_runs(AxisType.Explicit, "dynamic")["params"], structure=True
  )


# -- Explicit axes under the plain jax.make_mesh default ------------------------------------


def test_make_mesh_default_is_explicit_here():
  """The premise of this file: jax.make_mesh defaults to Explicit axes (JAX >= 0.7)."""
  mesh = jax.make_mesh((N_DEV,), ("d",))
  assert mesh.axis_types == (AxisType.Explicit,)


# -- init placement of every wrapper's own scalars -------------------------------------------


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_multi_steps_init_places_its_counters_on_the_params_mesh(axis_type):
  """``mini_step`` and ``gradient_step`` are replicated on the params' mesh, as the scale
  state is: host-local single-device arrays could not be checkpointed under
  ``jax.distributed``."""
  mesh = _mesh(axis_type)
  _, params_np = _data()
  tx = jls.multi_steps(jls.dynamic_loss_scale(optax.sgd(0.1, momentum=0.9)), 2)
  with _in_mesh(mesh):
    params = _put(mesh, params_np)
    state = tx.init(params)
  _assert_replicated_on((state.mini_step, state.gradient_step), mesh)
  _assert_replicated_on(jls.get_scale_state(state), mesh)
  _assert_like_params(state.acc_grads, params)
  for leaf in jax.tree_util.tree_leaves(state):
    assert isinstance(leaf.sharding, NamedSharding) and leaf.sharding.mesh == mesh, leaf.sharding


class _HostState(NamedTuple):
  count: int
  table: np.ndarray


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_init_leaves_host_values_of_an_inner_state_as_they_are(axis_type):
  """Only single-device jax arrays are placed: an inner state holding a Python int and a
  NumPy array (a custom transformation's) keeps them as they are."""
  inner = optax.GradientTransformation(
    lambda params: _HostState(3, np.arange(2.0)), lambda u, state, params=None: (u, state)
  )
  mesh = _mesh(axis_type)
  _, params_np = _data()
  with _in_mesh(mesh):
    state = jls.dynamic_loss_scale(inner).init(_put(mesh, params_np))
  held = jls.get_inner_state(state)
  assert held.count == 3 and type(held.count) is int
  assert type(held.table) is np.ndarray
  np.testing.assert_array_equal(held.table, [0.0, 1.0])
  _assert_replicated_on(jls.get_scale_state(state), mesh)


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_init_replicates_on_a_one_device_mesh_too(axis_type):
  """A one-device mesh is a mesh: the scaler's scalars are placed on it like the params."""
  mesh = jax.make_mesh((1,), ("d",), axis_types=(axis_type,), devices=jax.devices()[:1])
  with _in_mesh(mesh):
    params = {"w": jax.device_put(np.ones((4, 2), np.float32), NamedSharding(mesh, P("d")))}
    state = jls.dynamic_loss_scale(optax.sgd(0.1)).init(params)
  _assert_replicated_on(jls.get_scale_state(state), mesh)


# -- a large FSDP leaf traced on an Explicit mesh ---------------------------------------------

BIG = (1024, 128)  # 2**17 elements: above _skip.LARGE, where the CPU skip orders its selects


def test_a_large_fsdp_leaf_traced_on_an_explicit_mesh_is_seen_as_sharded():
  """Under ``jit`` the leaves are tracers: the skip reads their sharding from the type
  (``jax.typeof``), so it never takes a one-element slice of a leaf split over ``d``
  (an Explicit mesh refuses that slice)."""
  from jax_lossscale._scaler import _skip

  mesh = _mesh(AxisType.Explicit)
  seen = []
  with jax.set_mesh(mesh):
    w = jax.device_put(jnp.ones(BIG, jnp.float32), NamedSharding(mesh, P("d", None)))
    r = jax.device_put(jnp.ones(BIG, jnp.float32), NamedSharding(mesh, P()))
    jax.jit(lambda w, r: seen.extend([_skip._explicitly_sharded(w), _skip._explicitly_sharded(r)]))(
      w, r
    )
  assert seen == [True, False]


@pytest.mark.parametrize("entry", ["dynamic_loss_scale", "TrainState"])
def test_a_large_fsdp_leaf_trains_and_skips_on_an_explicit_mesh(entry):
  mesh = _mesh(AxisType.Explicit)
  rng = np.random.default_rng(0)
  w_np = rng.normal(size=BIG).astype(np.float32)
  x_np = rng.normal(size=(N_DEV, BIG[0])).astype(np.float32)
  loss = lambda w, x: jnp.mean((x @ jax.sharding.reshard(w, NamedSharding(mesh, P()))) ** 2)
  with jax.set_mesh(mesh):
    w = jax.device_put(w_np, NamedSharding(mesh, P("d", None)))
    xs = [jnp.asarray(x_np), jnp.asarray(x_np).at[2, 7].set(jnp.inf)]
    if entry == "dynamic_loss_scale":
      tx = jls.dynamic_loss_scale(optax.sgd(0.1, momentum=0.9), init_scale=2.0**8)
      state = tx.init({"w": w})

      @jax.jit
      def step(params, state, x):
        grads = jax.grad(lambda p: jls.scale_loss(loss(p["w"], x), state))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

      out = [step({"w": w}, state, x) for x in xs]
      news = [o[0]["w"] for o in out]
      moments = [jax.tree_util.tree_leaves(o[1].inner_state)[0] for o in out]
    else:
      ts = TrainState.create(apply_fn=None, params={"w": w}, tx=optax.sgd(0.1, momentum=0.9))

      @jax.jit
      def step(ts, x):
        g = ts.value_and_grad(lambda p: loss(p["w"], x))(ts.params)
        return ts.apply_gradients(grads=g.grads, finite=g.finite)

      out = [step(ts, x) for x in xs]
      news = [o.params["w"] for o in out]
      moments = [jax.tree_util.tree_leaves(o.opt_state)[0] for o in out]
  for a in news + moments:
    assert _spec(a) == ("d",), a.sharding  # still FSDP, nothing gathered
  assert not np.array_equal(np.asarray(news[0]), w_np)  # the clean step moved
  assert np.asarray(news[1]).tobytes() == w_np.tobytes()  # the skip kept it, bit for bit
  assert not np.any(np.asarray(moments[1]))
