"""How far the order of the cross-device sums moves a run: gloo against in-process collectives.

The same 10 Adam steps of every scenario of ``tests/multiprocess_worker.py`` (data
parallel and FSDP, the Optax wrapper, the ``jax_lossscale.flax.TrainState`` field,
``shard_map``; a non-finite batch at steps 2 and 5) on 1 process x 8 CPU devices,
twice: summing through gloo (what ``tests/test_multiprocess.py`` compares 2 x 4 devices
with) and through XLA's in-process CPU collectives. Per scenario: the largest absolute
difference of the final params and of Adam's moments, and whether the scale
trajectory and the skip decisions are the same.

Usage (about a minute on 2 CPU cores)::

  python benchmarks/collectives_order.py             # writes benchmarks/results/collectives-order.md
  python benchmarks/collectives_order.py --out DIR   # the page elsewhere

Needs gloo in jaxlib (exit code 3 without it) and flax, like the worker.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "multiprocess_worker.py")
RESULTS = os.path.join(ROOT, "benchmarks", "results")
PAGE = "collectives-order.md"
COLLECTIVES = ("gloo", "in-process")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_worker(collectives: str, out: str, timeout: float = 600) -> tuple[dict, dict]:
  """The worker's ``train`` task on 1 process x 8 devices: (its record, its final leaves)."""
  os.makedirs(out, exist_ok=True)
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)  # the worker sets its own device count
  env["PYTHONPATH"] = os.pathsep.join(p for p in [ROOT, env.get("PYTHONPATH", "")] if p)
  argv = [sys.executable, WORKER, "train", "--process-id", "0", "--num-processes", "1"]
  argv += ["--port", str(_free_port()), "--out", out, "--collectives", collectives]
  done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
  if done.returncode:
    tail = "\n".join((done.stdout + done.stderr).splitlines()[-30:])
    sys.exit(f"collectives_order: the {collectives} run failed ({done.returncode}):\n{tail}")
  with open(os.path.join(out, "train-0.json")) as f:
    record = json.load(f)
  raw = np.load(os.path.join(out, "train-0.npz"))
  dtypes = record["leaf_dtypes"]
  return record, {k: raw[k].view(np.dtype(dtypes[k])) for k in raw.files}


def _kind(key: str) -> str | None:
  """``params``, ``moments`` (Adam's mu and nu) or ``None`` (counters, scale state)."""
  if ".mu" in key or ".nu" in key:
    return "moments"
  if "opt_state" not in key and "dynamic_scale" not in key and "params" in key:
    return "params"
  return None


def compare(runs: dict[str, tuple[dict, dict]]) -> list[dict]:
  (rec_a, leaves_a), (rec_b, leaves_b) = runs["gloo"], runs["in-process"]
  assert set(leaves_a) == set(leaves_b), sorted(set(leaves_a) ^ set(leaves_b))
  rows = []
  for scenario in [k for k in rec_a if isinstance(rec_a[k], dict) and "trajectory" in rec_a[k]]:
    row = {"scenario": scenario, "params": 0.0, "moments": 0.0, "identical": 0, "leaves": 0}
    for key in sorted(
      k for k in leaves_a if k.startswith(scenario + "[") or k.startswith(scenario + ".")
    ):
      a, b = leaves_a[key], leaves_b[key]
      row["leaves"] += 1
      row["identical"] += a.tobytes() == b.tobytes()
      kind = _kind(key[len(scenario) :])
      if kind is not None and np.issubdtype(a.dtype, np.floating):
        diff = np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)), initial=0.0)
        row[kind] = max(row[kind], float(diff))
    row["same_trajectory"] = rec_a[scenario]["trajectory"] == rec_b[scenario]["trajectory"]
    rows.append(row)
  return rows


def _cpu() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
    if names:
      return names[0]
  except OSError:
    pass
  return platform.processor() or platform.machine()


def render(rows: list[dict], jax_version: str) -> str:
  worst_p = max(r["params"] for r in rows)
  worst_m = max(r["moments"] for r in rows)
  same = all(r["same_trajectory"] for r in rows)
  lines = [
    "# gloo against in-process collectives (measured)",
    "",
    f"Written by `python benchmarks/collectives_order.py`, {time.strftime('%Y-%m-%d')}, "
    f"{_cpu()}, JAX {jax_version}: the 10 Adam steps of every scenario of "
    "`tests/multiprocess_worker.py` on 1 process x 8 CPU devices, summed through gloo and "
    "through the in-process collectives.",
    "",
    f"The two end up to {worst_p:.1e} apart in params and {worst_m:.1e} in Adam's moments "
    "(largest absolute difference), with "
    + (
      "the same skip decisions and scale trajectory."
      if same
      else "**different** skip decisions or scale trajectories."
    ),
    "",
    "| scenario | params | Adam moments | bit-identical leaves | same scale and skips |",
    "|---|---:|---:|---:|---|",
  ]
  for r in rows:
    lines.append(
      f"| `{r['scenario']}` | {r['params']:.1e} | {r['moments']:.1e} | "
      f"{r['identical']} of {r['leaves']} | {'yes' if r['same_trajectory'] else 'no'} |"
    )
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=RESULTS, help=f"folder for {PAGE}")
  args = parser.parse_args(argv)
  with tempfile.TemporaryDirectory(prefix="jls-collectives-") as tmp:
    runs = {c: run_worker(c, os.path.join(tmp, c)) for c in COLLECTIVES}
  version = subprocess.run(
    [sys.executable, "-c", "import jax; print(jax.__version__)"],
    capture_output=True,
    text=True,
    check=True,
  ).stdout.strip()
  text = render(compare(runs), version)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, PAGE), "w") as f:
    f.write(text)
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
