"""Runs every example with ``--smoke`` in a subprocess (all started at once)."""

import concurrent.futures
import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import time

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


# Each example alone takes 4-20 s on one CPU core. They used to be started all
# at once and waited for in list order, each with its own 240 s timeout: the
# first one's clock (optax_quickstart.py) ran while all seven competed for the
# cores (36 s instead of 4 s alone on a loaded 2-core machine), whereas each
# later one's clock only started once the previous had been collected. Under
# load the first example could therefore time out (and failed once) while the
# others never could. Now at most one example runs per core, each timed from
# its own start, with its output in files (no pipe can fill and block it).
TIMEOUT_S = 240


def _run_example(name, env, tmp):
  out_path, err_path = tmp / f"{name}.out", tmp / f"{name}.err"
  t0 = time.monotonic()
  with open(out_path, "w") as out, open(err_path, "w") as err:
    try:
      rc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), "--smoke"],
        stdout=out,
        stderr=err,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=TIMEOUT_S,
      ).returncode
      note = ""
    except subprocess.TimeoutExpired:
      rc = -9
      note = f"\ntimed out after {TIMEOUT_S} s (load average {os.getloadavg()})"
  seconds = time.monotonic() - t0
  return rc, out_path.read_text(), err_path.read_text() + note + f"\n({seconds:.0f} s)"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
  env.pop("XLA_FLAGS", None)  # data_parallel.py must set up its devices itself
  tmp = tmp_path_factory.mktemp("examples")
  workers = max(1, min(len(EXAMPLES), os.cpu_count() or 1))
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    # The longest first, so that it does not start last.
    order = sorted(EXAMPLES, key=lambda n: n != "transformer_lm.py")
    futures = {name: pool.submit(_run_example, name, env, tmp) for name in order}
    return {name: futures[name].result() for name in EXAMPLES}


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
