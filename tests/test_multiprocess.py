"""Many processes: ``jax.distributed`` with 2 processes x 4 CPU devices, gloo collectives.

Runs of ``tests/multiprocess_worker.py`` (each process runs every scenario,
to pay JAX's start-up once per process):

1. 2 processes x 4 devices: train ``STEPS`` steps, checkpoint with Orbax
   after ``SAVE_AT`` (both processes save).
2. side by side, then:

   * a fresh pair of processes: restore that checkpoint and train on;
   * the reference, 1 process x 8 devices, also summing through gloo: the
     whole run, and a restore of the 2-process checkpoint into this other
     topology. (With gloo, 2 x 4 and 1 x 8 devices give the same bits;
     in-process collectives sum in another order and change the last bits.)

Non-finite values sit in one process's half of the global batch (step 2:
process 1, step 5: process 0); every device of both processes must skip.
Only 127.0.0.1 is used, on free ports; every launch has a hard timeout and
its processes are killed if one fails. Under ``CI=true`` a missing gloo or
Orbax fails instead of skipping.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

from helpers import import_optional
from helpers import in_ci
import numpy as np
import pytest

import_optional("orbax.checkpoint")  # both skip the file here, and fail under CI=true
import_optional("flax")

import multiprocess_worker as w  # noqa: E402  (tests/ is on sys.path, as for conftest)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "multiprocess_worker.py")
LAUNCH_TIMEOUT = 240
IN_CI = in_ci()


def _free_ports(k):
  """``k`` distinct ports free on 127.0.0.1 (all held until all are chosen)."""
  sockets = [socket.socket() for _ in range(k)]
  try:
    for s in sockets:
      s.bind(("127.0.0.1", 0))
    return [s.getsockname()[1] for s in sockets]
  finally:
    for s in sockets:
      s.close()


def _env():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)  # the worker sets its own device count
  env["PYTHONPATH"] = os.pathsep.join(p for p in [ROOT, env.get("PYTHONPATH", "")] if p)
  return env


def _wait_all(procs, timeout):
  """Exit codes once all have exited; ``None`` on timeout. Stops early when one fails
  (the others would wait for it in a collective until the timeout)."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    codes = [p.poll() for p in procs]
    if None not in codes or any(c not in (None, 0) for c in codes):
      return codes
    time.sleep(0.1)
  return None


def launch(jobs, timeout=LAUNCH_TIMEOUT):
  """Starts every process of every job ``(argv_for, n, out)`` at once and waits for all;
  kills them all if one fails or time runs out."""
  procs, logs, paths = [], [], []
  try:
    for argv_for, n, out in jobs:
      os.makedirs(out, exist_ok=True)
      for i in range(n):
        paths.append(os.path.join(out, f"log-{i}.txt"))
        logs.append(open(paths[-1], "w"))
        procs.append(
          subprocess.Popen(
            argv_for(i), stdout=logs[-1], stderr=subprocess.STDOUT, env=_env(), cwd=ROOT
          )
        )
    codes = _wait_all(procs, timeout)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
    for log in logs:
      log.close()
  tails = "\n".join(f"--- {path} ---\n" + _tail(path) for path in paths)
  if codes is None:
    pytest.fail(f"multi-process launch timed out after {timeout} s\n{tails}")
  codes = [p.returncode for p in procs]  # the others, killed after one failed: negative
  if 3 in codes:
    message = f"gloo CPU collectives are not available\n{tails}"
    pytest.fail(message) if IN_CI else pytest.skip(message)
  assert codes == [0] * len(procs), f"exit codes {codes}\n{tails}"


def _tail(path, lines=40):
  with open(path) as f:
    text = [ln for ln in f.read().splitlines() if "[Gloo]" not in ln]
  return "\n".join(text[-lines:])


def launch_workers(*jobs):
  """Runs the jobs ``(tasks, n, out, flags)`` of tests/multiprocess_worker.py side by side."""

  def argv_for(tasks, n, out, flags, port):
    extra = [a for k, v in flags.items() for a in (f"--{k}", v)]
    return lambda i: [
      sys.executable,
      WORKER,
      tasks,
      "--process-id",
      str(i),
      "--num-processes",
      str(n),
      "--port",
      str(port),
      "--out",
      out,
      *extra,
    ]

  for attempt in range(2):
    # Free now; another program may take a port before the coordinator does: retry once.
    ports = _free_ports(len(jobs))
    try:
      return launch([(argv_for(*job, port), job[1], job[2]) for job, port in zip(jobs, ports)])
    except AssertionError as e:
      if attempt or not re.search("Failed to (start RPC server|add port)", str(e)):
        raise


def _load(out, task, i):
  with open(os.path.join(out, f"{task}-{i}.json")) as f:
    record = json.load(f)
  return record, dict(np.load(os.path.join(out, f"{task}-{i}.npz")))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  base = tmp_path_factory.mktemp("multiprocess")
  two, fresh, ref = (str(base / name) for name in ("two", "fresh", "ref"))
  ckpt = str(base / "ckpt")
  launch_workers(("train", 2, two, {"save": ckpt}))
  # The restores and the 1-process reference run side by side.
  launch_workers(
    ("resume", 2, fresh, {"restore": ckpt}), ("train,resume", 1, ref, {"restore": ckpt})
  )
  return {
    "train": [_load(two, "train", i) for i in range(2)],
    "resume": [_load(fresh, "resume", i) for i in range(2)],
    "ref_train": _load(ref, "train", 0),
    "ref_resume": _load(ref, "resume", 0),
  }


def _assert_same_bytes(a, b, keys=None):
  keys = sorted(a) if keys is None else keys
  assert keys and set(keys) <= set(b), sorted(set(keys) - set(b))
  for k in keys:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def _keys_of(finals, scenario):
  return sorted(k for k in finals if re.match(rf"{scenario}[\[.]", k))


# -- one decision, everywhere ----------------------------------------------------------


@pytest.mark.parametrize("scenario", w.SCENARIOS)
def test_overflow_in_one_process_makes_every_device_skip(runs, scenario):
  """Each process read the scale state from each of its 4 devices (the worker checks
  they agree); both processes and the 1-process run followed the same literal trajectory."""
  (r0, _), (r1, _) = runs["train"]
  ref, _ = runs["ref_train"]
  t0 = r0[scenario]["trajectory"]
  assert [t[0] for t in t0] == w.EXPECTED_SCALE
  assert [t[3] for t in t0] == w.EXPECTED_SKIPPED
  assert [t[4] for t in t0] == [0, 0, 1, 0, 0, 1, 0, 0, 0, 0]  # consecutive skips
  assert [t[1] for t in t0] == [1, 2, 0, 1, 2, 0, 1, 2, 0, 1]  # growth tracker
  assert r1[scenario]["trajectory"] == t0 == ref[scenario]["trajectory"]
  np.testing.assert_array_equal(r0[scenario]["loss"], r1[scenario]["loss"])
  np.testing.assert_array_equal(r0[scenario]["loss"], ref[scenario]["loss"])
  assert r0["process_index"] == 0 and r1["process_index"] == 1


@pytest.mark.parametrize("scenario", w.SCENARIOS)
def test_two_processes_are_bit_identical_to_one_process_with_gloo(runs, scenario):
  (_, f0), (_, f1) = runs["train"]
  _, ref = runs["ref_train"]
  keys = _keys_of(f0, scenario)
  assert any("params" in k for k in keys) and any(".mu" in k or "mu[" in k for k in keys)
  _assert_same_bytes(f0, f1, keys)  # every process gathered the same global values
  _assert_same_bytes(f0, ref, keys)


def test_explicit_and_auto_axes_are_bit_identical_across_processes(runs):
  (_, f0), _ = runs["train"]
  explicit, auto = _keys_of(f0, "fsdp_optax"), _keys_of(f0, "fsdp_optax_auto")
  assert [k.replace("fsdp_optax", "", 1) for k in explicit] == [
    k.replace("fsdp_optax_auto", "", 1) for k in auto
  ]
  for k, a in zip(explicit, auto):
    np.testing.assert_array_equal(f0[k], f0[a], err_msg=k)


def test_shard_map_with_axis_name_takes_the_jit_decision(runs):
  """Inside shard_map only the device owning the bad gradient row sees it; axis_name
  combines the flag over all 8 devices of both processes."""
  (r0, _), (r1, _) = runs["train"]
  for r in (r0, r1):
    assert r["shard_map"]["trajectory"] == r["fsdp_optax"]["trajectory"]


@pytest.mark.parametrize(
  "scenario", ["fsdp_optax", "fsdp_optax_auto", "fsdp_trainstate", "shard_map"]
)
def test_fsdp_leaves_stay_sharded_and_the_scale_state_is_replicated(runs, scenario):
  (r0, _), (r1, _) = runs["train"]
  for r in (r0, r1):
    for when in ("init_specs", "final_specs"):
      specs = r[scenario][when]
      for path, spec in specs.items():
        if "dynamic_scale" in path or "loss_scale" in path or path.endswith(("count", ".step")):
          assert spec == "()", (when, path, spec)
        else:  # params, Adam's mu and nu: split over the 8 devices on their first axis
          assert spec == "('d',)", (when, path, spec)


@pytest.mark.parametrize("scenario", ["dp_optax", "dp_trainstate"])
def test_data_parallel_state_is_replicated(runs, scenario):
  (r0, _), _ = runs["train"]
  assert set(r0[scenario]["final_specs"].values()) == {"()"}


# -- checkpoints ----------------------------------------------------------------------


@pytest.mark.parametrize("scenario", w.CHECKPOINTED)
def test_checkpoint_resumes_in_a_fresh_pair_of_processes(runs, scenario):
  (t0, f0), _ = runs["train"]
  for r, f in runs["resume"]:
    keys = _keys_of(f0, scenario)
    assert sorted(_keys_of(f, scenario)) == keys
    _assert_same_bytes(f0, f, keys)
    assert r[scenario]["trajectory"] == t0[scenario]["trajectory"][w.SAVE_AT :]
    assert r[scenario]["restored_specs"] == t0[scenario]["final_specs"]


@pytest.mark.parametrize("scenario", w.CHECKPOINTED)
def test_checkpoint_of_two_processes_resumes_in_one_process_of_eight_devices(runs, scenario):
  (t0, f0), _ = runs["train"]
  r, f = runs["ref_resume"]
  keys = _keys_of(f0, scenario)
  _assert_same_bytes(f0, f, keys)
  assert r[scenario]["trajectory"] == t0[scenario]["trajectory"][w.SAVE_AT :]
  # The skip before the save came through the checkpoint; one more skip after it.
  assert r[scenario]["trajectory"][0][3] == 1 and r[scenario]["trajectory"][-1][3] == 2


def test_eager_init_on_global_params_gives_a_state_orbax_saves(runs):
  """README recipe: ``tx.init(params)`` and ``TrainState.create`` eagerly on global params,
  no ``set_mesh``: every scalar of the scale state (and the step) is a global array,
  replicated on the params' mesh, and Orbax saves it from both processes."""
  for r, _ in runs["train"]:
    info = r["eager_init"]
    assert info["saved"], info
    assert not info["scale_fully_addressable"], info
    assert info["scalar_specs"] == ["()"], info


# -- host-side readers ----------------------------------------------------------------


@pytest.mark.parametrize("scenario", w.SCENARIOS)
def test_host_readers_agree_in_every_process(runs, scenario):
  """``metrics`` and ``check_skips`` on the host, on a state no process fully holds."""
  (r0, _), (r1, _) = runs["train"]
  expected = {
    "scale": 512.0,
    "growth_tracker": 1,
    "last_step_skipped": False,
    "skipped_steps": 2,
    "consecutive_skips": 0,
  }
  for r in (r0, r1):
    host = r[scenario]["host"]
    assert host["metrics"] == expected
    assert host["check_skips"] == 0
    assert host["raised"].startswith("2 steps skipped in total (limit 1); loss scale is now 512.")
    assert host["scale_replicated"] and not host["scale_fully_addressable"]
  assert r0[scenario]["host"] == r1[scenario]["host"]
  ref, _ = runs["ref_train"]
  assert ref[scenario]["host"]["scale_fully_addressable"]  # one process holds everything
  assert ref[scenario]["host"]["metrics"] == expected


# -- examples/multi_host.py --------------------------------------------------------------


def test_example_multi_host_smoke():
  """The example launches its own 2 workers; both print the same loss, scale and skips."""
  env = _env()
  # Its own process group: on a timeout the launcher and its two workers go together.
  proc = subprocess.Popen(
    [sys.executable, os.path.join(ROOT, "examples", "multi_host.py"), "--smoke"],
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    env=env,
    cwd=ROOT,
    start_new_session=True,
  )
  try:
    out, err = proc.communicate(timeout=LAUNCH_TIMEOUT)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    out, err = proc.communicate()
    pytest.fail(f"examples/multi_host.py --smoke timed out\n{out}\n{err}")
  if proc.returncode != 0 and "jax_cpu_collectives_implementation" in out + err and not IN_CI:
    pytest.skip(f"gloo CPU collectives are not available\n{err[-2000:]}")
  assert proc.returncode == 0, f"{out}\n{err}"
  assert "FAILED" not in out + err
  views = {}
  for line in out.splitlines():
    m = re.match(r"\[process (\d)\] (.*)$", line)
    if m:
      views.setdefault(int(m.group(1)), []).append(m.group(2))
  assert sorted(views) == [0, 1]
  assert views[0] == views[1]  # the same loss, scale and skip count in both processes
  assert views[0][0] == "4 of 8 devices (cpu), 2 processes"
  final = re.match(
    r"final loss ([\d.]+) \(first applied step ([\d.]+)\), scale (\d+), "
    r"skipped steps (\d+)$",
    views[0][-1],
  )
  assert final, views[0][-1]
  assert float(final.group(1)) < 0.5 * float(final.group(2))
  assert int(final.group(4)) > 0
