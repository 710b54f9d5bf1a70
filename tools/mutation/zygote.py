"""A warm Python for ``mutate.py``: the third-party imports done once, one fork per pytest run.

Each pytest run of a mutant pays Python's start and the imports of JAX, Flax, Optax,
Equinox, chex, hypothesis and torch (about 3 s on an idle core, far more on a busy one)
before its first test. ``mutate.py --zygote`` starts one of these per copy of the
repository, with that copy's environment, and sends it one request a line (JSON:
``{"args": [...], "out": path, "timeout": seconds}``). It forks; the child runs
``pytest.main(args)`` in the copy with its output in ``out``, and the parent answers
``{"rc": exit code}`` (``-1`` on a timeout, the child killed).

The package under test is never imported here, only in each child, so every run imports
the mutated sources afresh. JAX's backends are not initialised here either (importing
JAX does not start them), so each child starts its own, with the copy's ``XLA_FLAGS`` as
set by ``tests/conftest.py``.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import time

#: The exit code of a child that could not run pytest at all (never a kill).
CHILD_FAILED = 70

_WARM = (
  "numpy",
  "jax",
  "jax.numpy",
  "optax",
  "chex",
  "equinox",
  "flax.linen",
  "flax.nnx",
  "hypothesis",
  "torch",
  "pytest",
)


def _run(args: list[str], out: str) -> None:
  """The child: pytest over ``args`` with stdout and stderr in ``out``; never returns."""
  rc = CHILD_FAILED
  try:
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    import pytest

    # The plugins imported above (jaxtyping's, through equinox) are not rewritten for
    # assertions again: pytest warns of it, and the suite turns warnings into errors.
    rc = int(pytest.main(["-W", "ignore::pytest.PytestAssertRewriteWarning", *args]))
  except BaseException as e:  # anything the child raises is its exit code
    print(f"zygote child: {type(e).__name__}: {e}", flush=True)
  finally:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def _wait(pid: int, timeout: float) -> int:
  deadline = time.monotonic() + timeout
  while True:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
      return os.waitstatus_to_exitcode(status)
    if time.monotonic() > deadline:
      os.kill(pid, signal.SIGKILL)
      os.waitpid(pid, 0)
      return -1
    time.sleep(0.05)


def main() -> None:
  for name in _WARM:
    try:
      importlib.import_module(name)
    except ImportError:
      pass  # an optional one this venv lacks: its tests skip, in the child as anywhere
  if any(m == "jax_lossscale" or m.startswith("jax_lossscale.") for m in sys.modules):
    sys.exit("zygote: jax_lossscale was imported before a fork; each run must import its own")
  print(json.dumps({"ready": True}), flush=True)
  for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
      sys.stdin.close()
      _run(req["args"], req["out"])
    rc = _wait(pid, float(req["timeout"]))
    print(json.dumps({"rc": rc}), flush=True)


if __name__ == "__main__":
  main()
