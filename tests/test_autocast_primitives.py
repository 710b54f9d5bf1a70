"""The kind table of autocast against the installed JAX: no drift at an upgrade.

Every name in ``jax_lossscale._autocast._primitives`` must be a primitive that the
installed JAX defines, and every primitive JAX defines must have a kind (or live in a
kernel-language module, whose primitives exist only inside a ``pallas_call``).
"""

import importlib
import pkgutil
import sys
import types

import jax
import jax.extend.core as jex
import jax.extend.source_info_util as jsi
import numpy as np
import pytest

from jax_lossscale._autocast import _higher_order
from jax_lossscale._autocast import _interpreter
from jax_lossscale._autocast import _policy
from jax_lossscale._autocast import _primitives as prims
from jax_lossscale._autocast import _values
from jax_lossscale._autocast._errors import UnsupportedPrimitiveError


def _jax_primitives():
  """Every Primitive object defined at module level anywhere in the installed jax."""
  import jax._src as src
  import jax.experimental as experimental

  for package in (src, experimental):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
      try:
        importlib.import_module(info.name)
      except Exception:  # optional backends and bridges (TPU, Mosaic GPU, jax2tf)
        continue
  found: dict[int, tuple[jex.Primitive, str]] = {}
  for name, module in list(sys.modules.items()):
    if not name.startswith("jax"):
      continue
    for value in list(vars(module).values()):
      if isinstance(value, jex.Primitive):
        home = found.get(id(value), (value, name))[1]
        found[id(value)] = (
          value,
          min(home, name, key=len) if name.startswith("jax._src") else home,
        )
  return list(found.values())


PRIMITIVES = _jax_primitives()
ALL_NAMES = {p.name for p, _ in PRIMITIVES}


def test_every_name_in_the_table_is_a_primitive_of_this_jax():
  names = {p.name for p, _ in PRIMITIVES}
  missing = sorted(n for n in prims.table_names() if n not in names)
  assert not missing, (
    f"names in the kind table that jax {jax.__version__} does not define (if a JAX version "
    f"removed them, give them their last version in _kinds.VERSIONED): {missing}"
  )


def test_each_version_specific_name_is_defined_exactly_in_its_releases():
  # The ranges of VERSIONED are facts of each JAX release, checked on each one installed:
  # a name that this JAX defines outside its range (or not inside it) means a wrong range.
  names = {p.name for p, _ in PRIMITIVES}
  release = prims.jax_release()
  assert prims.OLDEST_TESTED <= release, release
  wrong = sorted(
    f"{name} (listed from {first} until {until or 'now'})"
    for name, (first, until) in prims.versioned_names().items()
    if (name in names) != prims.defined_in(name, release)
  )
  assert not wrong, f"version ranges that jax {jax.__version__} contradicts: {wrong}"


def test_the_table_of_another_release_differs_only_in_the_versioned_names():
  # jax 0.11 replaced closed_call by eval_jaxpr; both releases' tables have a call primitive.
  old, new = prims.table_names((0, 10, 2)), prims.table_names((0, 12, 0))
  assert "closed_call" in old and "closed_call" not in new
  assert old["eval_jaxpr"] == new["eval_jaxpr"] == prims.HIGHER_ORDER
  assert new["log2"] == prims.FIRST_ORDER and "log2" not in old
  assert set(old) ^ set(new) <= set(prims.versioned_names())
  assert "pgather" in prims.table_names((0, 9, 0)) and "pgather" not in old


def test_every_primitive_of_this_jax_has_a_kind():
  unknown = sorted(
    f"{p.name} ({home})"
    for p, home in PRIMITIVES
    if prims.kind(p) is None and not home.startswith(prims.KERNEL_MODULES)
  )
  assert not unknown, (
    "primitives without a kind: declare each in the registry as CONTRIBUTING.md says (a"
    " first-order one in _primitives.py, a higher-order one by its handler's decorator in"
    f" _higher_order.py): {unknown}"
  )


def test_every_policy_row_is_a_first_order_primitive():
  for row in prims.POLICY_TABLE:
    assert prims.kind(prims.resolve(row.primitive)) == prims.FIRST_ORDER, row


def test_every_higher_order_kind_has_a_handler():
  for release in prims.CHECKED_RELEASES:
    for name, kind in prims.table_names(release).items():
      if kind == prims.HIGHER_ORDER:
        handled = prims.handler_of(name) is not None
        assert handled != (name in prims.UNHANDLED), (release, name)


def test_every_handler_is_declared_for_a_primitive_of_some_checked_release():
  # The other direction: a handler declared under a name no checked JAX release gives its
  # primitive (as `checkpoint` was: JAX names remat's primitive `remat2`) would be dead.
  for name, handler in prims.handlers().items():
    releases = [r for r in prims.CHECKED_RELEASES if prims.defined_in(name, r)]
    assert releases, (name, handler)
    if prims.defined_in(name, prims.jax_release()):
      assert name in ALL_NAMES, f"{name}: declared for this jax, which has no such primitive"
    else:
      assert name not in ALL_NAMES, f"{name}: this jax has it, outside its declared releases"


def test_a_primitive_is_declared_once():
  listed = [n for names in prims.KINDS.values() for n in names]
  rows = [row.primitive for row in prims.POLICY_TABLE]
  every = [*listed, *rows, *prims.VERSIONED, *prims.handlers()]
  twice = sorted({n for n in every if every.count(n) > 1})
  assert not twice, f"declared twice in the registry: {twice}"
  with pytest.raises(ValueError, match="'scan' is declared twice"):
    prims.higher_order("scan")(lambda interp, eqn, ins: ins)
  with pytest.raises(ValueError, match="'exp' is declared twice"):
    prims.higher_order("exp")(lambda interp, eqn, ins: ins)


def test_the_rank_keeping_flag_is_on_layout_primitives_only():
  for name in prims.KEEPS_RANK:
    assert prims.table_names()[name] == prims.LAYOUT, name


def test_an_unhandled_higher_order_primitive_raises_naming_it():
  prim = prims.by_name(prims.UNHANDLED[0])  # jax 0.9's xla_pmap_p, a stand-in after
  assert prims.kind(prim) == prims.HIGHER_ORDER
  eqn = types.SimpleNamespace(primitive=prim, params={}, source_info=None)
  interp = _interpreter.Interpreter(jax.numpy.float16, _policy.check_policy(None))
  with pytest.raises(UnsupportedPrimitiveError, match=rf"`{prims.UNHANDLED[0]}`"):
    interp.eval_eqn(eqn, [])


def test_an_equation_with_no_user_frame_is_named_without_a_location():
  # An equation built with JAX's empty source info (no frame of the user's to show) names
  # the primitive and no " (at ...)"; one traced from a function of this file names its line.
  prim = prims.by_name(prims.UNHANDLED[0])
  interp = _interpreter.Interpreter(jax.numpy.float16, _policy.check_policy(None))
  eqn = types.SimpleNamespace(primitive=prim, params={}, source_info=jsi.new_source_info())
  with pytest.raises(UnsupportedPrimitiveError) as raised:
    interp.eval_eqn(eqn, [])
  message = str(raised.value)
  assert f"higher-order primitive `{prims.UNHANDLED[0]}`: it does not know" in message, message
  (traced,) = jax.make_jaxpr(lambda x: jax.numpy.sin(x))(1.0).eqns
  eqn = types.SimpleNamespace(primitive=prim, params={}, source_info=traced.source_info)
  with pytest.raises(UnsupportedPrimitiveError, match=r"` \(at .*test_autocast_primitives\.py"):
    interp.eval_eqn(eqn, [])


def test_the_table_is_keyed_by_objects_where_jax_exports_them():
  # dot_general by identity: a kernel primitive named like a lax one is not taken for it.
  assert prims.kind(jax.lax.dot_general_p) == prims.FIRST_ORDER
  assert prims.kind(jax.lax.scatter_mul_p) == prims.SCATTER
  namesake = jex.Primitive("gather")
  assert prims.kind(namesake) is None


@pytest.mark.parametrize(
  ("policy", "match"),
  [
    ({"exxp": "lower"}, r"'exxp' is not the name of a primitive.*did you mean 'exp'"),
    ({"exp": "lowr"}, r"policy\['exp'\] must be one of .*did you mean 'lower'"),
    ({"scan": "lower"}, r"policy\['scan'\]: `scan` is a higher-order primitive"),
    ({"scatter_mul": "lower"}, r"'scatter_mul' is not the name.*did you mean"),
  ],
)
def test_a_wrong_policy_key_or_rule_is_refused_naming_the_nearest(policy, match):
  with pytest.raises(ValueError, match=match):
    _policy.check_policy(policy)


def _eqn(name, params):
  return types.SimpleNamespace(primitive=jex.Primitive(name), params=params, source_info=None)


def test_a_parameter_missing_in_this_jax_raises_naming_the_version_and_the_parameter():
  eqn = _eqn("while", {"body_jaxpr": None})
  with pytest.raises(UnsupportedPrimitiveError) as raised:
    _values.param(eqn, "cond_jaxpr")
  message = str(raised.value)
  assert f"'cond_jaxpr' is missing in jax {jax.__version__}" in message, message
  assert "['body_jaxpr']" in message and "`while`" in message, message
  # a renamed parameter is read under its other spelling
  assert _values.param(_eqn("eval_jaxpr", {"jaxpr": 1}), "call_jaxpr", "jaxpr") == 1


def test_scans_layout_is_read_in_each_spelling():
  # jax 0.9-0.10: num_consts and num_carry; jax >= 0.11: ft_in, a flat tree (consts, carry, xs).
  assert _higher_order._scan_layout(_eqn("scan", {"num_consts": 2, "num_carry": 1})) == (2, 1)
  with pytest.raises(UnsupportedPrimitiveError, match=r"'num_consts' is missing in jax"):
    _higher_order._scan_layout(_eqn("scan", {"length": 3}))
  scan = jax.make_jaxpr(lambda c, xs, w: jax.lax.scan(lambda c, x: (c * w + x, c), c, xs))(
    1.0, jax.numpy.ones(3), 2.0
  )
  (eqn,) = [e for e in scan.jaxpr.eqns if e.primitive.name == "scan"]
  assert _higher_order._scan_layout(eqn) == (1, 1)
  new = _higher_order._scan_with_leading_consts(eqn, dict(eqn.params), 2)
  assert _higher_order._scan_layout(_eqn("scan", new)) == (3, 1)
  # The scan rebound with those params and a body taking two more leading consts (scales of
  # the original const) computes what the original does with the const scaled by them.
  body = jex.jaxpr_as_fun(eqn.params["jaxpr"])
  args = (2.0, 1.0, jax.numpy.arange(3.0))  # w, the carry, xs, in the equation's order
  wider = jax.make_jaxpr(lambda a, b, w, c, x: body(w * a * b, c, x))(
    1.0, 1.0, 2.0, 1.0, jax.numpy.float32(0.0)
  )
  got = _values.bind(eqn, [0.5, 3.0, *args], dict(new, jaxpr=wider))
  want = _values.bind(eqn, [3.0, *args[1:]])
  for g, w in zip(got, want, strict=True):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
