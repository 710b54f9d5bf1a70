"""docs/guides/autocast.md against the code: its tables are the code's tables.

* the registrations table is ``_composite.registrations()``, row for row;
* the kinds table lists every kind of ``_primitives.KIND_DESCRIPTIONS``, once;
* the deviations table names exactly the zoo's ``DEVIATIONS`` and the deviations tested
  here (:data:`GUIDE_DEVIATIONS`), each checked against torch's dtype.

The policy table is checked row for row by ``tests/test_autocast.py``
(``test_the_guide_shows_the_policy_table_row_for_row``); the guide's Python blocks run in
``tests/test_docs.py`` and ``tests/test_autocast.py``.
"""

from pathlib import Path
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_autocast_zoo import DEVIATIONS

import jax_lossscale as jls
from jax_lossscale._autocast import _composite
from jax_lossscale._autocast import _primitives

F16, F32 = np.dtype(jnp.float16), np.dtype(jnp.float32)
GUIDE = Path(__file__).resolve().parent.parent / "docs/guides/autocast.md"


def _table(marker):
  """The body rows of the table between ``<!-- marker:start -->`` and ``:end``, as cells."""
  text = GUIDE.read_text()
  start, end = f"<!-- {marker}:start -->\n", f"<!-- {marker}:end -->"
  assert text.count(start) == 1 and text.count(end) == 1, marker
  lines = text.split(start)[1].split(end)[0].strip().splitlines()
  assert lines[1].startswith("|---"), marker
  return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines[2:]]


def _code(cell):
  match = re.fullmatch(r"`([^`]+)`", cell)
  assert match, cell
  return match.group(1)


def test_the_registrations_table_is_the_codes_row_for_row():
  rows = [
    (_code(module), _code(attr), rule) for module, attr, rule, *_ in _table("registrations-table")
  ]
  assert tuple(rows) == _composite.registrations()


def test_the_kinds_table_lists_every_kind_once():
  kinds = [_code(row[0]) for row in _table("kinds-table")]
  assert sorted(kinds) == sorted(_primitives.KIND_DESCRIPTIONS)
  assert len(kinds) == len(set(kinds))


def test_the_kinds_tables_examples_have_that_kind():
  names = _primitives.table_names()
  for row in _table("kinds-table"):
    kind = _code(row[0])
    for example in re.findall(r"`([a-z_0-9-]+)`", row[1]):
      if example in names:
        assert names[example] == kind, (example, kind)


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
