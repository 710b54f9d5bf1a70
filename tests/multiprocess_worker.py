"""One process of a multi-process (``jax.distributed``) run, for tests/test_multiprocess.py.

Started as ``python tests/multiprocess_worker.py TASK --process-id I
--num-processes N --port PORT --out DIR``; each process has ``8 // N`` CPU
devices, so every run has one mesh of 8 devices, whatever its topology.
Cross-device sums go through gloo in every run, also with one process (then
the sums have the same order as with two processes; in-process collectives
sum in another order). ``--collectives in-process`` (one process only) sums
through XLA's in-process collectives instead: benchmarks/collectives_order.py
measures the difference.

Tasks:

* ``train``: runs every scenario for ``STEPS`` steps on one global batch per
  step (data parallel and FSDP; the Optax wrapper, the
  ``jax_lossscale.flax.TrainState`` field and ``shard_map`` with
  ``axis_name``; Explicit and Auto mesh axes). A non-finite value is put in
  one process's rows of the batch at ``BAD_STEPS``. After ``SAVE_AT`` steps
  the FSDP states are saved with Orbax (``--ckpt``). Also checks the
  host-side readers (``metrics``, ``check_skips``) and the eager-``init``
  recipe.
* ``resume``: restores the checkpoint into states built by the code (any
  topology) and runs the remaining steps.

Each process writes ``DIR/TASK-I.npz`` (every final leaf, gathered from all
processes, as bytes) and ``DIR/TASK-I.json`` (per-step scale state read from
every local device, losses, host-reader results). The worker exits by itself;
exit code 3 means gloo is not available.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

# Devices per process must be set before JAX starts.
if __name__ == "__main__":
  _n = int(sys.argv[sys.argv.index("--num-processes") + 1])
  _flags = [
    f
    for f in os.environ.get("XLA_FLAGS", "").split()
    if not f.startswith("--xla_force_host_platform_device_count")
  ]
  os.environ["XLA_FLAGS"] = " ".join(_flags + [f"--xla_force_host_platform_device_count={8 // _n}"])
  os.environ["JAX_PLATFORMS"] = "cpu"

import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

import jax_lossscale as jls
from jax_lossscale.flax import TrainState

N_DEV = 8
D, H, B = 16, 8, 32  # features, hidden units (both FSDP-sharded), global batch
STEPS, SAVE_AT = 10, 4
# step -> (global batch row, value). Row 29 lies in process 1's half of the
# batch, row 2 in process 0's (checked when there are two processes).
BAD_STEPS = {2: (29, np.inf), 5: (2, np.nan)}
BAD_COL = 11
# Literal expectations (growth_interval 3, backoff 0.5, init 2**10).
EXPECTED_SKIPPED = [0, 0, 1, 1, 1, 2, 2, 2, 2, 2]
EXPECTED_SCALE = [1024.0, 1024.0, 512.0, 512.0, 512.0, 256.0, 256.0, 256.0, 512.0, 512.0]
SCENARIOS = (
  "dp_optax",
  "fsdp_optax",
  "fsdp_optax_auto",
  "dp_trainstate",
  "fsdp_trainstate",
  "shard_map",
)
CHECKPOINTED = ("fsdp_optax", "fsdp_trainstate")
META_KEY = "jax_lossscale"


def global_data():
  """The same global batches, params and targets in every process."""
  rng = np.random.default_rng(0)
  xs = rng.normal(size=(STEPS, B, D)).astype(np.float32)
  for step, (row, value) in BAD_STEPS.items():
    xs[step, row, BAD_COL] = value
  params = {
    "w1": (rng.normal(size=(D, H)) / 4).astype(np.float32),
    "b1": np.zeros(H, np.float32),
    "w2": (rng.normal(size=(H, 1)) / 3).astype(np.float32),
  }
  ys = rng.normal(size=(STEPS, B, 1)).astype(np.float32)
  return xs, ys, params


def make_tx():
  return jls.dynamic_loss_scale(optax.adam(1e-2), init_scale=2.0**10, growth_interval=3)


def make_scaler():
  return jls.DynamicScaleState.create(init_scale=2.0**10, growth_interval=3)


def loss_fn(params, x, y, gather_to=None):
  """Float16 forward and backward, float32 params and loss.

  ``gather_to``: for FSDP under ``jit``, the replicated sharding the params
  are gathered to before use (Explicit axes ask for it).
  """
  if gather_to is not None:
    params = jax.tree_util.tree_map(lambda a: jax.sharding.reshard(a, gather_to), params)
  p = jax.tree_util.tree_map(lambda a: a.astype(jnp.float16), params)
  h = jnp.tanh(x.astype(jnp.float16) @ p["w1"] + p["b1"])
  pred = (h @ p["w2"]).astype(jnp.float32)
  return jnp.mean((pred - y) ** 2)


def param_specs(layout):
  if layout == "dp":
    return {"w1": P(), "b1": P(), "w2": P()}
  return {"w1": P("d", None), "b1": P("d"), "w2": P("d", None)}


def put_global(mesh, spec, value):
  """A global array from a numpy array every process holds (each places its shards)."""
  value = np.asarray(value)
  sharding = NamedSharding(mesh, spec)
  return jax.make_array_from_callback(value.shape, sharding, lambda idx: value[idx])


def rows_of_this_process(mesh):
  sharding = NamedSharding(mesh, P("d"))
  rows = set()
  for idx in sharding.addressable_devices_indices_map((B,)).values():
    rows.update(range(B)[idx[0]])
  return rows


def gather(tree):
  """Every leaf as a full numpy array in every process."""
  return jax.tree_util.tree_map(
    lambda a: np.asarray(multihost_utils.process_allgather(a, tiled=True)), tree
  )


def scale_record(state):
  """The scale state from every local device; they must agree."""
  s = jls.get_scale_state(state)
  out = []
  for name in (
    "scale",
    "growth_tracker",
    "hysteresis_tracker",
    "skipped_steps",
    "consecutive_skips",
  ):
    leaf = getattr(s, name)
    shards = {np.asarray(sh.data).item() for sh in leaf.addressable_shards}
    if len(shards) != 1:
      raise AssertionError(f"{name} differs between local devices: {shards}")
    if len(leaf.addressable_shards) != len(jax.local_devices()):
      raise AssertionError(f"{name} is not on every local device: {leaf.sharding}")
    out.append(shards.pop())
  return out


def spec_text(a):
  """``a``'s PartitionSpec without trailing ``None`` (``"()"``: replicated), or the
  sharding itself when it has no spec (an array local to one device)."""
  if not hasattr(a.sharding, "spec"):
    return repr(a.sharding)
  spec = list(a.sharding.spec)
  while spec and spec[-1] is None:
    spec.pop()
  return str(tuple(spec))


def specs_of(tree):
  return {
    jax.tree_util.keystr(path): spec_text(a)
    for path, a in jax.tree_util.tree_flatten_with_path(tree)[0]
  }


# -- the scenarios ---------------------------------------------------------------------


def init_optax(mesh, layout, params_np):
  params = {k: put_global(mesh, s, params_np[k]) for k, s in param_specs(layout).items()}
  return {"params": params, "opt_state": make_tx().init(params)}


def init_trainstate(mesh, layout, params_np):
  params = {k: put_global(mesh, s, params_np[k]) for k, s in param_specs(layout).items()}
  # No device_put: create places the scaler and the step like the params.
  return TrainState.create(
    apply_fn=None, params=params, tx=optax.adam(1e-2), dynamic_scale=make_scaler()
  )


def optax_step(tx, gather_to):
  def step(state, x, y):
    params, opt_state = state["params"], state["opt_state"]

    def scaled(p):
      loss = loss_fn(p, x, y, gather_to)
      return jls.scale_loss(loss, opt_state), loss

    (_, loss), grads = jax.value_and_grad(scaled, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return {"params": optax.apply_updates(params, updates), "opt_state": opt_state}, loss

  return jax.jit(step)


def trainstate_step(gather_to):
  def step(state, x, y):
    out = state.value_and_grad(lambda p: loss_fn(p, x, y, gather_to))(state.params)
    return state.apply_gradients(grads=out.grads, finite=out.finite), out.value

  return jax.jit(step)


def shard_map_step(mesh, tx, state):
  """FSDP by hand in ``shard_map``: only the device owning a bad gradient row sees it."""

  def per_device(st, x, y):
    params, opt_state = st["params"], st["opt_state"]
    full = {k: jax.lax.all_gather(v, "d", tiled=True) for k, v in params.items()}

    def scaled(p):
      loss = loss_fn(p, x, y) * (x.shape[0] / B)  # this device's share of the mean
      return jls.scale_loss(loss, opt_state), loss

    (_, loss), g_full = jax.value_and_grad(scaled, has_aux=True)(full)
    grads = {
      k: jax.lax.psum_scatter(g, "d", scatter_dimension=0, tiled=True) for k, g in g_full.items()
    }
    updates, opt_state = tx.update(grads, opt_state, params)
    new = {"params": optax.apply_updates(params, updates), "opt_state": opt_state}
    return new, jax.lax.psum(loss, "d")

  specs = jax.tree_util.tree_map(lambda a: a.sharding.spec, state)
  return jax.jit(
    jax.shard_map(per_device, mesh=mesh, in_specs=(specs, P("d"), P("d")), out_specs=(specs, P()))
  )


def build(mesh, name, params_np):
  layout = "dp" if name.startswith("dp") else "fsdp"
  if name == "shard_map":
    tx = jls.dynamic_loss_scale(
      optax.adam(1e-2), init_scale=2.0**10, growth_interval=3, axis_name="d"
    )
    state = init_optax(mesh, "fsdp", params_np)
    return state, shard_map_step(mesh, tx, state)
  gather_to = NamedSharding(mesh, P()) if layout == "fsdp" else None
  if "trainstate" in name:
    return init_trainstate(mesh, layout, params_np), trainstate_step(gather_to)
  return init_optax(mesh, layout, params_np), optax_step(make_tx(), gather_to)


def run_steps(mesh, step, state, xs, ys, start, stop, record):
  for i in range(start, stop):
    x = put_global(mesh, P("d", None), xs[i])
    y = put_global(mesh, P("d", None), ys[i])
    state, loss = step(state, x, y)
    record["trajectory"].append(scale_record(state))
    record["loss"].append(float(np.asarray(loss.addressable_shards[0].data)))
  return state


# -- host-side readers and the init recipe ---------------------------------------------


def host_readers(mesh, state):
  """``metrics`` and ``check_skips`` on the host, on a global (not fully addressable) state."""
  m = {k: np.asarray(v).item() for k, v in jls.metrics(state).items()}
  consecutive = jls.check_skips(state, max_consecutive_skips=0)
  try:
    jls.check_skips(state, max_skipped_steps=1)
    raised = None
  except jls.LossScaleError as e:
    raised = str(e)
  scale = jls.get_scale_state(state).scale
  return {
    "metrics": m,
    "check_skips": consecutive,
    "raised": raised,
    "scale_fully_addressable": bool(scale.is_fully_addressable),
    "scale_replicated": bool(scale.sharding.is_fully_replicated),
  }


def eager_init_recipe(mesh_auto, params_np, ckpt_dir):
  """README recipe: eager ``tx.init`` and ``TrainState.create`` on global params, no
  ``set_mesh``, then an Orbax save from every process."""
  import orbax.checkpoint as ocp

  params = {k: put_global(mesh_auto, s, params_np[k]) for k, s in param_specs("fsdp").items()}
  opt_state = make_tx().init(params)
  ts = TrainState.create(
    apply_fn=None, params=params, tx=optax.adam(1e-2), dynamic_scale=make_scaler()
  )
  scalars = [
    *jax.tree_util.tree_leaves(jls.get_scale_state(opt_state)),
    ts.step,
    *jax.tree_util.tree_leaves(ts.dynamic_scale),
  ]
  out = {
    "scale_sharding": str(jls.get_scale_state(opt_state).scale.sharding),
    "scalar_specs": sorted({spec_text(a) for a in scalars}),
    "scale_fully_addressable": any(a.is_fully_addressable for a in scalars),
  }
  try:
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(
      os.path.join(ckpt_dir, "eager_init"),
      {"params": params, "opt_state": opt_state, "trainstate": ts},
    )
    ckptr.wait_until_finished()
    ckptr.close()
    out["saved"] = True
  except Exception as e:
    out["saved"] = False
    out["error"] = f"{type(e).__name__}: {str(e)[:300]}"
  return out


# -- tasks ---------------------------------------------------------------------------


def meshes():
  devices = np.array(jax.devices())
  explicit = jax.sharding.Mesh(devices, ("d",), axis_types=(AxisType.Explicit,))
  auto = jax.sharding.Mesh(devices, ("d",), axis_types=(AxisType.Auto,))
  return explicit, auto


def save(path, tree):
  import orbax.checkpoint as ocp

  ckptr = ocp.StandardCheckpointer()
  ckptr.save(path, tree, custom_metadata={META_KEY: jls.checkpoint.scale_config_metadata(tree)})
  ckptr.wait_until_finished()
  ckptr.close()


def restore(path, target):
  import orbax.checkpoint as ocp

  ckptr = ocp.StandardCheckpointer()
  jls.checkpoint.check_scale_config(target, ckptr.metadata(path).custom_metadata[META_KEY])
  restored = ckptr.restore(path, target)
  ckptr.close()
  return restored


def task_train(args, results, finals):
  xs, ys, params_np = global_data()
  explicit, auto = meshes()
  if jax.process_count() == 2:  # each bad row lies in exactly one process's half
    assert (29 in rows_of_this_process(explicit)) == (jax.process_index() == 1)
    assert (2 in rows_of_this_process(explicit)) == (jax.process_index() == 0)
  for name in SCENARIOS:
    mesh = auto if name.endswith("_auto") else explicit
    record = results.setdefault(name, {"trajectory": [], "loss": []})
    with jax.set_mesh(mesh) if mesh is explicit else contextlib.nullcontext():
      state, step = build(mesh, name, params_np)
      record["init_specs"] = specs_of(state)
      state = run_steps(mesh, step, state, xs, ys, 0, SAVE_AT, record)
      if name in CHECKPOINTED and args.save:
        save(os.path.join(args.save, name), state)
      state = run_steps(mesh, step, state, xs, ys, SAVE_AT, STEPS, record)
      record["final_specs"] = specs_of(state)
      record["host"] = host_readers(mesh, state)
      finals[name] = gather(state)
  if args.save:
    results["eager_init"] = eager_init_recipe(auto, params_np, args.save)


def task_resume(args, results, finals):
  xs, ys, params_np = global_data()
  explicit, _ = meshes()
  for name in CHECKPOINTED:
    record = results.setdefault(name, {"trajectory": [], "loss": []})
    with jax.set_mesh(explicit):
      target, step = build(explicit, name, params_np)
      state = restore(os.path.join(args.restore, name), target)
      record["restored_specs"] = specs_of(state)
      state = run_steps(explicit, step, state, xs, ys, SAVE_AT, STEPS, record)
      record["final_specs"] = specs_of(state)
      finals[name] = gather(state)


def leaves_as_bytes(finals):
  out = {}
  for name, tree in finals.items():
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      out[name + jax.tree_util.keystr(path)] = np.asarray(leaf).reshape(-1).view(np.uint8)
  return out


def leaf_dtypes(finals):
  """The dtype of every leaf of :func:`leaves_as_bytes`, by the same key."""
  return {
    name + jax.tree_util.keystr(path): str(np.asarray(leaf).dtype)
    for name, tree in finals.items()
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
  }


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("tasks", help="comma-separated: train, resume")
  parser.add_argument("--process-id", type=int, required=True)
  parser.add_argument("--num-processes", type=int, required=True)
  parser.add_argument("--port", type=int, required=True)
  parser.add_argument("--out", required=True)
  parser.add_argument("--save", default="", help="train: save checkpoints under this folder")
  parser.add_argument("--restore", default="", help="resume: restore from this folder")
  parser.add_argument(
    "--collectives",
    choices=("gloo", "in-process"),
    default="gloo",
    help="in-process: XLA's own CPU collectives (one process only; another summation order)",
  )
  args = parser.parse_args(argv)
  if args.collectives == "in-process" and args.num_processes != 1:
    parser.error("--collectives in-process needs --num-processes 1")
  try:
    # gloo is also JAX's default; None leaves the sums to XLA's in-process collectives.
    impl = "gloo" if args.collectives == "gloo" else None
    jax.config.update("jax_cpu_collectives_implementation", impl)
  except Exception as e:
    print(f"gloo is not available: {e}", file=sys.stderr)
    return 3
  jax.distributed.initialize(
    f"127.0.0.1:{args.port}",
    num_processes=args.num_processes,
    process_id=args.process_id,
    initialization_timeout=60,
    coordinator_bind_address=f"127.0.0.1:{args.port}",
  )
  try:
    assert jax.device_count() == N_DEV, jax.devices()
    assert jax.local_device_count() == N_DEV // args.num_processes
    for task in args.tasks.split(","):
      results, finals = {"process_index": jax.process_index()}, {}
      {"train": task_train, "resume": task_resume}[task](args, results, finals)
      results["leaf_dtypes"] = leaf_dtypes(finals)
      stem = os.path.join(args.out, f"{task}-{args.process_id}")
      np.savez(stem + ".npz", **leaves_as_bytes(finals))
      with open(stem + ".json", "w") as f:
        json.dump(results, f)
  finally:
    jax.distributed.shutdown()
  return 0


if __name__ == "__main__":
  sys.exit(main())
