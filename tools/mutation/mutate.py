"""``make mutate``: mutation testing of every module, hand-written and generated mutants.

Two kinds of mutant:

* **hand-written** (``tools/mutation/mutants.py``): one realistic bug each, an exact
  snippet of a module and its replacement, with the tests that should kill it;
* **generated** (``tools/mutation/mutagen.py``): an AST walk over every module of
  ``jax_lossscale/`` (enumerated, so a new module is included) applying six
  operators at every site: a keyword argument dropped, a comparison flipped or
  made (non-)strict, a bound removed, a ``raise`` deleted, a reduction
  swapped, a branch forced. Each is named ``module:function:operator:hash``
  (no line number, so the name survives edits elsewhere) and runs
  only the tests that executed its line, from a per-test coverage map
  computed once (one coverage context per test) and cached under
  ``.mutate-cache/`` by a hash of the sources; at most ``--max-tests`` of
  them, fastest first.

For every mutant the runner applies it in a temporary copy of the repository
(``git ls-files``: tracked and untracked, not ignored; or the last commit
with ``--head``; one copy per job, the checkout itself is never modified),
runs its tests with ``pytest -x -q -p no:cacheprovider`` importing the
package from the copy, and restores the file.

Results are cached under ``.mutate-cache/``: a result is reused for the same
package and the same tests; a kill is also reused for the same package while
the killing test's code (its test file without the other tests) is the same,
so adding tests re-runs only the survivors and the kills they could affect.
``--no-result-cache`` runs everything.

The test that last killed each generated mutant is committed in ``killers.json``
(by name) and runs first among the mutant's tests, so a run on changed sources or
on a fresh machine kills most mutants with one test instead of escalating to the
covering ones; a hint that no longer kills is forgotten. A mutant explained in
``EQUIVALENT`` runs its chosen tests only, never the escalation.

A mutant is *killed* when its tests fail (or time out), *survived* when they
pass (or when no test runs its line), and *equivalent* when it survives and
its name is explained in ``EQUIVALENT`` (generated) or carries an
``equivalent`` reason (hand-written); a mutant marked equivalent that is
killed counts as killed and is flagged. The exit status is 1 when a mutant
survives unexplained (a hand-written one may carry a ``note``), 2 when the
set-up is wrong (a snippet out of date, the unmutated code failing its
tests, a test list selecting nothing).

Why not mutmut 3: its per-token operators would be mostly jit-cache and
docstring noise here, and its trampoline rewrites every function (which
changes what ``jax.jit`` traces); each JAX test process pays ~3 s of imports,
so a mutant must run few, chosen tests.

Usage::

  python tools/mutation/mutate.py                      # everything, writes tools/mutation/mutation-report.md
  python tools/mutation/mutate.py --list               # list the mutants (and check the snippets)
  python tools/mutation/mutate.py --modules _state _flax --no-hand  # generated mutants of two modules
  python tools/mutation/mutate.py --sample 4 --limit 50           # every 4th generated mutant, 50 at most
                                                       # (a sized run: its report goes to .mutate-cache/)
  python tools/mutation/mutate.py --only NAME...       # some mutants (report not written)
  python tools/mutation/mutate.py --only NAME --tests tests/test_x.py::test_y  # does this test kill it?
  python tools/mutation/mutate.py --head               # the last commit, not the working tree
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import dataclasses
import hashlib
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))  # tools/mutation
ROOT = os.path.dirname(os.path.dirname(HERE))  # the repository root: tests/ and jax_lossscale/
sys.path.insert(0, HERE)

import mutagen  # noqa: E402
from mutants import EQUIVALENT  # noqa: E402
from mutants import MUTANTS  # noqa: E402
from mutants import PINNED  # noqa: E402
from mutants import Mutant  # noqa: E402

REPORT = os.path.join(HERE, "mutation-report.md")
# The test that last killed each generated mutant, by name: committed, so that a run on
# changed sources (a fresh machine, an edited module) tries it first. A hint is only an
# order: it is run on the mutant as any selected test is, and a kill is still a kill.
KILLERS = os.path.join(HERE, "killers.json")
CACHE = os.path.join(ROOT, ".mutate-cache")
# The tests whose coverage selects the generated mutants' tests: the in-process
# suite. Left out: tests that run their code in subprocesses (coverage cannot
# see it) or time a benchmark.
COVERAGE_EXCLUDE = {
  "test_examples.py",
  "test_bench.py",
  "test_gpu.py",
  "test_demo.py",
  "test_multiprocess.py",
  "test_entry_points_async.py",
  "test_guarantees.py",  # collects the cited tests in a subprocess; runs no package code
  # Compiles for a compile-only GPU, which cannot load an executable from the persistent
  # compilation cache the runs share (JAX warns once the process has used that cache, and
  # the suite turns warnings into errors): every such test would fail unmutated.
  "test_gpu_plan.py",
}


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
  # JAX's persistent compilation cache, one per copy (one pytest at a time uses
  # it, so no two processes write one entry at once). Its key is the compiled
  # HLO, so a mutant that changes a computation misses it and one that changes
  # only host-side code hits it: a test runs about 3x faster on a warm cache. No
  # test counts backend compilations (the no-recompilation tests read jit's
  # in-memory cache), so a hit cannot hide a mutant.
  env["JAX_COMPILATION_CACHE_DIR"] = os.path.join(CACHE, "jax-" + os.path.basename(copy))
  env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
  return env


# pytest exit codes: 0 passed, 1 tests failed, 2 interrupted (e.g. an import
# error during collection), 3 internal error, 4 usage error (e.g. a test id
# that does not exist), 5 no tests collected. 4 and 5 mean the mutant's test
# list is wrong, never that the mutant was caught.
_BAD_SELECTION = (4, 5)


class Zygote:
  """A warm Python for one copy (``zygote.py``): each pytest run is a fork of it."""

  def __init__(self, copy: str):
    self.out = os.path.join(copy, ".zygote-out.txt")
    self.proc = subprocess.Popen(
      [sys.executable, os.path.join(HERE, "zygote.py")],
      cwd=copy,
      env=pytest_env(copy),
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      text=True,
    )
    ready = self.proc.stdout.readline()
    if not ready.strip():
      raise RuntimeError("mutate: the zygote did not start (see its stderr above)")

  def run(self, args: list[str], timeout: float) -> tuple[int, str]:
    req = {"args": args, "out": self.out, "timeout": timeout}
    self.proc.stdin.write(json.dumps(req) + "\n")
    self.proc.stdin.flush()
    rc = json.loads(self.proc.stdout.readline())["rc"]
    with open(self.out, errors="replace") as f:
      return rc, f.read()

  def close(self) -> None:
    self.proc.stdin.close()
    self.proc.wait(timeout=60)


#: The zygote of each copy, with ``--zygote`` (one thread uses a copy at a time).
_ZYGOTES: dict[str, Zygote] = {}


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
  zygote = _ZYGOTES.get(copy)
  if zygote is not None:
    rc, text = zygote.run(cmd[3:], timeout)
    if rc == 70:  # zygote.CHILD_FAILED: pytest never ran
      raise RuntimeError(f"mutate: the zygote's child could not run pytest:\n{text[-3000:]}")
    if rc == -1:
      return -1, f"timed out after {timeout:.0f} s", time.perf_counter() - t0
  else:
    try:
      out = subprocess.run(
        cmd, cwd=copy, env=pytest_env(copy), capture_output=True, text=True, timeout=timeout
      )
    except subprocess.TimeoutExpired:
      return -1, f"timed out after {timeout:.0f} s", time.perf_counter() - t0
    rc, text = out.returncode, out.stdout + out.stderr
  dt = time.perf_counter() - t0
  lines = text.strip().splitlines()
  failed = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
  conftest = [ln for ln in lines if "while loading conftest" in ln]
  if rc in _BAD_SELECTION and (conftest or any(ln.startswith("ERROR tests/") for ln in failed)):
    # A test module, or tests/conftest.py with tests/helpers.py, that fails to import (the
    # mutant breaks module-level code, such as a helper decorated by autocast_op) leaves its
    # node ids unselectable: exit code 4, but a kill, as the same ids ran on the unmutated
    # code. pytest says 2 for it when given files.
    rc = 2
    failed = failed or conftest
  return rc, "\n".join(failed[:1] + lines[-2:]), dt


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


def _counts(results) -> str:
  n = lambda st: sum(r["status"] == st for r in results)
  return (
    f"{len(results)} run, {n('killed')} killed, {n('equivalent')} equivalent, "
    f"{n('survived')} survived"
  )


def unexplained(results) -> list[dict]:
  """Survivors with no reason given (a hand-written mutant's ``note`` is a reason)."""
  return [r for r in results if r["status"] == "survived" and not r.get("note")]


def summary_line(results) -> str:
  hand = [r for r in results if r["kind"] == "hand"]
  gen = [r for r in results if r["kind"] == "generated"]
  return (
    f"mutate: hand-written {_counts(hand)}; generated {_counts(gen)}; "
    f"{len(unexplained(results))} unexplained survivors"
  )


def _detail(r) -> str:
  out_lines = r["output"].splitlines()
  detail = out_lines[-1] if out_lines else ""
  if r["status"] == "killed" and out_lines:
    detail = out_lines[0]
  detail = detail.split(" - ")[0]  # the test id, without the assertion text
  return detail.replace("|", "\\|")


def tree_of(head: bool) -> str:
  """The mutated tree: the last commit, and whether uncommitted changes were mutated too."""
  git = lambda *a: subprocess.run(
    ["git", *a], cwd=ROOT, capture_output=True, text=True, check=True
  ).stdout.strip()
  commit = git("rev-parse", "--short", "HEAD")
  # killers.json is rewritten by the run itself: not a change of what is mutated.
  dirty = not head and [
    line
    for line in git("status", "--porcelain", "--untracked-files=no").splitlines()
    if not line.endswith("tools/mutation/killers.json")
  ]
  return f"commit {commit}" + (" with uncommitted changes" if dirty else "")


def write_report(
  path: str, results, seconds: float, selection: list[str], tree: str, sized: bool
) -> None:
  lines = [
    "# Mutation report" + (" (a sized run)" if sized else ""),
    "",
    "Written by `make mutate` (`tools/mutation/mutate.py`). Two kinds of mutant, each applied in a",
    "temporary copy of the repository, with only its tests run (`pytest -x`):",
    "",
    "* *hand-written* (`tools/mutation/mutants.py`): one realistic bug each, with the tests meant to",
    "  kill it;",
    "* *generated* (`tools/mutation/mutagen.py`): every site of six operators in every module of",
    "  `jax_lossscale/` (a keyword argument dropped, a comparison flipped or made",
    "  (non-)strict, a bound removed, a `raise` deleted, a reduction swapped, a branch",
    "  forced), named `module:function:operator:hash`; each runs the fastest tests that ran its",
    "  line (per-test coverage, computed once), and, if it survives them, the other tests",
    "  that ran it (up to the limit given under Selection).",
    "",
    "*killed*: the tests fail; *equivalent*: they pass and the mutant cannot change an",
    "observable value (reason given, `EQUIVALENT` in `tools/mutation/mutants.py` for generated ones);",
    "*survived*: they pass (or no test runs the line) although the mutant is a real bug.",
    "",
    f"Run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {tree}, {os.cpu_count()} CPUs, "
    f"{seconds / 60:.1f} min in all"
    + (
      f" ({n_cached} results reused from earlier runs: the same package, and the same tests "
      "or the same killing test)."
      if (n_cached := sum(bool(r.get("cached")) for r in results))
      else "."
    ),
    "",
    "Selection: " + "; ".join(selection) + ".",
    "",
    "**" + summary_line(results) + "**",
    "",
  ]
  for kind, title in (("hand", "Hand-written mutants"), ("generated", "Generated mutants")):
    group = [r for r in results if r["kind"] == kind]
    lines += [f"## {title}", "", _counts(group) + ".", ""]
    if not group:
      continue
    lines += [
      "| mutant | line | result | s | tests | killed by / output |",
      "|---|---:|---|---:|---:|---|",
    ]
    for r in group:
      n_tests = len(r["tests"]) + len(r.get("more_tests", ()))
      lines.append(
        f"| `{r['name']}` | {r.get('line', '')} | {r['status']} | {r['seconds']:.0f} | "
        f"{n_tests} | {_detail(r)} |"
      )
    lines.append("")
  hand = [r for r in results if r["kind"] == "hand"]
  if hand:
    lines += ["## Hand-written mutants and what they break", ""]
    lines += [f"- `{r['name']}` ({r['file']}): {r['why']}" for r in hand]
    lines.append("")
  equivalents = [r for r in results if r["status"] == "equivalent"]
  lines += ["## Equivalent mutants", ""]
  lines += [f"- `{r['name']}` ({r['why']}): {r['equivalent']}" for r in equivalents] or ["None."]
  flagged = [r for r in results if r["equivalent"] and r["status"] == "killed"]
  if flagged:
    lines += [
      "",
      "Marked equivalent but killed (the mark is wrong): "
      + ", ".join(f"`{r['name']}`" for r in flagged),
    ]
  survivors = [r for r in results if r["status"] == "survived"]
  lines += ["", "## Survivors", ""]
  lines += [
    f"- `{r['name']}` ({r['file']}): {r['why']}. "
    f"{'Why it survives: ' + r['note'] if r.get('note') else 'Not explained.'}"
    for r in survivors
  ] or ["None."]
  lines += ["", summary_line(results)]
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")


def _snippet_line(m: Mutant) -> int | str:
  path = os.path.join(ROOT, m.file)
  if not os.path.isfile(path):
    return ""
  with open(path) as f:
    before, found, _ = f.read().partition(m.old)
  return before.count("\n") + 1 if found else ""


def _hand_task(m: Mutant) -> dict:
  return dict(
    kind="hand",
    name=m.name,
    file=m.file,
    line=_snippet_line(m),
    why=m.why,
    tests=m.tests,
    equivalent=m.equivalent,
    note=m.note,
    apply=lambda src, m=m: src.replace(m.old.encode(), m.new.encode(), 1),
  )


def _generated_task(
  m: mutagen.GenMutant, tests: tuple[str, ...], more_tests: tuple[str, ...] = ()
) -> dict:
  return dict(
    kind="generated",
    name=m.name,
    file=m.file,
    line=m.line,
    why=m.why,
    tests=tests,
    more_tests=tuple(t for t in more_tests if t not in tests),
    equivalent=EQUIVALENT.get(m.name),
    note=None,
    apply=m.apply,
  )


def _package_key(copy: str, task: dict, mutated: bytes) -> str:
  """A hash of the mutant and the package it lives in (every module, conftest, helpers), not the tests."""
  h = hashlib.sha256(task["name"].encode() + b"\0" + mutated)
  for rel in [f for f in mutagen.package_modules(copy) if f != task["file"]] + list(
    mutagen.TEST_SUPPORT
  ):
    with open(os.path.join(copy, rel), "rb") as f:
      h.update(rel.encode() + f.read())
  return h.hexdigest()[:24]


def _result_key(copy: str, task: dict, package_key: str) -> str:
  """A hash of what decides a mutant's result: the mutated package, its tests and their files."""
  h = hashlib.sha256(package_key.encode())
  tests = (*task["tests"], *task.get("more_tests", ()))
  for rel in sorted({t.split("::")[0] for t in tests if t.endswith(".py") or "::" in t}):
    path = os.path.join(copy, rel)
    if os.path.isfile(path):
      with open(path, "rb") as f:
        h.update(rel.encode() + f.read())
  h.update("\0".join(task["tests"]).encode())
  h.update(b"\1" + "\0".join(task.get("more_tests", ())).encode())
  return h.hexdigest()[:24]


def load_killers() -> dict[str, str]:
  """The killers file: mutant name -> the node id of the test that last killed it."""
  if not os.path.exists(KILLERS):
    return {}
  with open(KILLERS) as f:
    return json.load(f)


def save_killers(killers: dict[str, str]) -> None:
  with open(KILLERS, "w") as f:
    json.dump(dict(sorted(killers.items())), f, indent=0)
    f.write("\n")


def update_killers(killers: dict[str, str], r: dict) -> bool:
  """Records the generated mutant ``r``'s killer, or forgets a hint it survived; True if changed."""
  if r["kind"] != "generated":
    return False
  name = r["name"]
  if r["status"] == "killed":
    killer = _killer(r["output"])
    if killer and killers.get(name) != killer:
      killers[name] = killer
      return True
  elif r["status"] in ("survived", "equivalent") and name in killers:
    if killers[name] in (*r["tests"], *r.get("more_tests", ())):
      del killers[name]  # it ran, and no longer kills
      return True
  return False


def _killer(output: str) -> str | None:
  """The node id of the test that failed first, from pytest's short summary."""
  found = re.search(r"(?:FAILED|ERROR) (tests/\S+\.py::\S+)", output)
  return found.group(1) if found else None


def killer_source_hash(root: str, nodeid: str) -> str | None:
  """A hash of what one test runs: its test file without the *other* tests' definitions.

  The file's imports, helpers, fixtures and constants count, and the test's
  own function (or class) with its decorators; other ``test_*`` functions and
  ``Test*`` classes do not, so adding or editing another test keeps the hash.
  Formatting and comments do not count (``ast.dump``). ``None`` if the test is
  not found.
  """
  path, _, rest = nodeid.partition("::")
  own = rest.split("::")[0].split("[")[0]
  try:
    with open(os.path.join(root, path)) as f:
      tree = ast.parse(f.read())
  except (OSError, SyntaxError):
    return None
  is_test = lambda n: (
    (isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test"))
    or (isinstance(n, ast.ClassDef) and n.name.startswith("Test"))
  )
  kept = [n for n in tree.body if not is_test(n) or n.name == own]
  if not any(is_test(n) and n.name == own for n in kept):
    return None
  return hashlib.sha256("\n".join(ast.dump(n) for n in kept).encode()).hexdigest()[:24]


def _run_task(task: dict, copies: queue.Queue, timeout: float, use_cache: bool) -> dict:
  copy = copies.get()
  try:
    path = os.path.join(copy, task["file"])
    with open(path, "rb") as f:
      original = f.read()
    if not task["tests"]:
      return dict(task, rc=0, output="no test runs this line", seconds=0.0)
    mutated = task["apply"](original)
    package_key = _package_key(copy, task, mutated)
    cached = os.path.join(CACHE, "results", _result_key(copy, task, package_key) + ".json")
    if use_cache and os.path.exists(cached):
      with open(cached) as f:
        return dict(task, **json.load(f), cached=True)
    # A kill is reused while the package is the same and the killing test
    # still runs the same code: tests added or changed elsewhere cannot
    # un-kill it. A survivor is always run again when its tests change.
    kill_record = os.path.join(CACHE, "kills", package_key + ".json")
    if use_cache and os.path.exists(kill_record):
      with open(kill_record) as f:
        kill = json.load(f)
      if kill["killer_hash"] == killer_source_hash(copy, kill["killer"]):
        return dict(task, rc=kill["rc"], output=kill["output"], seconds=0.0, cached=True)
    with open(path, "wb") as f:
      f.write(mutated)
    try:
      rc, output, dt = run_tests(copy, task["tests"], timeout)
      more = task.get("more_tests", ())
      if rc == 0 and more:
        # Survived its chosen tests: run every other test that ran its line (up
        # to --escalate-tests), so that a survivor survives all of them.
        rc, output, dt2 = run_tests(copy, more, timeout)
        dt += dt2
        if rc != 0 and rc not in _BAD_SELECTION:
          output = f"(by a further covering test) {output}"
    finally:
      with open(path, "wb") as f:
        f.write(original)
    if rc not in _BAD_SELECTION:
      os.makedirs(os.path.dirname(cached), exist_ok=True)
      with open(cached, "w") as f:
        json.dump(dict(rc=rc, output=output, seconds=dt), f)
      killer = _killer(output) if rc != 0 else None
      killer_hash = killer_source_hash(copy, killer) if killer else None
      if killer_hash:
        os.makedirs(os.path.dirname(kill_record), exist_ok=True)
        with open(kill_record, "w") as f:
          json.dump(dict(rc=rc, output=output, killer=killer, killer_hash=killer_hash), f)
    return dict(task, rc=rc, output=output, seconds=dt)
  finally:
    copies.put(copy)


def affinity(module_file: str) -> tuple[str, ...]:
  """The test files about a module: those its hand-written mutants name, then ``test_<name>.py``."""
  files = []
  for m in MUTANTS:
    if m.file == module_file:
      files += [t.split("::")[0] for t in m.tests if t.startswith("tests/")]
  stem = os.path.splitext(os.path.basename(module_file))[0].lstrip("_")
  files.append(f"tests/test_{stem}.py")
  if "/_autocast/_rules/" in module_file:  # a room's tests mirror it (tests/autocast/)
    files.append(f"tests/autocast/test_rules_{stem}.py")
  return tuple(dict.fromkeys(files))


def _coverage_tests(root: str) -> list[str]:
  """Every test file of ``tests/`` and its subfolders (``tests/autocast/``), less the excluded."""
  found = []
  for folder, subfolders, names in os.walk(os.path.join(root, "tests")):
    subfolders.sort()
    found += [
      os.path.relpath(os.path.join(folder, n), root).replace(os.sep, "/")
      for n in names
      if n.startswith("test_") and n.endswith(".py") and n not in COVERAGE_EXCLUDE
    ]
  return sorted(found)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--list", action="store_true", help="list the mutants, check snippets")
  parser.add_argument("--only", nargs="+", default=None, help="run only these mutants")
  parser.add_argument(
    "--modules", nargs="+", default=None, help="only mutants of these modules (e.g. _state flax)"
  )
  parser.add_argument("--no-hand", action="store_true", help="no hand-written mutants")
  parser.add_argument("--no-generated", action="store_true", help="no generated mutants")
  parser.add_argument(
    "--sample", type=int, default=1, help="run every Nth generated mutant (a stable hash)"
  )
  parser.add_argument("--sample-offset", type=int, default=0, help="which Nth (0..N-1)")
  parser.add_argument("--limit", type=int, default=None, help="at most this many generated")
  parser.add_argument("--max-tests", type=int, default=24, help="tests per generated mutant")
  parser.add_argument(
    "--test-budget",
    type=float,
    default=15.0,
    help="seconds of (measured) test time per generated mutant",
  )
  parser.add_argument(
    "--escalate-tests",
    type=int,
    default=200,
    help="tests run for a generated mutant that survives its first ones (0: none)",
  )
  parser.add_argument(
    "--escalate-budget",
    type=float,
    default=120.0,
    help="seconds of (measured) test time for those further tests",
  )
  parser.add_argument(
    "--no-result-cache",
    action="store_true",
    help="run every mutant even if the cache holds its result for the same sources",
  )
  parser.add_argument("--jobs", type=int, default=2, help="mutants run at once")
  parser.add_argument(
    "--no-zygote",
    action="store_true",
    help="a fresh Python per pytest run, not a fork of a warm one (tools/mutation/zygote.py)",
  )
  parser.add_argument("--timeout", type=float, default=300.0, help="seconds per mutant at most")
  parser.add_argument(
    "--report",
    default=None,
    help=f"report path (default {REPORT} for a full run; a sized run, with --modules, "
    "--sample, --limit, --no-hand or --no-generated, writes .mutate-cache/mutation-report-sized.md)",
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

  t_start = time.perf_counter()
  jobs = max(1, args.jobs)
  os.makedirs(CACHE, exist_ok=True)
  if not os.path.exists(os.path.join(CACHE, ".gitignore")):
    with open(os.path.join(CACHE, ".gitignore"), "w") as f:
      f.write("*\n")  # the cache ignores itself
  with tempfile.TemporaryDirectory(prefix="jls-mutate-") as tmp:
    copies = [os.path.join(tmp, f"copy{i}") for i in range(jobs)]
    for c in copies:
      os.makedirs(c)
      copy_repo(c, head=args.head)
    tree = tree_of(args.head)  # what the copies hold, before anything can change
    copy = copies[0]
    errors = check_snippets(copy, list(MUTANTS))
    if errors:
      print(
        "mutate: mutants out of date with the code (fix tools/mutation/mutants.py):",
        file=sys.stderr,
      )
      for e in errors:
        print("  " + e, file=sys.stderr)
      return 2

    stem = lambda f: os.path.splitext(os.path.basename(f))[0]
    wanted = {m.removesuffix(".py").split("/")[-1] for m in args.modules or ()}
    hand = [] if args.no_hand else list(MUTANTS)
    if wanted:
      hand = [m for m in hand if stem(m.file) in wanted]
    all_generated = [] if args.no_generated else mutagen.generate(copy, args.modules)
    generated = mutagen.sample(all_generated, args.sample, args.sample_offset)
    if args.limit is not None:
      generated = generated[: args.limit]
    if args.only:
      known = {m.name for m in MUTANTS} | {m.name for m in mutagen.generate(copy)}
      unknown = set(args.only) - known
      if unknown:
        sys.exit(f"mutate: unknown mutants {sorted(unknown)}")
      hand = [m for m in MUTANTS if m.name in args.only]
      generated = [m for m in mutagen.generate(copy) if m.name in args.only]
    if not args.only:
      names = {m.name for m in mutagen.generate(copy)}
      for table_name, table in (("EQUIVALENT", EQUIVALENT), ("PINNED", PINNED)):
        stale = sorted(set(table) - names)
        if stale:
          print(f"mutate: {table_name} names no generated mutant (stale): {stale}", file=sys.stderr)
    if args.tests:
      hand = [dataclasses.replace(m, tests=tuple(args.tests)) for m in hand]
    selection = [
      f"{len(hand)} of {len(MUTANTS)} hand-written mutants",
      f"{len(generated)} of {len(all_generated)} generated mutants"
      + (f" (modules {sorted(wanted)})" if wanted else " (every module)")
      + (
        f", every {args.sample}th by hash (offset {args.sample_offset})" if args.sample > 1 else ""
      )
      + (f", the first {args.limit}" if args.limit is not None else ""),
      f"at most {args.max_tests} covering tests (about {args.test_budget:.0f} s of them) per "
      f"generated mutant, then, if it survives, up to {args.escalate_tests} (about "
      f"{args.escalate_budget:.0f} s), {jobs} at once",
    ]
    if args.list:
      for m in hand:
        print(f"{m.name:48s} {m.file:34s} {' '.join(m.tests)}")
      for m in generated:
        print(f"{m.name:48s} {m.why}")
      print("; ".join(selection) + "; all snippets match exactly once")
      return 0
    check_imports_from_copy(copy)
    if not args.no_zygote:
      for c in copies:
        _ZYGOTES[c] = Zygote(c)
    if hand and not args.no_baseline:
      tests = tuple(sorted({t for m in hand for t in m.tests}))
      rc, output, baseline_s = run_tests(copy, tests, args.timeout * 4)
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
    tasks = [_hand_task(m) for m in hand]
    killers = load_killers()
    cov = None
    if generated and args.tests:  # the tests are given: no coverage map needed
      tasks += [_generated_task(m, tuple(args.tests)) for m in generated]
    elif generated:
      t0 = time.perf_counter()
      cov = mutagen.build_coverage_map(
        copy, pytest_env(copy), _coverage_tests(copy), CACHE, timeout=3600
      )
      print(
        f"coverage map: {len(cov['durations'])} tests "
        f"({cov.get('summary', '')}), {time.perf_counter() - t0:.0f} s "
        f"(cached: {os.path.relpath(CACHE, ROOT)})",
        flush=True,
      )
      if cov["failed"]:
        print(f"mutate: tests failing unmutated, not used: {cov['failed']}", file=sys.stderr)
      for m in generated:
        near = affinity(m.file)
        tests = mutagen.tests_for(m, cov, args.max_tests, args.test_budget, near)
        # Pinned ones first, then the last killer (while the suite still has it).
        hint = tuple(
          t for t in (killers.get(m.name),) if t in cov["durations"] and t not in cov["failed"]
        )
        tests = tuple(dict.fromkeys(PINNED.get(m.name, ()) + hint + tests))
        more = ()
        if args.escalate_tests > 0 and m.name not in EQUIVALENT:
          # An explained mutant runs its chosen tests only: the escalation exists
          # to find a kill, and for an equivalent mutant none is expected.
          more = mutagen.tests_for(m, cov, args.escalate_tests, args.escalate_budget, near)
        tasks.append(_generated_task(m, tests, more))
    selection.append(
      f"{sum(bool(t['tests']) for t in tasks if t['kind'] == 'generated')} generated mutants "
      "covered by a test"
    )

    def timeout_of(task):
      if task["kind"] == "hand" or cov is None:
        return args.timeout
      spent = sum(cov["durations"].get(t, 10.0) for t in task["tests"] + task["more_tests"])
      return min(args.timeout, 60.0 + 5.0 * spent)

    pool_copies: queue.Queue = queue.Queue()
    for c in copies:
      pool_copies.put(c)
    results = []
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
      use_cache = not args.no_result_cache
      futures = [pool.submit(_run_task, t, pool_copies, timeout_of(t), use_cache) for t in tasks]
      for i, fut in enumerate(futures, 1):
        r = fut.result()
        if r["rc"] in _BAD_SELECTION:
          print(r["output"], file=sys.stderr)
          print(
            f"mutate: {r['name']}: pytest exit code {r['rc']}: its test list selects nothing "
            "runnable" + ("; fix tools/mutation/mutants.py" if r["kind"] == "hand" else ""),
            file=sys.stderr,
          )
          if r["kind"] == "hand":
            pool.shutdown(cancel_futures=True)
            return 2
        killed = r["rc"] != 0 and r["rc"] not in _BAD_SELECTION
        r["status"] = "killed" if killed else ("equivalent" if r["equivalent"] else "survived")
        results.append(r)
        if update_killers(killers, r):
          save_killers(killers)
        first = r["output"].splitlines()[0] if r["output"] else ""
        print(
          f"[{i}/{len(tasks)}] {r['name']}: {r['status']} ({r['seconds']:.0f} s"
          f"{', cached' if r.get('cached') else ''}) "
          f"{first if killed else ''}",
          flush=True,
        )
        if r["status"] == "survived" or (r["status"] == "killed" and r["equivalent"]):
          print(f"    {r['why']}; tests: {' '.join(r['tests']) or 'none'}", flush=True)
          print("    " + r["output"].replace("\n", "\n    "), flush=True)
    for z in _ZYGOTES.values():
      z.close()
    _ZYGOTES.clear()
  total = time.perf_counter() - t_start
  line = summary_line(results)
  sized = bool(
    args.modules or args.sample > 1 or args.limit is not None or args.no_hand or args.no_generated
  )
  report = args.report
  if report is None and not (args.only or args.tests):
    # The committed report is a full run's; a sized run writes beside the cache.
    report = os.path.join(CACHE, "mutation-report-sized.md") if sized else REPORT
  if report:
    write_report(report, results, total, selection, tree, sized)
    print(f"wrote {os.path.relpath(report, ROOT)}")
  print(f"{line} ({total / 60:.1f} min)")
  return 1 if unexplained(results) else 0


if __name__ == "__main__":
  sys.exit(main())
