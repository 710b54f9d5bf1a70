"""Runs every example with ``--smoke`` in a subprocess (all started at once)."""

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = [
  "optax_quickstart.py",
  "flax_linen_trainstate.py",
  "flax_nnx.py",
  "gradient_accumulation.py",
  "data_parallel.py",
  "equinox_mlp.py",
  "transformer_lm.py",
]


@pytest.fixture(scope="module")
def runs():
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
  env.pop("XLA_FLAGS", None)  # data_parallel.py must set up its devices itself
  procs = {
    name: subprocess.Popen(
      [sys.executable, str(ROOT / "examples" / name), "--smoke"],
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
      env=env,
      cwd=ROOT,
    )
    for name in EXAMPLES
  }
  results = {}
  for name, proc in procs.items():
    try:
      out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
      proc.kill()
      out, err = proc.communicate()
    results[name] = (proc.returncode, out, err)
  return results


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_smoke(runs, name):
  rc, out, err = runs[name]
  assert rc == 0, f"{name} exited with {rc}\n{out}\n{err}"
  assert "final loss" in out and "scale" in out and "skipped" in out
  assert "FAILED" not in out + err


def test_transformer_smoke_logs_diagnostics_and_a_verdict(runs):
  rc, out, err = runs["transformer_lm.py"]
  assert rc == 0, err
  # The corpus is named with its size; the logged chunks name the leaf with
  # the least headroom (a module path of the linen params).
  assert "argparse.py" in out and "bytes;" in out
  logged = [line for line in out.splitlines() if line.startswith("[float16 + scaling] steps")]
  assert len(logged) == 2, out  # --smoke: 20 steps, logged every 10
  for line in logged:
    m = re.search(r"min headroom (-?[0-9.]+|-?inf) \((\S+)\)", line)
    assert m, line
    assert m.group(2).split("/")[0] in ("embed", "pos", "layers_0", "ln_f", "head"), line
  # check_underflow's one-line verdict at the end.
  last = out.strip().splitlines()[-1]
  assert last.startswith(("NEEDS loss scaling", "does not need loss scaling")), out


def test_example_fails_loudly():
  # One step cannot halve the loss (and is skipped): main() must report failure.
  spec = importlib.util.spec_from_file_location(
    "optax_quickstart", ROOT / "examples" / "optax_quickstart.py"
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  with jax.numpy_dtype_promotion("standard"):  # examples run with JAX's default promotion
    assert module.main(["--steps", "1"]) == 1
