"""The package's layout: the import graph runs one way, and the wheel holds no dead module.

Read from the source with ``ast`` (every ``import`` statement, those inside functions
included), so nothing here depends on import order. Importing a submodule also runs its
parent packages' ``__init__``; those implicit edges are left out, as import-linter does.

* The subpackages are layered: ``_typing``; then the scaler and autocast, which know
  nothing of each other; then the integrations and the diagnostics; then the public modules.
  An import may only reach down.
* No module imports itself back through others, except the cycles listed in
  :data:`KNOWN_CYCLES`, which must be exactly those found (one removed, the list shrinks).
* Every module of ``jax_lossscale/`` is reachable from the public modules; the wheel ships
  the package's tree as it is (``[tool.setuptools.packages.find]``), so a module that no
  public module reaches would be dead code in the wheel.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "jax_lossscale"

#: Each layer may import from the layers before it (and from itself), never after.
LAYERS = (
  ("_typing",),
  ("_scaler", "_autocast"),
  ("_integrations", "_diagnostics"),
  ("<public>",),
)

#: Module cycles that exist today, each as the set of its modules (relative names).
KNOWN_CYCLES = {
  frozenset({"_autocast._composite", "_autocast._interpreter"}),
}


def _modules() -> dict[str, pathlib.Path]:
  mods = {}
  for path in ROOT.rglob("*.py"):
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
      parts = parts[:-1]
    mods[".".join(parts)] = path  # "" is the package itself
  return mods


def _relative(module: str) -> str | None:
  if module == "jax_lossscale":
    return ""
  if module.startswith("jax_lossscale."):
    return module[len("jax_lossscale.") :]
  return None


def _graph() -> dict[str, set[str]]:
  mods = _modules()
  edges: dict[str, set[str]] = {}
  for name, path in mods.items():
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        base = _relative(node.module)
        if base is None:
          continue
        for alias in node.names:
          sub = f"{base}.{alias.name}" if base else alias.name
          out.add(sub if sub in mods else base)
      elif isinstance(node, ast.Import):
        for alias in node.names:
          rel = _relative(alias.name)
          if rel is not None:
            out.add(rel)
      elif isinstance(node, ast.ImportFrom) and node.level:
        raise AssertionError(f"{path}: relative import; the package uses absolute ones")
    out.discard(name)
    edges[name] = out
  return edges


def _layer(module: str) -> int:
  top = module.split(".")[0]
  for i, names in enumerate(LAYERS):
    if top in names:
      return i
  if top == "" or not top.startswith("_"):
    return len(LAYERS) - 1
  raise AssertionError(f"jax_lossscale.{module}: in no layer of LAYERS; add its subpackage")


def _cycles(edges: dict[str, set[str]]) -> set[frozenset[str]]:
  """The strongly connected components of more than one module (Tarjan)."""
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  on_stack: set[str] = set()
  found: set[frozenset[str]] = set()

  def visit(v: str) -> None:
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(edges.get(v, ())):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = set()
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.add(w)
        if w == v:
          break
      if len(component) > 1:
        found.add(frozenset(component))

  for v in sorted(edges):
    if v not in index:
      visit(v)
  return found


def test_imports_only_reach_down_the_layers():
  wrong = [
    f"jax_lossscale.{a} imports jax_lossscale.{b}"
    for a, targets in sorted(_graph().items())
    for b in sorted(targets)
    if _layer(b) > _layer(a)
  ]
  assert not wrong, "\n".join(wrong)


def test_the_module_cycles_are_exactly_the_known_ones():
  assert _cycles(_graph()) == KNOWN_CYCLES


def test_every_module_is_reachable_from_a_public_module():
  edges = _graph()
  public = [m for m in edges if not any(p.startswith("_") for p in m.split(".") if p)]
  seen, todo = set(), list(public)
  while todo:
    m = todo.pop()
    if m not in seen:
      seen.add(m)
      todo.extend(edges[m])
      todo.extend(".".join(m.split(".")[:i]) for i in range(1, m.count(".") + 1))  # parents
  assert sorted(set(edges) - seen) == []


@pytest.mark.parametrize(
  "edges, cycles",
  [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, {frozenset("abc")}),
    ({"a": {"b"}, "b": set(), "c": {"b"}}, set()),
  ],
)
def test_the_cycle_finder_finds_cycles(edges, cycles):
  assert _cycles(edges) == cycles


def test_the_graph_has_the_edges_the_code_has():
  edges = _graph()
  assert "_scaler._retry" in edges["_integrations._flax"]  # from module import name
  assert "_autocast" in edges["_diagnostics._underflow"]  # from package import name
  assert "_integrations._flax" in edges["flax"]
  assert "" not in edges[""]  # no self-edge
