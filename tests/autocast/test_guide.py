"""docs/guides/autocast.md against the code.

* the policy, rules and registrations tables are rendered from the code when the site is built
  (``docs/autocast_tables.py``, called by ``docs/hooks.py``): the guide holds a placeholder per
  table, and each renderer gives a row per policy row, per rule, per registration;
* the deviations table names exactly the zoo's ``DEVIATIONS`` and the deviations tested
  here (:data:`GUIDE_DEVIATIONS`), each checked against torch's dtype.

The guide's Python blocks run in ``tests/test_docs.py`` and ``tests/autocast/test_api_autocast.py``.
"""

import importlib.util
from pathlib import Path
import re

from helpers import DEVIATIONS
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_lossscale as jls
from jax_lossscale._autocast import _registrations
from jax_lossscale._autocast._rules import _registry as registry

F16, F32 = np.dtype(jnp.float16), np.dtype(jnp.float32)
ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs/guides/autocast.md"


def _rows(markdown):
  """The body rows of the first markdown table in ``markdown``, as cells."""
  text = "\n" + markdown
  lines = text[text.index("\n|") + 1 :].split("\n\n")[0].strip().splitlines()
  assert lines[1].startswith("|---"), lines[:2]
  split = re.compile(r"(?<!\\)\|")  # a cell's `\|` is text
  return [[cell.strip() for cell in split.split(line.strip().strip("|"))] for line in lines[2:]]


def _table(marker):
  """The body rows of the guide's table between ``<!-- marker:start -->`` and ``:end``."""
  text = GUIDE.read_text()
  start, end = f"<!-- {marker}:start -->\n", f"<!-- {marker}:end -->"
  assert text.count(start) == 1 and text.count(end) == 1, marker
  return _rows(text.split(start)[1].split(end)[0])


def _code(cell):
  match = re.fullmatch(r"`([^`]+)`", cell)
  assert match, cell
  return match.group(1)


# -- the tables rendered from the code ------------------------------------------------------


def _hooks():
  spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


TABLES = _hooks().autocast_tables(ROOT)


def test_the_guide_has_each_placeholder_once_and_no_hand_copy():
  text = GUIDE.read_text()
  assert len(TABLES.PLACEHOLDERS) == 3
  for placeholder in TABLES.PLACEHOLDERS:
    assert text.count(f"\n{placeholder}\n") == 1, placeholder
    name = placeholder.removeprefix("<!-- ").removesuffix(" -->")
    assert f"<!-- {name}:start -->" not in text, name


def test_the_policy_table_has_a_row_per_policy_row():
  rows = _rows(TABLES.policy_table())
  policy = jls.autocast_policy()
  assert len(policy) > 10
  assert rows == [[f"`{r.primitive}`", r.rule, r.torch, r.note] for r in policy]


def test_the_rules_table_has_a_row_per_rule_in_its_own_words():
  rendered = TABLES.rules_table()
  rows = _rows(rendered)
  rules = registry.rules()
  functions = list(dict.fromkeys(rule.fn for rule in rules.values()))
  assert len(rows) == len(functions) > 15
  kinds = list(registry.KINDS)
  assert [kinds.index(_code(row[0])) for row in rows] == sorted(
    kinds.index(_code(r[0])) for r in rows
  )
  by_doc = {" ".join(fn.__doc__.split("\n\n")[0].split()): fn for fn in functions}
  names = registry.table_names()
  for row in rows:
    fn = by_doc[row[3]]  # the rule's docstring, word for word
    declared = [n for n, r in rules.items() if r.fn is fn]
    here = [n for n in declared if n in names]
    assert row[2] == str(len(here)), row
    assert row[4] == f"`{fn.__module__.rsplit('.', 1)[-1].lstrip('_')}`", row
    assert all(
      rules[_code(n.split(" (")[0])].fn is fn for n in row[1].split(" and ")[0].split(", ")
    )
  assert sum(int(row[2]) for row in rows) == len(names)


def test_a_rule_whose_primitives_this_jax_lacks_shows_them_with_their_releases():
  (row,) = [r for r in _rows(TABLES.rules_table()) if "xla_pmap" in r[1]]
  defined = "xla_pmap" in registry.table_names()
  assert row[1] == ("`xla_pmap`" if defined else "`xla_pmap` (0.9.0 ≤ jax < 0.10.0)"), row
  assert row[2] == str(int(defined)) and "UnsupportedPrimitiveError" in row[3]


def test_the_regions_table_names_each_jit_region_of_autocasts_own():
  from jax_lossscale._autocast._rules import _calls

  rendered = TABLES.rules_table()
  regions = _rows(rendered[rendered.index("| region |") :])
  marks = [m for row in regions for m in re.findall(r"`([a-z_0-9]+)…`", row[0])]
  assert sorted(marks) == sorted(_calls._REGIONS) and len(marks) == 3
  assert len(regions) == 2  # autocast's two marks share their rule


def test_the_versioned_primitives_are_each_listed_once():
  rendered = TABLES.rules_table()
  versioned = registry.versioned_names()
  second = rendered[rendered.index("| defined by |") :]
  listed = re.findall(r"`([a-z_0-9-]+)`", "\n".join(row[2] for row in _rows(second)))
  assert sorted(listed) == sorted(versioned)


def test_the_registrations_table_has_a_row_per_registration():
  rows = _rows(TABLES.registrations_table())
  registered = _registrations.registrations()
  assert len(registered) > 10
  assert [(_code(m), _code(a), rule) for m, a, rule, _ in rows] == [r[:3] for r in registered]
  assert all(torch for *_, torch in rows)


def test_the_hook_renders_the_guides_tables():
  config = {"config_file_path": str(ROOT / "mkdocs.yml")}
  page = _hooks().on_page_markdown(GUIDE.read_text(), page=None, config=config, files=None)
  for placeholder in TABLES.PLACEHOLDERS:
    assert placeholder not in page, placeholder
  for table in (TABLES.policy_table(), TABLES.rules_table(), TABLES.registrations_table()):
    assert table.strip() in page


# -- the deviations stated only in the guide: each checked here against torch's dtype ------


def _rand(seed, shape):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


X, W, C = _rand(0, (4, 8)), _rand(1, (8, 8)), _rand(2, (4, 8))


def _addmm_residual():
  return jls.autocast(lambda c, a, b: c + a @ b)(C, X, W)


def _dot_vdot_tensordot():
  outs = jls.autocast(
    lambda a, b: (jnp.dot(a[0], b[0]), jnp.vdot(a[0], b[0]), jnp.tensordot(a, b, axes=1))
  )(X, W)
  assert len({o.dtype for o in outs}) == 1
  return outs[0]


def _own_dtype_cast():
  out = jls.autocast(lambda x, w: jnp.tanh((x @ w).astype(jnp.float32)))(X, W)
  # The guide's remedy: a float32 region.
  assert jls.autocast(lambda x, w: jls.float32(jnp.tanh)(x @ w))(X, W).dtype == F32
  return out


def _float_constant():
  out = jls.autocast(lambda x, w: x @ w + jnp.ones((8,)))(X, W)
  # A float32 table passed in as an argument is a parameter, not a constant: it promotes.
  assert jls.autocast(lambda x, w, t: x @ w + t)(X, W, C).dtype == F32
  return out


#: case -> (torch CUDA autocast's dtype, autocast's dtype, the case run under autocast).
GUIDE_DEVIATIONS = {
  # torch.addmm(c, a, b): lower_precision_fp, float16.
  "addmm_residual": (F16, F32, _addmm_residual),
  # torch.dot, vdot, tensordot: promote; float32 inputs give float32.
  "dot_vdot_tensordot": (F32, F16, _dot_vdot_tensordot),
  # torch.tanh((x @ w).float()): in no list, float32 input gives float32.
  "own_dtype_cast": (F32, F16, _own_dtype_cast),
  # h + torch.ones(h.shape): a dimensioned float32 tensor promotes the float16 h.
  "float_constant": (F32, F16, _float_constant),
}


@pytest.mark.parametrize("name", sorted(GUIDE_DEVIATIONS))
def test_each_deviation_stated_in_the_guide_holds(name):
  torch_dtype, autocast_dtype, run = GUIDE_DEVIATIONS[name]
  assert torch_dtype != autocast_dtype
  assert np.dtype(run().dtype) == autocast_dtype


def test_the_deviations_table_names_exactly_the_tested_deviations():
  keys = []
  for row in _table("deviations-table"):
    match = re.match(r"`([a-z0-9_]+)`:", row[0])
    assert match, row[0]
    keys.append(match.group(1))
  assert len(keys) == len(set(keys))
  assert set(DEVIATIONS).isdisjoint(GUIDE_DEVIATIONS)
  assert sorted(keys) == sorted([*DEVIATIONS, *GUIDE_DEVIATIONS])


def test_the_guide_keeps_no_process_notes():
  text = GUIDE.read_text()
  for phrase in ("no GPU was lent", "shared CPU", "shared with other jobs"):
    assert phrase not in text, phrase


def test_each_registration_declares_the_torch_op_its_table_row_shows(monkeypatch):
  # The registrations table renders each row's own torch op: a new registration brings its
  # row with it, in one place.
  rows = _registrations.registrations()
  assert rows and all(torch.strip() for *_, torch in rows)
  table = TABLES.registrations_table()
  for module, attribute, rule, torch in rows:
    assert f"| `{module}` | `{attribute}` | {rule} | {torch} |" in table
  extra = _registrations.Registration("jax.nn", "softmax", lambda f: f, "`softmax`")
  extra.make.rule = "float32"  # type: ignore[attr-defined]
  monkeypatch.setattr(_registrations, "_REGISTRATIONS", (*_registrations._REGISTRATIONS, extra))
  assert "| `jax.nn` | `softmax` | float32 | `softmax` |" in TABLES.registrations_table()
