"""The tables of ``docs/guides/autocast.md``, rendered from the code when the site is built.

``docs/hooks.py`` replaces each placeholder of :data:`PLACEHOLDERS` on a page by its renderer's
markdown. The renderers read only the stable entry points: ``jax_lossscale.autocast_policy()``;
the rules of ``jax_lossscale._autocast._rules._registry`` (each rule's docstring says what
autocast does) and the ``jit`` regions of ``_rules._calls``; ``_registrations.registrations()``.
Nothing is described here: each row is the code's own words.
"""

from __future__ import annotations


def _cell(text: str) -> str:
  return " ".join(str(text).split()).replace("|", "\\|")


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
  return "\n".join(lines) + "\n"


# -- the default policy ------------------------------------------------------------------


def policy_table() -> str:
  """One row per ``jls.autocast_policy()`` row: primitive, rule, torch's entry, note."""
  import jax_lossscale as jls

  rows = [(f"`{r.primitive}`", r.rule, r.torch, r.note) for r in jls.autocast_policy()]
  return _table(("lax primitive", "runs in", "torch CUDA autocast entry", "note"), rows)


# -- the rules ------------------------------------------------------------------------


def _doc(fn) -> str:
  """The first paragraph of ``fn``'s docstring: what autocast does."""
  return " ".join((fn.__doc__ or "").strip().split("\n\n")[0].split())


def _release(release) -> str:
  return ".".join(str(v) for v in release)


def _range(first, until) -> str:
  if until is None:
    return f"jax ≥ {_release(first)}"
  return f"{_release(first)} ≤ jax < {_release(until)}"


#: A rule's row lists at most this many of its primitives' names.
SHOWN = 8


def _grouped():
  """Each rule function with the names it is declared for that the installed JAX defines
  (else every name it is declared for), by kind in the registry's order of kinds, then in
  the order of declaration."""
  from jax_lossscale._autocast._rules import _registry as registry

  defined = registry.table_names()
  groups: dict = {}
  for name, rule in registry.rules().items():
    groups.setdefault(rule.fn, (rule, []))[1].append(name)
  kinds = list(registry.KINDS)
  out = []
  for rule, names in sorted(groups.values(), key=lambda g: kinds.index(g[0].kind)):
    here = [n for n in names if n in defined]
    out.append((rule, here, names))
  return out


def rules_table() -> str:
  """One row per rule function of the registry: its kind, its primitives (the installed
  JAX's, counted), what autocast does (its docstring's first paragraph) and its room; then
  the ``jit`` regions of autocast's own; then the primitives only some releases define."""
  import jax

  from jax_lossscale._autocast._rules import _calls
  from jax_lossscale._autocast._rules import _registry as registry

  versioned = registry.versioned_names()
  rows = []
  for rule, names, declared in _grouped():
    shown = ", ".join(f"`{n}`" for n in names[:SHOWN])
    if len(names) > SHOWN:
      shown += f" and {len(names) - SHOWN} more"
    if not names:  # only other releases define its primitives
      shown = ", ".join(f"`{n}` ({_range(*versioned[n])})" for n in declared)
    room = rule.fn.__module__.rsplit(".", 1)[-1].lstrip("_")
    rows.append((f"`{rule.kind}`", shown or "—", str(len(names)), _doc(rule.fn), f"`{room}`"))
  header = ("kind", f"primitives (jax {jax.__version__})", "count", "what autocast does", "room")

  marks: dict = {}
  for mark, fn in _calls._REGIONS.items():
    marks.setdefault(fn, []).append(f"`{mark}…`")
  regions = [(f"a `jit` named {' or '.join(ms)}", _doc(fn)) for fn, ms in marks.items()]

  groups: dict[tuple, list[str]] = {}
  tables = registry.table_names
  for name, (first, until) in registry.versioned_names().items():
    groups.setdefault((first, until, tables(first)[name]), []).append(f"`{name}`")
  in_order = sorted(groups.items(), key=lambda g: (g[0][0], g[0][1] or (999,), g[0][2]))
  by_release = [(_range(f, u), f"`{k}`", ", ".join(sorted(ns))) for (f, u, k), ns in in_order]
  return (
    _table(header, rows)
    + "\nThe `jit` regions of autocast's own, which the `jit` rule hands to their module:\n\n"
    + _table(("region", "what autocast does"), regions)
    + "\nThe primitives only some of the JAX releases the registry covers define (every other"
    " name is defined by all of them):\n\n"
    + _table(("defined by", "kind", "primitives"), by_release)
  )


# -- the shipped composite-op registrations ----------------------------------------------


def registrations_table() -> str:
  """One row per ``_registrations.registrations()`` entry, in its order: module, attribute,
  rule, and the torch op the registration declares."""
  from jax_lossscale._autocast import _registrations

  rows = [(f"`{m}`", f"`{a}`", rule, torch) for m, a, rule, torch in _registrations.registrations()]
  return _table(("module", "attribute", "rule", "torch"), rows)


#: placeholder -> renderer: the placeholder, alone on its line, becomes the rendered table.
PLACEHOLDERS = {
  "<!-- policy-table -->": policy_table,
  "<!-- rules-table -->": rules_table,
  "<!-- registrations-table -->": registrations_table,
}


def render(markdown: str) -> str:
  """``markdown`` with each placeholder of :data:`PLACEHOLDERS` replaced by its table."""
  for placeholder, renderer in PLACEHOLDERS.items():
    if placeholder in markdown:
      markdown = markdown.replace(placeholder, renderer().rstrip("\n"))
  return markdown
