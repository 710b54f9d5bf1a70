"""docs/guides/autocast.md against the code.

* the policy, kinds and registrations tables are rendered from the code when the site is built
  (``docs/autocast_tables.py``, called by ``docs/hooks.py``): the guide holds a placeholder per
  table, and each renderer gives a row per policy row, per kind, per registration;
* the deviations table names exactly the zoo's ``DEVIATIONS`` and the deviations tested
  here (:data:`GUIDE_DEVIATIONS`), each checked against torch's dtype.

The guide's Python blocks run in ``tests/test_docs.py`` and ``tests/test_autocast.py``.
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
from jax_lossscale._autocast import _primitives
from jax_lossscale._autocast import _registrations

F16, F32 = np.dtype(jnp.float16), np.dtype(jnp.float32)
ROOT = Path(__file__).resolve().parent.parent
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


def test_the_kinds_table_has_a_row_per_kind():
  rendered = TABLES.kinds_table()
  rows = _rows(rendered)
  names = _primitives.table_names()
  assert [_code(row[0].split(":")[0]) for row in rows] == list(_primitives.KIND_DESCRIPTIONS)
  for row, (kind, description) in zip(rows, _primitives.KIND_DESCRIPTIONS.items()):
    assert row[0] == f"`{kind}`: {description}"
    count = sum(k == kind for k in names.values())
    assert row[1] == (str(count) if count else "—"), kind
    assert row[2] and row[3], kind
  assert sum(int(row[1]) for row in rows if row[1] != "—") == len(names)
  higher_order = rows[list(_primitives.KIND_DESCRIPTIONS).index(_primitives.HIGHER_ORDER)]
  for name in _primitives.UNHANDLED:
    assert f"`{name}`" in higher_order[3], name


def test_the_kinds_tables_examples_have_that_kind():
  names = _primitives.table_names()
  shown = 0
  for row in _rows(TABLES.kinds_table()):
    kind = _code(row[0].split(":")[0])
    for example in re.findall(r"`([a-z_0-9-]+)`", row[2]):
      if example in _primitives.versioned_names() or example in names:
        assert names.get(example) == kind, (example, kind)  # defined by this JAX, of that kind
        shown += 1
  assert shown > 30


def test_the_versioned_primitives_are_each_listed_once():
  rendered = TABLES.kinds_table()
  versioned = _primitives.versioned_names()
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
  for table in (TABLES.policy_table(), TABLES.kinds_table(), TABLES.registrations_table()):
    assert table.strip() in page


def test_prose_out_of_step_with_the_code_fails_the_build(monkeypatch):
  # A kind without prose (a new kind) and an example of another kind each raise, which fails
  # `mkdocs build`.
  kinds = dict(TABLES.KIND_PROSE)
  del kinds["scatter"]
  monkeypatch.setattr(TABLES, "KIND_PROSE", kinds)
  with pytest.raises(ValueError, match=r"kind without prose: \['scatter'\]"):
    TABLES.kinds_table()
  monkeypatch.undo()

  examples, does = TABLES.KIND_PROSE["layout"]
  monkeypatch.setitem(TABLES.KIND_PROSE, "layout", ((*examples, "`exp`"), does))
  with pytest.raises(ValueError, match="`exp` is an example of layout, but is first_order"):
    TABLES.kinds_table()


def test_an_example_this_jax_does_not_define_is_left_out():
  names = _primitives.table_names()
  examples = ("`jit`", "`xla_pmap`", "custom calls")
  shown = TABLES._examples(_primitives.HIGHER_ORDER, examples, names)
  assert shown.startswith("`jit`, ") and shown.endswith("custom calls")
  assert ("`xla_pmap`" in shown) == ("xla_pmap" in names)


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
