"""The registry's lookups and the policy's checks, as CONTRIBUTING.md and the guide say.

The registry (``jax_lossscale._autocast._primitives``) answers, for a primitive: its kind
(by object where JAX exports one, by name where it exports none), its handler, the
releases that define it (``defined_in``, ``versioned_names``) and the exported object of
a name (``resolve``). ``autocast(policy=...)`` checks each key against it: an unknown
name, an unknown rule, a primitive that takes no rule, each refused naming it.
"""

from jax import lax
import jax.extend.core as jex
import pytest

import jax_lossscale as jls
from jax_lossscale._autocast import _primitives as prims


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
  assert prims.kind(key) is None
  with pytest.raises(ValueError) as raised:
    jls.autocast(_identity, policy={key: "lower"})
  assert str(raised.value) == (
    f"policy[{name!r}]: `{name}` is unknown to autocast; only first-order primitives take a rule."
  )


@pytest.mark.parametrize(
  ("name", "kind", "what"),
  [
    ("shard_map", prims.HIGHER_ORDER, "a higher-order primitive"),
    ("pallas_call", prims.AS_WRITTEN, "an opaque primitive that runs as written"),
  ],
)
def test_a_primitive_jax_exports_no_object_for_has_its_kind_by_name(name, kind, what):
  # shard_map and pallas_call have no `*_p` object in jax.lax: a policy key names them by
  # a stand-in, whose kind is found by its name, and which takes no rule.
  key = prims.by_name(name)
  assert isinstance(key, prims.NamedPrimitive) and key.name == name
  assert prims.kind(key) == kind
  with pytest.raises(ValueError, match=rf"^policy\['{name}'\]: `{name}` is {what}"):
    jls.autocast(_identity, policy={name: "lower"})


# -- the lookups -------------------------------------------------------------------------


def test_resolve_gives_the_exported_object_and_refuses_any_other_name():
  assert prims.resolve("exp") is lax.exp_p
  assert prims.resolve("scatter-add") is lax.scatter_add_p
  with pytest.raises(LookupError, match=r"JAX exports no primitive named 'shard_map'\."):
    prims.resolve("shard_map")  # a primitive, but no exported object
  with pytest.raises(LookupError, match=r"JAX exports no primitive named 'no_such_op'\."):
    prims.resolve("no_such_op")


def test_a_release_defines_a_primitive_up_to_the_first_release_that_drops_it():
  # closed_call: declared by its handler until jax 0.11 (eval_jaxpr replaces it); xla_pmap
  # in VERSIONED until jax 0.10. `until` is the first release without the primitive.
  assert prims.handler_of("closed_call").until == (0, 11, 0)
  assert prims.defined_in("closed_call", (0, 10, 2))
  assert not prims.defined_in("closed_call", (0, 11, 0))
  assert prims.defined_in("xla_pmap", (0, 9, 2))
  assert not prims.defined_in("xla_pmap", (0, 10, 0))
  assert "xla_pmap" not in prims.table_names((0, 10, 0))
  assert "closed_call" not in prims.table_names((0, 11, 0))
  # and from the first release that defines it on
  assert not prims.defined_in("log2", (0, 10, 2)) and prims.defined_in("log2", (0, 11, 0))


def test_versioned_names_are_only_the_names_with_a_range():
  versioned = prims.versioned_names()
  # a handler without `since`/`until` is defined by every release: it is not versioned
  for name in ("jit", "scan", "while", "cond", "remat2", "custom_jvp_call"):
    assert prims.handler_of(name) is not None and name not in versioned, name
  # a handler with `until` is, from the oldest tested release
  assert versioned["closed_call"] == (prims.OLDEST_TESTED, (0, 11, 0))
  assert versioned["log2"] == ((0, 11, 0), None)
  assert {n for n, h in prims.handlers().items() if h.since or h.until} <= set(versioned)
