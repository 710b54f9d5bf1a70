"""``make mutate``: semantic mutation testing of the core modules.

Each mutant in ``tests/mutants.py`` is one realistic bug: an exact snippet of
a core module and its replacement. For every mutant the runner

1. copies the repository (``git ls-files``: tracked and untracked, not
   ignored; or the last commit with ``--head``) to a temporary directory,
   once; the checkout itself is never modified;
2. replaces the snippet (which must occur exactly once) in that copy;
3. runs only the covering tests with ``pytest -x -q -p no:cacheprovider``,
   importing the package from the copy;
4. restores the file.

A mutant is *killed* when its tests fail (or time out), *survived* when they
pass, and *equivalent* when it survives and carries a reason why no test can
tell it from the original (a mutant marked equivalent that is killed counts
as killed and is flagged in the report). The exit status is 1 when a mutant
survives that carries no ``note`` explaining why. Before any mutant runs, every
snippet is checked (exactly one match) and the unmutated copy must pass all
covering tests; either failure stops the run with exit status 2.

Why not mutmut 3: it mutates operators one token at a time and runs its own
per-mutant test mapping; most of its mutants here would be jit-cache or
docstring noise, each JAX test process pays ~3 s of imports, and its
trampoline rewrites every function (which changes what ``jax.jit`` traces).
A list of semantic mutants, each naming the tests that should kill it, stays
within ~30 minutes on 2 cores and documents the promise each test guards.

Usage::

  python tests/mutate.py                 # all mutants, writes tests/mutation-report.md
  python tests/mutate.py --list          # list the mutants and check their snippets
  python tests/mutate.py --only NAME...  # some mutants (report not written)
  python tests/mutate.py --head          # the last commit, not the working tree
  python tests/mutate.py --only NAME --tests tests/test_x.py::test_y  # does this test kill it?
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from mutants import MUTANTS  # noqa: E402
from mutants import Mutant  # noqa: E402

REPORT = os.path.join(HERE, "mutation-report.md")


def check_snippets(root: str, mutants: list[Mutant]) -> list[str]:
  """Every mutant whose snippet does not occur exactly once, with the count."""
  errors = []
  for m in mutants:
    path = os.path.join(root, m.file)
    if not os.path.exists(path):
      errors.append(f"{m.name}: {m.file} does not exist")
      continue
    with open(path) as f:
      count = f.read().count(m.old)
    if count != 1:
      errors.append(f"{m.name}: snippet found {count} times in {m.file}: {m.old!r}")
      continue
    try:  # a mutant that does not compile would be "killed" by any test
      with open(path) as f:
        compile(f.read().replace(m.old, m.new, 1), path, "exec")
    except SyntaxError as e:
      errors.append(f"{m.name}: the mutated {m.file} does not compile: {e}")
  names = [m.name for m in mutants]
  errors += [f"duplicate mutant name {n}" for n in sorted({n for n in names if names.count(n) > 1})]
  return errors


def copy_repo(dest: str, head: bool = False) -> None:
  """The working tree's files that git knows or would add (no .venv, no caches).

  With ``head``, the files of the last commit instead (``git archive HEAD``),
  e.g. while the working tree is in the middle of an edit.
  """
  if head:
    archive = subprocess.run(
      ["git", "archive", "--format=tar", "HEAD"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
    return
  out = subprocess.run(
    ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
    cwd=ROOT,
    capture_output=True,
    check=True,
  ).stdout.decode()
  for rel in filter(None, out.split("\0")):
    src = os.path.join(ROOT, rel)
    if not os.path.isfile(src):
      continue  # deleted in the working tree
    os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
    shutil.copy2(src, os.path.join(dest, rel))


def pytest_env(copy: str) -> dict[str, str]:
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([copy, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
  env["JAX_PLATFORMS"] = "cpu"
  env.pop("CI", None)  # the selection is deliberate; skips are not failures here
  env["PYTHONDONTWRITEBYTECODE"] = "1"  # a stale .pyc must never hide a mutant
  env["JAX_LOSSSCALE_MUTATE"] = "1"  # conftest: hypothesis does not shrink failures
  return env


# pytest exit codes: 0 passed, 1 tests failed, 2 interrupted (e.g. an import
# error during collection), 3 internal error, 4 usage error (e.g. a test id
# that does not exist), 5 no tests collected. 4 and 5 mean the mutant's test
# list is wrong, never that the mutant was caught.
_BAD_SELECTION = (4, 5)


def run_tests(copy: str, tests: tuple[str, ...], timeout: float) -> tuple[int, str, float]:
  """(pytest exit code, summary lines, seconds) of pytest over ``tests`` in the copy.

  The exit code is -1 on a timeout (a mutant that hangs counts as killed).
  """
  cmd = [
    sys.executable,
    "-m",
    "pytest",
    "-x",
    "-q",
    "-rfE",
    "-p",
    "no:cacheprovider",
    "-o",
    "addopts=",
    *tests,
  ]
  t0 = time.perf_counter()
  try:
    out = subprocess.run(
      cmd, cwd=copy, env=pytest_env(copy), capture_output=True, text=True, timeout=timeout
    )
  except subprocess.TimeoutExpired:
    return -1, f"timed out after {timeout:.0f} s", time.perf_counter() - t0
  dt = time.perf_counter() - t0
  lines = (out.stdout + out.stderr).strip().splitlines()
  failed = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
  return out.returncode, "\n".join(failed[:1] + lines[-2:]), dt


def check_imports_from_copy(copy: str) -> None:
  code = "import jax_lossscale, sys; sys.stdout.write(jax_lossscale.__file__)"
  out = subprocess.run(
    [sys.executable, "-c", code],
    cwd=copy,
    env=pytest_env(copy),
    capture_output=True,
    text=True,
    check=True,
  ).stdout
  if not os.path.realpath(out).startswith(os.path.realpath(copy)):
    sys.exit(f"mutate: the copy imports jax_lossscale from {out}, not from {copy}")


def summary_line(results) -> str:
  killed = sum(r["status"] == "killed" for r in results)
  equivalent = sum(r["status"] == "equivalent" for r in results)
  survived = sum(r["status"] == "survived" for r in results)
  return f"{len(results)} mutants: {killed} killed, {equivalent} equivalent, {survived} survived"


def write_report(path: str, results, seconds: float, baseline_s: float) -> None:
  lines = [
    "# Mutation report",
    "",
    "Written by `make mutate` (`tests/mutate.py`, mutants in `tests/mutants.py`). Each mutant is",
    "one realistic bug in a core module; it is applied in a temporary copy of the repository and",
    "only its covering tests run (`pytest -x -q -p no:cacheprovider`). *killed*: the tests fail;",
    "*equivalent*: the tests pass and the mutant cannot change any observable value (reason",
    "given); *survived*: the tests pass although the mutant is a real bug.",
    "",
    f"Run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs, "
    f"{seconds / 60:.1f} min in all (baseline of the unmutated copy: {baseline_s:.0f} s).",
    "",
    "| mutant | file | result | s | killed by / output |",
    "|---|---|---|---:|---|",
  ]
  for r in results:
    m = r["mutant"]
    out_lines = r["output"].splitlines()
    detail = out_lines[-1] if out_lines else ""
    if r["status"] == "killed" and out_lines:
      detail = out_lines[0]
    detail = detail.split(" - ")[0]  # the test id, without the assertion text
    detail = detail.replace("|", "\\|")
    lines.append(f"| `{m.name}` | `{m.file}` | {r['status']} | {r['seconds']:.0f} | {detail} |")
  lines += ["", "## Mutants and what they break", ""]
  for r in results:
    m = r["mutant"]
    lines.append(f"- `{m.name}` ({m.file}): {m.why}")
  equivalents = [r for r in results if r["status"] == "equivalent"]
  lines += ["", "## Equivalent mutants", ""]
  lines += [f"- `{r['mutant'].name}`: {r['mutant'].equivalent}" for r in equivalents] or ["None."]
  flagged = [r for r in results if r["mutant"].equivalent and r["status"] == "killed"]
  if flagged:
    lines += [
      "",
      "Marked equivalent but killed (the mark is wrong): "
      + ", ".join(f"`{r['mutant'].name}`" for r in flagged),
    ]
  survivors = [r for r in results if r["status"] == "survived"]
  lines += ["", "## Survivors", ""]
  lines += [
    f"- `{r['mutant'].name}` ({r['mutant'].file}): {r['mutant'].why}. "
    f"{'Why it survives: ' + r['mutant'].note if r['mutant'].note else 'Not explained.'}"
    for r in survivors
  ] or ["None."]
  lines += ["", summary_line(results)]
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--list", action="store_true", help="list the mutants, check snippets")
  parser.add_argument("--only", nargs="+", default=None, help="run only these mutants")
  parser.add_argument("--timeout", type=float, default=600.0, help="seconds per mutant")
  parser.add_argument(
    "--report", default=None, help=f"report path (default {REPORT} for a full run)"
  )
  parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run")
  parser.add_argument(
    "--tests",
    nargs="+",
    default=None,
    help="run these tests instead of each mutant's own (to show that a "
    "given test kills a given mutant)",
  )
  parser.add_argument(
    "--head", action="store_true", help="mutate the last commit instead of the working tree"
  )
  args = parser.parse_args(argv)

  mutants = list(MUTANTS)
  if args.only:
    unknown = set(args.only) - {m.name for m in mutants}
    if unknown:
      sys.exit(f"mutate: unknown mutants {sorted(unknown)}")
    mutants = [m for m in mutants if m.name in args.only]
  if args.tests:
    mutants = [dataclasses.replace(m, tests=tuple(args.tests)) for m in mutants]
  report = args.report or (REPORT if not (args.only or args.tests) else None)

  t_start = time.perf_counter()
  with tempfile.TemporaryDirectory(prefix="jls-mutate-") as copy:
    copy_repo(copy, head=args.head)
    errors = check_snippets(copy, list(MUTANTS))
    if errors:
      print("mutate: mutants out of date with the code (fix tests/mutants.py):", file=sys.stderr)
      for e in errors:
        print("  " + e, file=sys.stderr)
      return 2
    if args.list:
      for m in mutants:
        print(f"{m.name:40s} {m.file:32s} {' '.join(m.tests)}")
      print(f"{len(mutants)} mutants, all snippets match exactly once")
      return 0
    check_imports_from_copy(copy)
    baseline_s = 0.0
    if not args.no_baseline:
      tests = tuple(sorted({t for m in mutants for t in m.tests}))
      rc, output, baseline_s = run_tests(copy, tests, args.timeout * 2)
      print(
        f"baseline ({len(tests)} test paths): {'pass' if rc == 0 else 'FAIL'} in "
        f"{baseline_s:.0f} s",
        flush=True,
      )
      if rc != 0:
        print(output, file=sys.stderr)
        print(
          "mutate: the unmutated code fails its covering tests; fix that first", file=sys.stderr
        )
        return 2
    results = []
    for i, m in enumerate(mutants, 1):
      path = os.path.join(copy, m.file)
      with open(path) as f:
        original = f.read()
      with open(path, "w") as f:
        f.write(original.replace(m.old, m.new, 1))
      try:
        rc, output, dt = run_tests(copy, m.tests, args.timeout)
      finally:
        with open(path, "w") as f:
          f.write(original)
      if rc in _BAD_SELECTION:
        print(output, file=sys.stderr)
        print(
          f"mutate: {m.name}: pytest exit code {rc}: its test list selects nothing "
          "runnable; fix tests/mutants.py",
          file=sys.stderr,
        )
        return 2
      status = "killed" if rc != 0 else ("equivalent" if m.equivalent else "survived")
      results.append(dict(mutant=m, status=status, output=output, seconds=dt))
      first = output.splitlines()[0] if output else ""
      print(
        f"[{i}/{len(mutants)}] {m.name}: {status} ({dt:.0f} s) {first if rc else ''}", flush=True
      )
      if status == "survived" or (status == "killed" and m.equivalent):
        print("    " + output.replace("\n", "\n    "), flush=True)
  total = time.perf_counter() - t_start
  line = summary_line(results)
  if report:
    write_report(report, results, total, baseline_s)
    print(f"wrote {os.path.relpath(report, ROOT)}")
  print(f"{line} ({total / 60:.1f} min)")
  # A survivor fails the run unless its mutant carries a note saying why it survives.
  return 1 if any(r["status"] == "survived" and not r["mutant"].note for r in results) else 0


if __name__ == "__main__":
  sys.exit(main())
