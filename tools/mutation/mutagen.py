"""Generated mutants: an AST walk over every module of ``jax_lossscale/``.

The hand-written mutants of ``tools/mutation/mutants.py`` find what their author
thought of. This module finds the kinds of bug a reviewer finds by rote, at
every site where they apply, inside function bodies only (no module-level
code, no docstrings, nothing inside an error message, a warning or a
``print``):

* ``drop-kwarg:NAME``: a keyword argument dropped from a call (``axis_name``,
  ``**kwargs``, ``hysteresis``); ``NAME`` is ``**`` for a ``**kwargs``; not
  ``zip``'s ``strict=``, an assertion like ``assert`` (which is not mutated);
* ``cmp-negate`` / ``cmp-strict`` / ``cmp-nonstrict``: a comparison flipped
  (``<`` to ``>=``, ``==`` to ``!=``, ``is`` to ``is not``, ``in`` to ``not in``)
  or made strict / non-strict (``<=`` to ``<``, ``<`` to ``<=``);
* ``no-bound``, ``no-lower``, ``no-upper``: a bound removed
  (``minimum(x, b)``/``maximum``/``min``/``max`` replaced by ``x``; one side of a
  ``clip`` set to ``None``);
* ``raise-to-pass``: a ``raise`` deleted;
* ``reduce:A->B``: a reduction swapped (``sum``/``max``, ``mean``/``sum``,
  ``min``/``max``, ``any``/``all``, ``psum``/``pmax``, ``pmean``/``psum``);
* ``if-true`` / ``if-false``: a branch forced (the condition of an ``if`` or
  a conditional expression replaced by ``True`` or ``False``): a fallback
  taken, or never taken.

Each mutant is named ``module:function:operator:hash``
(``_state:DynamicScaleConfig.__post_init__:cmp-strict:3f2a``): the qualified
name of the function it sits in, the operator, and four hex digits of a hash
of the snippet and its replacement; a second one of the same name gets
``#2``. No line number: a name stays the same when code above it moves, so
``EQUIVALENT`` and ``PINNED`` in ``tools/mutation/mutants.py`` stay valid until the
mutated snippet itself changes. The same source gives the same mutants in
the same order. A mutant is a byte
range of the file and its replacement; the replacement keeps the line count
(a multi-line node is replaced by parenthesised text padded with newlines),
so coverage line numbers stay valid for every other line.

Which tests run for a mutant comes from coverage: :func:`build_coverage_map`
runs the test suite once under ``coverage`` with one context per test
(:class:`CoveragePlugin`, the equivalent of ``--cov-context=test``) and
records, per line of the package, the node ids of the tests that executed it
(Python lines run when JAX traces are counted too), and each test's duration.
The map is cached by a hash of the package and test sources.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import time

PACKAGE = "jax_lossscale"
TOOL_DIR = os.path.join("tools", "mutation")  # this module, relative to the repository root
# What every test runs besides its own file: the fixtures and hooks, the shared helpers.
TEST_SUPPORT = ("tests/conftest.py", "tests/helpers.py")

_NEGATE = {
  ast.Lt: ast.GtE,
  ast.LtE: ast.Gt,
  ast.Gt: ast.LtE,
  ast.GtE: ast.Lt,
  ast.Eq: ast.NotEq,
  ast.NotEq: ast.Eq,
  ast.Is: ast.IsNot,
  ast.IsNot: ast.Is,
  ast.In: ast.NotIn,
  ast.NotIn: ast.In,
}
_BOUNDARY = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt}
_REDUCE = {
  "sum": "max",
  "max": "sum",
  "mean": "sum",
  "min": "max",
  "prod": "sum",
  "any": "all",
  "all": "any",
  "psum": "pmax",
  "pmax": "psum",
  "pmean": "psum",
  "pmin": "pmax",
}
_REDUCE_OWNERS = {"jnp", "np", "numpy", "lax", "jax.lax", "jax.numpy"}
_BOUNDS = {"minimum", "maximum", "min", "max"}
# Calls whose arguments are messages, not behaviour.
_MESSAGE_CALLS = {"warn", "warn_once", "print", "debug", "info", "warning", "error", "exception"}


@dataclasses.dataclass(frozen=True)
class GenMutant:
  """One generated mutant: bytes ``[start, end)`` of ``file`` become ``new``."""

  name: str
  file: str
  line: int
  operator: str
  start: int
  end: int
  new: str
  old: str

  @property
  def why(self) -> str:
    return f"{self.operator}: `{_short(self.old)}` -> `{_short(self.new)}`"

  def apply(self, source: bytes) -> bytes:
    return source[: self.start] + self.new.encode() + source[self.end :]


def _short(text: str, n: int = 70) -> str:
  text = " ".join(text.split())
  return text if len(text) <= n else text[: n - 3] + "..."


def _dotted(node: ast.AST) -> str:
  if isinstance(node, ast.Name):
    return node.id
  if isinstance(node, ast.Attribute):
    return f"{_dotted(node.value)}.{node.attr}"
  return ""


def _call_name(call: ast.Call) -> tuple[str, str]:
  """(owner, name) of a call's function: ``jnp.sum`` -> ("jnp", "sum"), ``max`` -> ("", "max")."""
  f = call.func
  if isinstance(f, ast.Name):
    return "", f.id
  if isinstance(f, ast.Attribute):
    return _dotted(f.value), f.attr
  return "", ""


class _Sites(ast.NodeVisitor):
  """Collects (node, operator, replacement node or text) inside function bodies."""

  def __init__(self):
    self.sites: list[tuple[ast.AST, str, object, str]] = []  # node, operator, new, qualname
    self._scope: list[str] = []  # the enclosing classes and functions
    self._depth = 0  # inside a function
    self._quiet = 0  # inside a raise, an f-string, a message call, an assert
    self._guard = 0  # inside the condition of an ``if ...: raise``

  def _mute(self, node):
    self._quiet += 1
    self.generic_visit(node)
    self._quiet -= 1

  def _site(self, node, operator, new):
    self.sites.append((node, operator, new, ".".join(self._scope)))

  def visit_ClassDef(self, node):
    self._scope.append(node.name)
    for stmt in node.body:
      self.visit(stmt)
    self._scope.pop()

  def visit_FunctionDef(self, node):
    self._depth += 1
    self._scope.append(node.name)
    for stmt in node.body:  # not the decorators, the defaults or the annotations
      self.visit(stmt)
    self._scope.pop()
    self._depth -= 1

  visit_AsyncFunctionDef = visit_FunctionDef

  def visit_Lambda(self, node):
    self._depth += 1
    self._scope.append("<lambda>")
    self.visit(node.body)
    self._scope.pop()
    self._depth -= 1

  def _active(self):
    return self._depth > 0 and self._quiet == 0

  def visit_Raise(self, node):
    if self._active():
      self._site(node, "raise-to-pass", "pass")
    self._mute(node)

  def visit_Assert(self, node):
    self._mute(node)

  def visit_JoinedStr(self, node):
    self._mute(node)

  def visit_Expr(self, node):
    if isinstance(node.value, ast.Constant):  # a docstring
      return
    self.generic_visit(node)

  def visit_If(self, node):
    if _is_raise_guard(node):
      # ``if bad: raise ...``: forcing it False is ``raise-to-pass``, forcing it
      # True (or negating its comparison) raises on every valid call, which any
      # test running the line kills. Only its boundary mutants are worth a run.
      self._guard += 1
      self.generic_visit(node.test)
      self._guard -= 1
      for stmt in node.body + node.orelse:
        self.visit(stmt)
      return
    if self._active() and not isinstance(node.test, ast.Constant):
      self._site(node.test, "if-true", "True")
      self._site(node.test, "if-false", "False")
    self.generic_visit(node)

  def visit_IfExp(self, node):
    if self._active() and not isinstance(node.test, ast.Constant):
      self._site(node.test, "if-true", "True")
      self._site(node.test, "if-false", "False")
    self.generic_visit(node)

  def visit_Compare(self, node):
    if self._active():
      for i, op in enumerate(node.ops):
        suffix = "" if len(node.ops) == 1 else f"@{i}"
        if len(node.ops) == 1 and type(op) in _NEGATE and not self._guard:
          new = ast.Compare(node.left, [_NEGATE[type(op)]()], node.comparators)
          self._site(node, "cmp-negate", new)
        if type(op) in _BOUNDARY:
          ops = list(node.ops)
          ops[i] = _BOUNDARY[type(op)]()
          kind = "cmp-strict" if type(op) in (ast.LtE, ast.GtE) else "cmp-nonstrict"
          self._site(node, kind + suffix, ast.Compare(node.left, ops, node.comparators))
    self.generic_visit(node)

  def visit_Call(self, node):
    owner, name = _call_name(node)
    if name in _MESSAGE_CALLS:
      self._mute(node)
      return
    if self._active():
      for i, kw in enumerate(node.keywords):
        if name == "zip" and kw.arg == "strict":
          continue  # an assertion that the lengths agree; asserts are not mutated either
        rest = node.keywords[:i] + node.keywords[i + 1 :]
        label = kw.arg if kw.arg is not None else "**"
        self._site(node, f"drop-kwarg:{label}", ast.Call(node.func, node.args, rest))
      n_pos = len(node.args)
      if name in _BOUNDS and n_pos >= 2 and not node.keywords:
        self._site(node, "no-bound", node.args[0])
      if name == "clip" and n_pos >= 3:
        for i, kind in ((1, "no-lower"), (2, "no-upper")):
          args = list(node.args)
          args[i] = ast.Constant(None)
          self._site(node, kind, ast.Call(node.func, args, node.keywords))
      builtin_bound = owner == "" and name in ("max", "min") and n_pos >= 2
      if name in _REDUCE and not builtin_bound and (owner in _REDUCE_OWNERS or owner == ""):
        new_func = (
          ast.Name(_REDUCE[name]) if owner == "" else ast.Attribute(node.func.value, _REDUCE[name])
        )
        self._site(node.func, f"reduce:{name}->{_REDUCE[name]}", new_func)
    self.generic_visit(node)


def _is_raise_guard(node: ast.If) -> bool:
  """``if cond: raise ...`` with no ``else``."""
  return not node.orelse and len(node.body) == 1 and isinstance(node.body[0], ast.Raise)


def _line_offsets(source: bytes) -> list[int]:
  offsets, pos = [0], 0
  for line in source.splitlines(keepends=True):
    pos += len(line)
    offsets.append(pos)
  return offsets


def _replacement(new: object, old_text: str) -> str:
  text = new if isinstance(new, str) else ast.unparse(new)
  extra = old_text.count("\n")
  if extra == 0:
    return text if isinstance(new, str) or not isinstance(new, ast.expr) else f"({text})"
  if isinstance(new, str) and new == "pass":  # a statement: blank lines keep the count
    return "pass" + "\n" * extra
  return "(" + text + "\n" * extra + ")"  # an expression: newlines inside parentheses


def generate_file(root: str, rel: str) -> list[GenMutant]:
  """Every generated mutant of one file (``rel`` relative to ``root``), in source order."""
  with open(os.path.join(root, rel), "rb") as f:
    source = f.read()
  tree = ast.parse(source)
  visitor = _Sites()
  visitor.visit(tree)
  offsets = _line_offsets(source)
  stem = os.path.splitext(os.path.basename(rel))[0]
  out, seen = [], {}
  sites = sorted(
    visitor.sites, key=lambda s: (s[0].lineno, s[0].col_offset, s[1])
  )  # source order, then operator
  for node, operator, new, qualname in sites:
    start = offsets[node.lineno - 1] + node.col_offset
    end = offsets[node.end_lineno - 1] + node.end_col_offset
    old = source[start:end].decode()
    text = _replacement(new, old)
    if text.strip("()\n") == old:
      continue
    digest = hashlib.sha1(f"{' '.join(old.split())}\0{' '.join(text.split())}".encode())
    base = f"{stem}:{qualname}:{operator}:{digest.hexdigest()[:4]}"
    seen[base] = seen.get(base, 0) + 1
    name = base if seen[base] == 1 else f"{base}#{seen[base]}"
    mutant = GenMutant(name, rel, node.lineno, operator, start, end, text, old)
    try:
      compile(mutant.apply(source), rel, "exec")
    except SyntaxError:
      continue
    out.append(mutant)
  return out


def package_modules(root: str) -> list[str]:
  """Every ``.py`` file of the package and its subpackages (enumerated, so a new module is
  included)."""
  out = []
  for dirpath, _, names in os.walk(os.path.join(root, PACKAGE)):
    rel = os.path.relpath(dirpath, root).replace(os.sep, "/")
    out += [f"{rel}/{n}" for n in names if n.endswith(".py") and "__pycache__" not in rel]
  return sorted(out)


def generate(root: str, modules: list[str] | None = None) -> list[GenMutant]:
  """The generated mutants of every package module, or of those whose stem is in ``modules``."""
  files = package_modules(root)
  if modules:
    wanted = {m.removesuffix(".py").split("/")[-1] for m in modules}
    unknown = wanted - {os.path.splitext(os.path.basename(f))[0] for f in files}
    if unknown:
      raise SystemExit(f"mutate: no package modules {sorted(unknown)}")
    files = [f for f in files if os.path.splitext(os.path.basename(f))[0] in wanted]
  return [m for rel in files for m in generate_file(root, rel)]


def sample(mutants: list[GenMutant], every: int, offset: int = 0) -> list[GenMutant]:
  """Every ``every``-th mutant by a stable hash of its name (deterministic, spread over files)."""
  if every <= 1:
    return mutants
  key = lambda m: int(hashlib.sha1(m.name.encode()).hexdigest(), 16)
  return [m for m in mutants if key(m) % every == offset % every]


# --- coverage: which tests run each line -----------------------------------------------------


class CoveragePlugin:
  """A pytest plugin: one coverage context per test (its node id), and its duration.

  Loaded by :func:`build_coverage_map` with ``-p mutagen`` in the pytest run.
  """

  def __init__(self, out_path: str, source: str):
    import coverage

    self.out_path = out_path
    self.cov = coverage.Coverage(
      data_file=out_path + ".coverage", source=[source], config_file=False
    )
    self.durations: dict[str, float] = {}
    self.failed: set[str] = set()
    self.cov.start()

  def pytest_runtest_protocol(self, item, nextitem):
    self.cov.switch_context(item.nodeid)

  def pytest_runtest_logreport(self, report):
    self.durations[report.nodeid] = self.durations.get(report.nodeid, 0.0) + report.duration
    if report.failed:
      self.failed.add(report.nodeid)

  def pytest_sessionfinish(self, session):
    self.cov.stop()
    self.cov.save()
    data = self.cov.get_data()
    lines: dict[str, dict[str, list[str]]] = {}
    for path in data.measured_files():
      rel = os.path.relpath(path, session.config.rootpath)
      by_line = data.contexts_by_lineno(path)
      lines[rel] = {
        str(n): sorted(c for c in ctxs if c and c not in self.failed) for n, ctxs in by_line.items()
      }
    with open(self.out_path, "w") as f:
      json.dump({"lines": lines, "durations": self.durations, "failed": sorted(self.failed)}, f)


def pytest_configure(config):
  out = os.environ.get("JLS_MUTAGEN_COVERAGE")
  if out:
    config.pluginmanager.register(
      CoveragePlugin(out, os.path.join(str(config.rootpath), PACKAGE)), "jls-mutagen-coverage"
    )


def sources_hash(root: str, test_files: list[str]) -> str:
  h = hashlib.sha256()
  for rel in package_modules(root) + sorted(test_files) + list(TEST_SUPPORT):
    h.update(rel.encode())
    with open(os.path.join(root, rel), "rb") as f:
      h.update(f.read())
  return h.hexdigest()[:16]


def _file_hash(root: str, rel: str) -> str:
  with open(os.path.join(root, rel), "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()[:16]


def _support_hash(root: str) -> str:
  """A hash of what every test runs: the package's modules, conftest and the test helpers."""
  return sources_hash(root, [])


def _earlier_map(cache_dir: str, support: str) -> dict | None:
  """The newest cached map of the same package and test support, if any."""
  found = []
  for name in os.listdir(cache_dir):
    if name.startswith("coverage-") and name.endswith(".json"):
      path = os.path.join(cache_dir, name)
      found.append((os.path.getmtime(path), path))
  for _, path in sorted(found, reverse=True):
    with open(path) as f:
      cov = json.load(f)
    if cov.get("support") == support and "files" in cov:
      return cov
  return None


def build_coverage_map(
  copy: str, env: dict[str, str], tests: list[str], cache_dir: str, timeout: float
) -> dict:
  """The line -> tests map of ``tests`` run in ``copy`` (cached in ``cache_dir``).

  A map is kept with the hash of each test file it ran. When the package and the test
  support are those of a cached map and only some test files were added or changed, only
  those files are run, and their tests replace theirs in that map: a test written for a
  survivor costs its own run, not the suite's.
  """
  files = []
  for t in tests:
    path = os.path.join(copy, t)
    if os.path.isdir(path):
      files += [f"{t.rstrip('/')}/{n}" for n in sorted(os.listdir(path)) if n.startswith("test_")]
    else:
      files.append(t.split("::")[0])
  py_files = [f for f in files if f.endswith(".py")]
  key = sources_hash(copy, py_files)
  os.makedirs(cache_dir, exist_ok=True)
  ignore = os.path.join(cache_dir, ".gitignore")
  if not os.path.exists(ignore):
    with open(ignore, "w") as f:
      f.write("*\n")
  cached = os.path.join(cache_dir, f"coverage-{key}.json")
  if os.path.exists(cached):
    with open(cached) as f:
      return json.load(f)
  support = _support_hash(copy)
  hashes = {f: _file_hash(copy, f) for f in py_files}
  earlier = _earlier_map(cache_dir, support)
  run = list(tests)
  if earlier is not None:
    stale = {f for f, h in earlier["files"].items() if hashes.get(f) != h}
    run = sorted(f for f, h in hashes.items() if earlier["files"].get(f) != h)
  out = os.path.join(copy, ".mutagen-coverage.json")
  env = dict(env, JLS_MUTAGEN_COVERAGE=out)
  # ``-p mutagen`` loads this module as a plugin: it lives in tools/mutation/ of the copy.
  plugin_dir = os.path.join(copy, TOOL_DIR)
  env["PYTHONPATH"] = os.pathsep.join([plugin_dir, env.get("PYTHONPATH", "")])
  cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "mutagen"]
  cmd += ["-o", "addopts=", *run]
  t0 = time.perf_counter()
  if run:
    proc = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
    if not os.path.exists(out):
      sys.exit(f"mutate: the coverage run wrote nothing:\n{(proc.stdout + proc.stderr)[-3000:]}")
    with open(out) as f:
      result = json.load(f)
    last = (proc.stdout.strip().splitlines() or [""])[-1]
  else:  # only test files removed
    result, last = {"lines": {}, "durations": {}, "failed": []}, "no test file to run"
  if earlier is not None:  # the earlier map less the stale files' tests, with the new ones
    kept = lambda t: t.split("::")[0] not in stale
    lines = {
      mod: {n: [t for t in ts if kept(t)] for n, ts in by_line.items()}
      for mod, by_line in earlier["lines"].items()
    }
    for mod, by_line in result["lines"].items():
      for n, ts in by_line.items():
        lines.setdefault(mod, {}).setdefault(n, []).extend(ts)
    durations = {t: d for t, d in earlier["durations"].items() if kept(t)}
    durations.update(result["durations"])
    failed = sorted({t for t in earlier.get("failed", []) if kept(t)} | set(result["failed"]))
    result = dict(result, lines=lines, durations=durations, failed=failed)
    result["summary"] = f"{len(run)} test files run again, {len(stale)} replaced: {last}"
  else:
    result["summary"] = last
  result["seconds"] = time.perf_counter() - t0
  result["support"], result["files"] = support, hashes
  with open(cached, "w") as f:
    json.dump(result, f)
  return result


def tests_for(
  mutant: GenMutant,
  cov: dict,
  cap: int,
  budget_s: float,
  affinity: tuple[str, ...] = (),
) -> tuple[str, ...]:
  """The tests that ran the mutant's line(s): at most ``cap``, about ``budget_s`` seconds.

  The fastest test of each test file first, then the second fastest of each,
  and so on, the files of ``affinity`` (those about the mutant's module) before
  the others: the fastest tests overall are often ones that only pass through
  a line (a config built on the way), while the test that checks what the
  line does sits in the file about it.
  """
  by_line = cov["lines"].get(mutant.file, {})
  span = range(mutant.line, mutant.line + mutant.old.count("\n") + 1)
  nodes = {t for n in span for t in by_line.get(str(n), ())}
  durations = cov["durations"]
  by_file: dict[str, list[str]] = {}
  for t in sorted(nodes, key=lambda t: (durations.get(t, 1e9), t)):
    by_file.setdefault(t.split("::")[0], []).append(t)
  rank = {f: i for i, f in enumerate(affinity)}
  order = sorted(by_file, key=lambda f: (rank.get(f, len(rank)), durations.get(by_file[f][0], 1e9)))
  queues = [by_file[f] for f in order]
  chosen, spent = [], 0.0
  while queues and len(chosen) < cap and spent < budget_s:
    for q in list(queues):
      if not q:
        queues.remove(q)
        continue
      t = q.pop(0)
      chosen.append(t)
      spent += durations.get(t, 1.0)
      if len(chosen) >= cap or spent >= budget_s:
        break
  return tuple(chosen)
