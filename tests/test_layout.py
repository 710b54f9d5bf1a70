"""The package's layout: the import graph runs one way, and the wheel holds no dead module.

Read from the source with ``ast`` (every ``import`` statement, those inside functions
included), so nothing here depends on import order. Importing a submodule also runs its
parent packages' ``__init__``; those implicit edges are left out, as import-linter does.

* The subpackages are layered: ``_typing``; then the scaler and autocast, which know
  nothing of each other; then the integrations and the diagnostics; then the public modules.
  An import may only reach down.
* No module imports itself back through others.
* Autocast's interface to the rest of the package is its subpackage's ``__init__``: no
  module outside ``_autocast`` imports one of its private modules.
* No module is over :data:`MAX_LINES` lines: one that grows past it holds more than one concept.
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


def test_no_module_imports_itself_back():
  assert _cycles(_graph()) == set()


#: The longest a module of the package may be.
MAX_LINES = 600


def test_no_module_is_over_the_line_limit():
  long = {
    str(path.relative_to(ROOT)): n
    for path in sorted(ROOT.rglob("*.py"))
    if (n := len(path.read_text().splitlines())) > MAX_LINES
  }
  assert not long, f"modules over {MAX_LINES} lines (split each by concept): {long}"


def test_autocast_is_reached_through_its_subpackage_only():
  wrong = [
    f"jax_lossscale.{a} imports jax_lossscale.{b}"
    for a, targets in sorted(_graph().items())
    for b in sorted(targets)
    if b.startswith("_autocast.") and not a.startswith("_autocast")
  ]
  assert not wrong, "\n".join(wrong)


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


def _message_ends(node: ast.Raise) -> str | None:
  """The text a raised exception's literal message ends with, or ``None`` (no literal)."""
  call = node.exc
  if not (isinstance(call, ast.Call) and call.args and isinstance(call.func, ast.Name)):
    return None
  if not call.func.id.endswith(("Error", "Exception", "Warning")):
    return None  # a helper building the exception (its own raise is checked there)
  if call.func.id == "AttributeError":
    return None  # a module's or a class's __getattr__ speaks as Python's own does
  message = call.args[0]
  if isinstance(message, ast.Constant) and isinstance(message.value, str):
    return message.value
  if isinstance(message, ast.JoinedStr):
    last = message.values[-1]
    if isinstance(last, ast.Constant):
      return str(last.value)
    if isinstance(last, ast.FormattedValue) and isinstance(last.value, ast.Name):
      return "{" + last.value.id + "}"
    return "{...}"
  return None


def test_every_error_message_is_sentences_ending_with_a_period():
  # One style across the subpackages: a message ends like a sentence, never on a bare value
  # (`got 3` is `got 3.`). A trailing {hint} is itself a sentence (checked where it is made).
  wrong = []
  for path in sorted(ROOT.rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Raise):
        end = _message_ends(node)
        if end is not None and end != "{hint}" and not end.rstrip().endswith((".", "?")):
          wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: ...{end[-40:]!r}")
  assert not wrong, "\n".join(wrong)


def _names_a_primitive(node: ast.AST) -> bool:
  """``<x>.primitive.name`` or ``prim.name`` (the name of a JAX primitive)."""
  return (
    isinstance(node, ast.Attribute)
    and node.attr == "name"
    and (
      (isinstance(node.value, ast.Attribute) and node.value.attr == "primitive")
      or (isinstance(node.value, ast.Name) and node.value.id == "prim")
    )
  )


def _dispatches_on_a_primitives_name(tree: ast.AST) -> list[int]:
  """The lines that decide on a primitive's name: a comparison (``==``, ``in``) or a lookup
  (``table[...]``, ``table.get(...)``) of it. Naming it in a message is not deciding."""
  lines = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Compare):
      operands = [node.left, *node.comparators]
      if any(_names_a_primitive(o) for o in operands):
        lines.append(node.lineno)
    elif isinstance(node, ast.Subscript) and _names_a_primitive(node.slice):
      lines.append(node.lineno)
    elif (
      isinstance(node, ast.Call)
      and isinstance(node.func, ast.Attribute)
      and node.func.attr in ("get", "pop", "setdefault")
      and node.args
      and _names_a_primitive(node.args[0])
    ):
      lines.append(node.lineno)
  return lines


def test_autocast_decides_on_a_primitives_name_only_in_its_rules():
  # What autocast does with a primitive is its rule's (jax_lossscale/_autocast/_rules/): the
  # interpreter and the other modules look the rule up, they do not test the name.
  autocast = ROOT / "_autocast"
  wrong = [
    f"{path.relative_to(ROOT)}:{line}"
    for path in sorted(autocast.rglob("*.py"))
    if "_rules" not in path.relative_to(autocast).parts
    for line in _dispatches_on_a_primitives_name(ast.parse(path.read_text(), str(path)))
  ]
  assert not wrong, "decisions on a primitive's name outside _autocast/_rules/: " + ", ".join(wrong)


@pytest.mark.parametrize(
  ("source", "found"),
  [
    ("if eqn.primitive.name == 'add': pass", [1]),
    ("x = eqn.primitive.name in KEEPS", [1]),
    ("r = table[eqn.primitive.name]", [1]),
    ("r = table.get(prim.name, 0)", [1]),
    ("raise ValueError(f'{eqn.primitive.name} is refused.')", []),
    ("if eqn.primitive is other.primitive: pass", []),
  ],
)
def test_the_name_dispatch_finder_finds_decisions_not_messages(source, found):
  assert _dispatches_on_a_primitives_name(ast.parse(source)) == found
