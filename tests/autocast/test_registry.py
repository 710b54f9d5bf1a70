"""The registry of autocast's rules, against the installed JAX, and its lookups.

Every name a rule declares must be a primitive the installed JAX defines (in the releases
its ``Name`` gives), and every primitive JAX defines must be declared (or live in a
kernel-language module, whose primitives exist only inside a ``pallas_call``): the registry
cannot drift at a JAX upgrade. The lookups answer, for a primitive, its rule (by object
where JAX exports one, by name where it exports none) and the releases that define it;
``autocast(policy=...)`` checks each key against them.
"""

import importlib
import pkgutil
import sys
import types

import jax
from jax import lax
import jax.extend.core as jex
import jax.extend.source_info_util as jsi
import numpy as np
import pytest

import jax_lossscale as jls
from jax_lossscale._autocast import _interpreter
from jax_lossscale._autocast import _policy
from jax_lossscale._autocast import _values
from jax_lossscale._autocast._errors import UnsupportedPrimitiveError
from jax_lossscale._autocast._rules import _loops
from jax_lossscale._autocast._rules import _registry as registry


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
  missing = sorted(n for n in registry.table_names() if n not in names)
  assert not missing, (
    f"names declared by a rule that jax {jax.__version__} does not define (if a JAX version "
    f"removed them, give them their last release: Name(name, until=...)): {missing}"
  )


def test_each_version_specific_name_is_defined_exactly_in_its_releases():
  # The ranges of the Names are facts of each JAX release, checked on each one installed:
  # a name that this JAX defines outside its range (or not inside it) means a wrong range.
  names = {p.name for p, _ in PRIMITIVES}
  release = registry.jax_release()
  assert registry.OLDEST_TESTED <= release, release
  wrong = sorted(
    f"{name} (listed from {first} until {until or 'now'})"
    for name, (first, until) in registry.versioned_names().items()
    if (name in names) != registry.defined_in(name, release)
  )
  assert not wrong, f"version ranges that jax {jax.__version__} contradicts: {wrong}"


def test_the_table_of_another_release_differs_only_in_the_versioned_names():
  # jax 0.11 replaced closed_call by eval_jaxpr; both releases' tables have a call primitive.
  old, new = registry.table_names((0, 10, 2)), registry.table_names((0, 12, 0))
  assert "closed_call" in old and "closed_call" not in new
  assert old["eval_jaxpr"] == new["eval_jaxpr"] == registry.HIGHER_ORDER
  assert new["log2"] == registry.FIRST_ORDER and "log2" not in old
  assert set(old) ^ set(new) <= set(registry.versioned_names())
  assert "pgather" in registry.table_names((0, 9, 0)) and "pgather" not in old


def test_every_primitive_of_this_jax_has_a_kind():
  unknown = sorted(
    f"{p.name} ({home})"
    for p, home in PRIMITIVES
    if registry.kind_of(p) is None and not home.startswith(registry.KERNEL_MODULES)
  )
  assert not unknown, (
    "primitives without a kind: declare each in the registry as CONTRIBUTING.md says (a"
    " first-order one in _primitives.py, a higher-order one by its handler's decorator in"
    f" _loops.py): {unknown}"
  )


def test_every_policy_row_is_a_first_order_primitive():
  for row in _policy.POLICY_TABLE:
    assert registry.kind_of(registry.resolve(row.primitive)) == registry.FIRST_ORDER, row


def test_every_rule_declared_for_a_release_range_names_a_primitive_of_some_checked_release():
  # A name no checked JAX release gives a primitive (as `checkpoint` would be: JAX names
  # remat's primitive `remat2`) would be a dead declaration.
  for name, rule in registry.rules().items():
    releases = [r for r in registry.CHECKED_RELEASES if registry.defined_in(name, r)]
    assert releases, (name, rule)
    if registry.defined_in(name, registry.jax_release()):
      assert name in ALL_NAMES, f"{name}: declared for this jax, which has no such primitive"
    else:
      assert name not in ALL_NAMES, f"{name}: this jax has it, outside its declared releases"


def test_every_rule_says_what_autocast_does_in_its_first_docstring_line():
  # The guide's table of the rules shows it (docs/autocast_tables.py).
  for name, rule in registry.rules().items():
    doc = (rule.fn.__doc__ or "").strip()
    assert doc and doc.split("\n\n")[0].rstrip().endswith("."), (name, rule.fn.__name__)


def test_a_primitive_is_declared_once():
  # By construction (one dict of rules); a second declaration is refused, by name.
  with pytest.raises(ValueError, match="'scan' is declared twice"):
    registry.register(registry.HIGHER_ORDER, "scan")(lambda interp, eqn, ins: ins)
  with pytest.raises(ValueError, match="'exp' is declared twice"):
    registry.register(registry.LAYOUT, registry.Name("exp", since=(0, 11, 0)))(
      lambda interp, eqn, ins: ins
    )
  with pytest.raises(ValueError, match=r"kind must be one of \('first_order', .*got 'kernel'"):
    registry.register("kernel", "my_kernel_op")
  assert "my_kernel_op" not in registry.rules()


def test_the_rank_keeping_flag_is_on_layout_primitives_only():
  flagged = [name for name, rule in registry.rules().items() if rule.keeps_rank]
  assert {"reshape", "broadcast_in_dim", "convert_element_type"} <= set(flagged)
  for name in flagged:
    assert registry.rules()[name].kind == registry.LAYOUT, name
  assert not registry.rules()["gather"].keeps_rank


def test_the_untapped_flag_is_on_the_loops_branches_custom_rules_and_shard_map():
  untapped = {name for name, rule in registry.rules().items() if rule.untapped}
  assert untapped == {"while", "cond", "shard_map", "custom_jvp_call", "custom_vjp_call"}


def test_an_unhandled_higher_order_primitive_raises_naming_it():
  prim = registry.by_name("xla_pmap")  # jax 0.9's xla_pmap_p, a stand-in after
  assert registry.kind_of(prim) == registry.HIGHER_ORDER
  eqn = types.SimpleNamespace(primitive=prim, params={}, source_info=None)
  interp = _interpreter.Interpreter(jax.numpy.float16, _policy.check_policy(None))
  with pytest.raises(UnsupportedPrimitiveError, match=r"`xla_pmap`"):
    interp.eval_eqn(eqn, [])


def test_an_equation_with_no_user_frame_is_named_without_a_location():
  # An equation built with JAX's empty source info (no frame of the user's to show) names
  # the primitive and no " (at ...)"; one traced from a function of this file names its line.
  prim = registry.by_name("xla_pmap")
  interp = _interpreter.Interpreter(jax.numpy.float16, _policy.check_policy(None))
  eqn = types.SimpleNamespace(primitive=prim, params={}, source_info=jsi.new_source_info())
  with pytest.raises(UnsupportedPrimitiveError) as raised:
    interp.eval_eqn(eqn, [])
  message = str(raised.value)
  assert "higher-order primitive `xla_pmap`: it does not know" in message, message
  (traced,) = jax.make_jaxpr(lambda x: jax.numpy.sin(x))(1.0).eqns
  eqn = types.SimpleNamespace(primitive=prim, params={}, source_info=traced.source_info)
  with pytest.raises(UnsupportedPrimitiveError, match=r"` \(at .*test_registry\.py"):
    interp.eval_eqn(eqn, [])


def test_the_table_is_keyed_by_objects_where_jax_exports_them():
  # dot_general by identity: a kernel primitive named like a lax one is not taken for it.
  assert registry.kind_of(jax.lax.dot_general_p) == registry.FIRST_ORDER
  assert registry.kind_of(jax.lax.scatter_mul_p) == registry.SCATTER
  namesake = jex.Primitive("gather")
  assert registry.kind_of(namesake) is None


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
  assert _loops._scan_layout(_eqn("scan", {"num_consts": 2, "num_carry": 1})) == (2, 1)
  with pytest.raises(UnsupportedPrimitiveError, match=r"'num_consts' is missing in jax"):
    _loops._scan_layout(_eqn("scan", {"length": 3}))
  scan = jax.make_jaxpr(lambda c, xs, w: jax.lax.scan(lambda c, x: (c * w + x, c), c, xs))(
    1.0, jax.numpy.ones(3), 2.0
  )
  (eqn,) = [e for e in scan.jaxpr.eqns if e.primitive.name == "scan"]
  assert _loops._scan_layout(eqn) == (1, 1)
  new = _loops._scan_with_leading_consts(eqn, dict(eqn.params), 2)
  assert _loops._scan_layout(_eqn("scan", new)) == (3, 1)
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


def _identity(x):
  return x


# -- the policy's keys and rules -------------------------------------------------------


def test_a_misspelt_name_lists_every_near_name_in_order():
  # Three near names: "did you mean 'a', 'b' or 'c'?", the names sorted.
  with pytest.raises(ValueError) as raised:
    jls.autocast(_identity, policy={"expp": "float32"})
  assert str(raised.value) == (
    "policy: 'expp' is not the name of a primitive of this JAX"
    " (did you mean 'exp', 'exp2' or 'expm1'?)."
  )


def test_a_misspelt_rule_names_the_one_near_rule():
  with pytest.raises(ValueError) as raised:
    jls.autocast(_identity, policy={"exp": "flot"})
  assert str(raised.value) == (
    "policy['exp'] must be one of ('lower', 'float32', 'promote'), got 'flot'"
    " (did you mean 'float32'?)."
  )


@pytest.mark.parametrize("name", ["my_op", "exp", "gather"])
def test_a_primitive_the_registry_does_not_know_takes_no_rule(name):
  # A primitive object of the user's own, or a namesake of a lax primitive (a kernel
  # language's `exp` or `gather`): keyed by object, the registry does not take it for
  # the lax one, and the policy refuses it naming it.
  key = jex.Primitive(name)
  assert registry.kind_of(key) is None
  with pytest.raises(ValueError) as raised:
    jls.autocast(_identity, policy={key: "lower"})
  assert str(raised.value) == (
    f"policy[{name!r}]: `{name}` is unknown to autocast; only first-order primitives take a rule."
  )


@pytest.mark.parametrize(
  ("name", "kind", "what"),
  [
    ("shard_map", registry.HIGHER_ORDER, "a higher-order primitive"),
    ("pallas_call", registry.AS_WRITTEN, "an opaque primitive that runs as written"),
  ],
)
def test_a_primitive_jax_exports_no_object_for_has_its_kind_by_name(name, kind, what):
  # shard_map and pallas_call have no `*_p` object in jax.lax: a policy key names them by
  # a stand-in, whose kind is found by its name, and which takes no rule.
  key = registry.by_name(name)
  assert isinstance(key, registry.NamedPrimitive) and key.name == name
  assert registry.kind_of(key) == kind
  with pytest.raises(ValueError, match=rf"^policy\['{name}'\]: `{name}` is {what}"):
    jls.autocast(_identity, policy={name: "lower"})


# -- the lookups -------------------------------------------------------------------------


def test_resolve_gives_the_exported_object_and_refuses_any_other_name():
  assert registry.resolve("exp") is lax.exp_p
  assert registry.resolve("scatter-add") is lax.scatter_add_p
  with pytest.raises(LookupError, match=r"JAX exports no primitive named 'shard_map'\."):
    registry.resolve("shard_map")  # a primitive, but no exported object
  with pytest.raises(LookupError, match=r"JAX exports no primitive named 'no_such_op'\."):
    registry.resolve("no_such_op")


def test_a_release_defines_a_primitive_up_to_the_first_release_that_drops_it():
  # closed_call until jax 0.11 (eval_jaxpr replaces it); xla_pmap until jax 0.10. `until`
  # is the first release without the primitive.
  assert registry.rules()["closed_call"].name.until == (0, 11, 0)
  assert registry.defined_in("closed_call", (0, 10, 2))
  assert not registry.defined_in("closed_call", (0, 11, 0))
  assert registry.defined_in("xla_pmap", (0, 9, 2))
  assert not registry.defined_in("xla_pmap", (0, 10, 0))
  assert "xla_pmap" not in registry.table_names((0, 10, 0))
  assert "closed_call" not in registry.table_names((0, 11, 0))
  # and from the first release that defines it on
  assert not registry.defined_in("log2", (0, 10, 2)) and registry.defined_in("log2", (0, 11, 0))


def test_versioned_names_are_only_the_names_with_a_range():
  versioned = registry.versioned_names()
  # a rule's name without `since`/`until` is defined by every release: it is not versioned
  for name in ("jit", "scan", "while", "cond", "remat2", "custom_jvp_call", "exp", "gather"):
    assert name in registry.rules() and name not in versioned, name
  # a name with `until` is, from the oldest tested release
  assert versioned["closed_call"] == (registry.OLDEST_TESTED, (0, 11, 0))
  assert versioned["log2"] == ((0, 11, 0), None)
  ranged = {n for n, r in registry.rules().items() if r.name.since or r.name.until}
  assert ranged == set(versioned)
