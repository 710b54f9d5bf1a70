"""CONTRIBUTING.md's recipe, followed: a new primitive gets its rule from one decorated function.

A primitive of the test's own (``jls_test_softplus``, exported by no JAX module, so it is
declared by name) starts unknown to autocast: it promotes, and a policy cannot name it. One
decorated function in a room declares it; from then on autocast applies that rule, a policy
may name it, the drift lookups list it, and the guide's table shows its docstring. The
registry is restored after each test.
"""

import jax
import jax.extend.core as jex
from jax.interpreters import mlir
import jax.numpy as jnp
import numpy as np
import pytest

import jax_lossscale as jls
from jax_lossscale._autocast._rules import _first_order
from jax_lossscale._autocast._rules import _registry as registry
from jax_lossscale._autocast._values import Val
from jax_lossscale._autocast._values import bind
from jax_lossscale._autocast._values import cast

F16, F32 = np.dtype(jnp.float16), np.dtype(jnp.float32)


def _softplus(x):
  return jnp.logaddexp(x, jnp.zeros_like(x))


softplus_p = jex.Primitive("jls_test_softplus")
softplus_p.def_impl(_softplus)
softplus_p.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
mlir.register_lowering(softplus_p, mlir.lower_fun(_softplus, multiple_results=False))


def model(x, w):
  return softplus_p.bind(x @ w)  # a float16 matmul's output under autocast


X = jax.random.normal(jax.random.key(0), (4, 8), jnp.float32)
W = jax.random.normal(jax.random.key(1), (8, 8), jnp.float32)


@pytest.fixture
def registry_restored(monkeypatch):
  """The registry's tables as they were, after the test."""
  for table in ("_RULES", "_BY_OBJECT", "_BY_NAME", "_NAMED_OBJECTS", "_STAND_INS"):
    monkeypatch.setattr(registry, table, dict(getattr(registry, table)))


def test_an_undeclared_primitive_promotes_and_takes_no_policy(registry_restored):
  assert registry.kind_of(softplus_p) is None
  out = jls.autocast(model)(X, W)
  assert out.dtype == F16  # promote: its one operand's dtype
  with pytest.raises(ValueError, match="is not the name of a primitive of this JAX"):
    jls.autocast(model, policy={"jls_test_softplus": "float32"})


@pytest.mark.parametrize("jit", [False, True])
def test_one_decorated_function_in_a_room_gives_a_primitive_its_rule(registry_restored, jit):
  @registry.register(registry.FIRST_ORDER, "jls_test_softplus")
  def softplus_in_float32(interp, eqn, ins):
    """Runs in float32 and returns the autocast dtype (a test's own rule)."""
    out = bind(eqn, [cast(v.x, jnp.float32) for v in ins])[0]
    return [Val(cast(out, interp.dtype))]

  rule = registry.lookup(softplus_p)
  assert (rule.kind, rule.fn, rule.name) == (
    registry.FIRST_ORDER,
    softplus_in_float32,
    registry.Name("jls_test_softplus"),
  )
  assert registry.table_names()["jls_test_softplus"] == registry.FIRST_ORDER
  f = jls.autocast(model)
  out = (jax.jit(f) if jit else f)(X, W)
  assert out.dtype == F16
  h = (X.astype(F16) @ W.astype(F16)).astype(F32)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(_softplus(h).astype(F16)))


def test_a_primitive_declared_with_the_first_order_rule_takes_the_policy(registry_restored):
  # The other way to add one: the room's existing behaviour, declared for one more name.
  registry.register(registry.FIRST_ORDER, "jls_test_softplus")(_first_order.first_order)
  assert jls.autocast(model)(X, W).dtype == F16  # promote, by default
  out = jls.autocast(model, policy={"jls_test_softplus": "float32"})(X, W)
  assert out.dtype == F32
  h = (X.astype(F16) @ W.astype(F16)).astype(F32)
  np.testing.assert_allclose(np.asarray(out), np.asarray(_softplus(h)), rtol=1e-6)


def test_a_declaration_shows_in_the_guides_table(registry_restored):
  import importlib.util
  import pathlib

  root = pathlib.Path(__file__).resolve().parents[2]
  spec = importlib.util.spec_from_file_location("autocast_tables", root / "docs/autocast_tables.py")
  tables = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(tables)

  @registry.register(registry.LAYOUT, registry.Name("jls_test_softplus", since=(0, 9, 0)))
  def odd(interp, eqn, ins):
    """A test's own layout rule."""
    return ins

  rendered = tables.rules_table()
  assert (
    "| `layout` | `jls_test_softplus` | 1 | A test's own layout rule. | `test_adding_a_rule` |"
    in (rendered)
  )
  assert registry.versioned_names()["jls_test_softplus"] == ((0, 9, 0), None)
