"""The tables of ``docs/guides/autocast.md``, rendered from the code when the site is built.

``docs/hooks.py`` replaces each placeholder of :data:`PLACEHOLDERS` on a page by its renderer's
markdown. The renderers read only the stable entry points: ``jax_lossscale.autocast_policy()``;
``KIND_DESCRIPTIONS``, ``table_names()``, ``versioned_names()``, ``UNHANDLED`` and the kind
constants of ``jax_lossscale._autocast._primitives``; ``_registrations.registrations()``. What the
code does not hold (each kind's examples and behaviour) is prose kept here, keyed by the code's
names: a kind without its prose, prose for one the code no longer has, or an example primitive of
another kind fails the build. Each registration declares its torch op itself.
"""

from __future__ import annotations

import re


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


# -- the primitive kinds -----------------------------------------------------------------

#: kind -> (examples, what autocast does). An example is a primitive's name in backquotes or
#: text; every backquoted name the installed JAX defines must have that kind, and an example
#: that is one primitive only some releases define is left out where this JAX lacks it.
KIND_PROSE = {
  "first_order": (
    (
      "`dot_general`",
      "`conv_general_dilated`",
      "`exp`",
      "`add`",
      "`tanh`",
      "`reduce_sum`",
      "`argmax`",
      "`cholesky`",
    ),
    "takes its rule from the policy: `lower` (cast to the autocast dtype), `float32`, or"
    " `promote` (the default: torch's rule for an op in no list, with the bias and the"
    " constants above)",
  ),
  "layout": (
    (
      "`reshape`",
      "`broadcast_in_dim`",
      "`transpose`",
      "`gather`",
      "`slice`",
      "`pad`",
      "`concatenate`",
      "`select_n`",
      "`convert_element_type`",
    ),
    "moves data: runs in its operand's dtype and carries that operand's facts; float"
    " operands that disagree (`select_n`, `concatenate`) are promoted, constants following"
    " the others",
  ),
  "scatter": (
    (
      "`scatter`",
      "`scatter-add`",
      "`scatter-mul`",
      "`scatter-max` (`x.at[i].add(u)`, `jax.ops.segment_sum` and its max, min and prod forms)",
    ),
    "the operand and the updates are promoted together, and the combiner is traced again"
    " for the dtype they get: scatters and segment ops of a float16 message stay float16",
  ),
  "independent": (
    ("`psum`", "`all_gather`", "`ppermute`", "`sort`", "`optimization_barrier`", "`device_put`"),
    "each operand is its own array: bound on the operands as they are, never promoted together",
  ),
  "as_written": (
    (
      "`pallas_call`",
      "`ffi_call`",
      "custom calls",
      "`pure_callback`/`io_callback`",
      "cuDNN's `dot_product_attention_fwd`",
      "`custom_linear_solve`",
      "`reduce`/`reduce_window` with a traced computation",
      "`reduce_precision`",
      "`bitcast_convert_type`",
    ),
    "opaque or dtype-bound: its operands go back to the dtypes the function was traced"
    " with and it runs exactly as written (no error)",
  ),
  "higher_order": (
    (
      "`jit`",
      "`remat2`",
      "`scan`",
      "`while`",
      "`cond`",
      "`shard_map`",
      "`custom_jvp_call`",
      "`custom_vjp_call`",
      "`closed_call`",
      "`eval_jaxpr`",
    ),
    "its sub-jaxprs are interpreted and it is rebound as itself with every parameter"
    " ([below](#higher-order-primitives)); one without a handler raises"
    " `UnsupportedPrimitiveError`",
  ),
  "kernel": (
    ("the primitives of Pallas (`jax._src.pallas.*`) and Mosaic",),
    "exist only inside a kernel body, which `autocast` never enters: the `pallas_call`"
    " around it runs as written (they are known by their module, so the table names none)",
  ),
}

_NAME = re.compile(r"`([a-z_0-9-]+)`")


def _same_keys(what: str, code, prose) -> None:
  missing, stale = sorted(set(code) - set(prose)), sorted(set(prose) - set(code))
  if missing or stale:
    raise ValueError(f"{__file__}: {what} without prose: {missing}; prose for no {what}: {stale}")


def _kind_of(name: str) -> str | None:
  """The kind of ``name`` in the installed JAX's table, else in the first release defining it."""
  from jax_lossscale._autocast import _primitives as prims

  versioned = prims.versioned_names()
  if name in versioned:
    return prims.table_names(versioned[name][0]).get(name)
  return prims.table_names().get(name)


def _examples(kind: str, examples: tuple[str, ...], names: dict[str, str]) -> str:
  kept = []
  for example in examples:
    for name in _NAME.findall(example):
      if _kind_of(name) not in (None, kind):
        raise ValueError(f"{__file__}: `{name}` is an example of {kind}, but is {_kind_of(name)}")
    single = re.fullmatch(_NAME, example)
    if single is None or single.group(1) in names or _kind_of(single.group(1)) is None:
      kept.append(example)
  return ", ".join(kept)


def _release(release) -> str:
  return ".".join(str(v) for v in release)


def _range(first, until) -> str:
  if until is None:
    return f"jax ≥ {_release(first)}"
  return f"{_release(first)} ≤ jax < {_release(until)}"


def kinds_table() -> str:
  """One row per kind of ``KIND_DESCRIPTIONS`` (the installed JAX's count of its primitives),
  then the primitives only some JAX releases define, grouped by release range and kind."""
  import jax

  from jax_lossscale._autocast import _primitives as prims

  _same_keys("kind", prims.KIND_DESCRIPTIONS, KIND_PROSE)
  names, versioned = prims.table_names(), prims.versioned_names()
  rows = []
  for kind, description in prims.KIND_DESCRIPTIONS.items():
    examples, does = KIND_PROSE[kind]
    unhandled = [
      f"`{n}`" + (f", {_range(*versioned[n])}" if n in versioned else "")
      for n in prims.UNHANDLED
      if _kind_of(n) == kind
    ]
    if unhandled:
      does += " (" + "; ".join(unhandled) + ")"
    count = sum(k == kind for k in names.values())
    rows.append(
      (f"`{kind}`: {description}", str(count or "—"), _examples(kind, examples, names), does)
    )
  header = (
    "kind",
    f"primitives in the table (jax {jax.__version__})",
    "examples",
    "what autocast does",
  )

  groups: dict[tuple, list[str]] = {}
  for name, (first, until) in versioned.items():
    groups.setdefault((first, until, _kind_of(name)), []).append(f"`{name}`")
  in_order = sorted(groups.items(), key=lambda g: (g[0][0], g[0][1] or (999,), g[0][2]))
  by_release = [(_range(f, u), f"`{k}`", ", ".join(sorted(ns))) for (f, u, k), ns in in_order]
  return (
    _table(header, rows)
    + "\nThe primitives only some of the JAX releases the table covers define (every other"
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
  "<!-- kinds-table -->": kinds_table,
  "<!-- registrations-table -->": registrations_table,
}


def render(markdown: str) -> str:
  """``markdown`` with each placeholder of :data:`PLACEHOLDERS` replaced by its table."""
  for placeholder, renderer in PLACEHOLDERS.items():
    if placeholder in markdown:
      markdown = markdown.replace(placeholder, renderer().rstrip("\n"))
  return markdown
