"""autocast's rules of the call primitives (``_rules/_calls.py``): a rebound ``jit`` keeps
its donation, layouts and shardings when its body holds a constant (hoisted into a leading
input, donated by none and sharded by none); a ``jit`` region's mark is declared once;
``shard_map`` takes a constant of its body as an operand and ``check_underflow`` counts the
ops inside it once.

The cases where autocast is wrong today are ``xfail(strict=True)``, with the reason.
"""

from helpers import eqn_named as _eqn
from helpers import eqns_named as _eqns
from helpers import half as _half
from helpers import not_checked as _not_checked
from helpers import rand
from helpers import rand_dtype as _rand
from helpers import scaled_by_table as _scaled
from helpers import scaled_by_table_by_hand as _scaled_by_hand
import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import jax_lossscale as jls
from jax_lossscale._autocast import autocast
from jax_lossscale.diagnostics import check_underflow

F16, F32 = np.dtype(jnp.float16), np.dtype(jnp.float32)


# -- jit --------------------------------------------------------------------------------


def test_a_jit_region_mark_is_declared_once():
  from jax_lossscale._autocast._rules import _calls

  mark, region = next(iter(_calls._REGIONS.items()))
  try:
    with pytest.raises(ValueError, match="declared twice"):
      _calls.jit_region(mark)(lambda interp, eqn, ins: ins)
  finally:
    _calls._REGIONS[mark] = region
  # the region first declared under that mark is still the one that evaluates it
  assert _calls._REGIONS[mark] is region


def test_a_jit_whose_body_holds_a_constant_keeps_its_donation_and_layouts():
  x, w = rand(0, (2, 4)), rand(1, (4, 4))
  inner = jax.jit(lambda x, w: _scaled(x @ w), donate_argnums=0)

  def f(x, w):
    return inner(x, w)

  before = _eqn(f, x, w, name="jit", jit_name="<lambda>")
  after = _eqn(jls.autocast(f), x, w, name="jit", jit_name="<lambda>")
  assert before.params["donated_invars"] == (True, False)
  # the constant leads, donated by none and laid out by default
  assert [v.aval.shape for v in after.invars] == [(4,), (2, 4), (4, 4)]
  assert after.params["donated_invars"] == (False, True, False)
  assert after.params["in_layouts"] == (None, *before.params["in_layouts"])
  assert after.params["in_shardings"][1:] == before.params["in_shardings"]
  assert len(after.params["in_shardings"]) == 3
  out = jls.autocast(f)(x, w)
  assert out.dtype == F32
  np.testing.assert_array_equal(out, _scaled_by_hand(_half(x) @ _half(w)))


@pytest.mark.parametrize("w_sharded", [False, True], ids=["w_unspecified", "every_input_sharded"])
def test_a_sharded_jit_whose_body_holds_a_constant_leaves_the_constant_unsharded(w_sharded):
  mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
  rows, replicated = NamedSharding(mesh, P("d")), NamedSharding(mesh, P())
  x, w = jax.device_put(rand(0, (8, 4)), rows), rand(1, (4, 4))
  in_shardings = (rows, replicated if w_sharded else None)
  inner = jax.jit(lambda x, w: _scaled(x @ w), in_shardings=in_shardings, out_shardings=rows)

  def f(x, w):
    return inner(x, w)

  with jax.set_mesh(mesh):
    before = _eqn(f, x, w, name="jit", jit_name="<lambda>")
    after = _eqn(jls.autocast(f), x, w, name="jit", jit_name="<lambda>")
    out = jax.jit(jls.autocast(f))(x, w)
  # the table (4 elements: it could not even be split over the 8 devices) is unspecified
  (table,) = after.params["in_shardings"][:1]
  assert type(table).__name__ == "UnspecifiedValue", after.params["in_shardings"]
  assert after.params["in_shardings"][1:] == before.params["in_shardings"]
  assert out.dtype == F32 and out.sharding.spec[0] == "d"
  np.testing.assert_array_equal(out, _scaled_by_hand(_half(x) @ _half(w)))


# -- shard_map --------------------------------------------------------------------------


def _shard_mapped(body):
  mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
  fn = jax.shard_map(body, mesh=mesh, in_specs=(P("d"), P()), out_specs=P("d"))
  return mesh, fn


def test_check_underflow_counts_the_ops_inside_a_shard_map_once():
  # The body is traced once through jax.shard_map and that jaxpr is bound as the equation's
  # own: its two matmuls are counted once each.
  w, x = rand(0, (4, 4)), rand(1, (8, 4))
  mesh, body = _shard_mapped(lambda a, w: jnp.tanh(a @ w) @ w)

  def loss(w, x):
    return jnp.sum(body(x, w).astype(F32))

  with jax.set_mesh(mesh):
    report = check_underflow(jls.autocast(loss), w, x)
  assert _not_checked(report) == {"shard_map": (1, 2)}
  assert "the 2 lower-precision op outputs inside 1 shard_map" in report.verdict()


def test_a_shard_map_whose_body_holds_a_constant_takes_it_as_an_operand():
  w, x = rand(0, (4, 4)), rand(1, (8, 4))
  mesh, body = _shard_mapped(lambda a, w: _scaled(a @ w))
  with jax.set_mesh(mesh):
    smap = _eqn(jls.autocast(body), x, w, name="shard_map")
    out = jax.jit(jls.autocast(body))(x, w)
  # the table leads, replicated
  assert [v.aval.shape for v in smap.invars] == [(4,), (8, 4), (4, 4)]
  assert smap.params["in_specs"] == (P(), P("d"), P())
  assert out.dtype == F32
  np.testing.assert_array_equal(out, _scaled_by_hand(_half(x) @ _half(w)))


def test_check_underflow_counts_the_ops_inside_a_shard_map_holding_a_constant_once():
  w, x = rand(0, (4, 4)), rand(1, (8, 4))
  mesh, body = _shard_mapped(lambda a, w: _scaled(a @ w))

  def loss(w, x):
    return jnp.sum(body(x, w))

  with jax.set_mesh(mesh):
    assert _not_checked(check_underflow(jls.autocast(loss), w, x)) == {"shard_map": (1, 1)}


def test_shard_map_blocks_follow_the_declared_in_specs():
  # The input is not sharded: only the declared in_specs split it into per-device blocks.
  mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
  x = jnp.arange(8.0, dtype=jnp.float32)
  w = _rand(0, (1, 1))

  def f(x, w):
    body = jax.shard_map(
      lambda a, w: (a[:, None] @ w)[:, 0] * lax.axis_index("d").astype(jnp.float32),
      mesh=mesh,
      in_specs=(P("d"), P()),
      out_specs=P("d"),
    )
    return body(x, w)

  out = autocast(f)(x, w)
  assert out.dtype == F16 and out.shape == (8,)
  ref = (x.astype(F16) * w[0, 0].astype(F16)) * jnp.arange(8.0, dtype=F16)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


def test_a_bias_added_to_a_nested_jits_matmul_stays_float16():
  # The lower-precision flag of a jit's output crosses the jit: x @ w inside, + b outside.
  x, w, b = _rand(0, (2, 3)), _rand(1, (3, 4)), _rand(2, (4,))
  f = lambda x, w, b: jax.jit(lambda x, w: x @ w)(x, w) + b
  out = autocast(f)(x, w, b)
  assert out.dtype == F16
  ref = x.astype(F16) @ w.astype(F16) + b.astype(F16)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


def _inner(eqns, mark="lambda"):
  return [e for e in eqns if mark in str(e.params.get("name", mark))]


def test_a_nested_jit_keeps_inline_keep_unused_and_a_partial_in_sharding():
  mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
  s = jax.NamedSharding(mesh, P("d"))
  x = jax.device_put(_rand(0, (8, 4)), s)
  w = _rand(1, (4, 4))
  # inline=True survives staging only with a sharding; keep_unused keeps `u`.
  inline = jax.jit(
    lambda a, w: (a @ w, w), inline=True, in_shardings=(s, None), out_shardings=(s, None)
  )
  unused = jax.jit(lambda a, u: a * 2.0, keep_unused=True)
  f = lambda x, w: unused(inline(x, w)[0], w)
  with jax.set_mesh(mesh):
    ours = _inner(_eqns(jax.make_jaxpr(autocast(f))(x, w), "jit"))
    theirs = _inner(_eqns(jax.make_jaxpr(f)(x, w), "jit"))
    out = autocast(f)(x, w)
  assert len(ours) == len(theirs) == 2
  for a, b in zip(ours, theirs, strict=True):
    assert a.params["inline"] == b.params["inline"]
    assert a.params["keep_unused"] == b.params["keep_unused"]
  # jax <= 0.10 spells `inline` as a bool; jax >= 0.11 as an enum (True is JAX_LATE).
  inline_params = [str(getattr(e.params["inline"], "value", e.params["inline"])) for e in ours]
  assert inline_params in (["True", "False"], ["jax_late", "auto"]), inline_params
  assert [e.params["keep_unused"] for e in ours] == [False, True]
  assert ours[0].params["in_shardings"][0].spec == P("d")
  assert ours[0].params["out_shardings"][0].spec == P("d")
  assert out.dtype == F16
  np.testing.assert_array_equal(
    np.asarray(out), np.asarray((x.astype(F16) @ w.astype(F16)) * jnp.float16(2))
  )


def test_remat_keeps_its_policy_and_prevent_cse():
  policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
  f = lambda x, w: jnp.sum(jax.checkpoint(lambda h: jnp.tanh(h @ w), policy=policy)(x))
  g = lambda x, w: jnp.sum(jax.checkpoint(lambda h: jnp.tanh(h @ w), prevent_cse=False)(x))
  x, w = _rand(0, (3, 4)), _rand(1, (4, 4))
  name = jax.make_jaxpr(f)(x, w).jaxpr.eqns[0].primitive.name
  (a,) = _eqns(jax.make_jaxpr(autocast(f))(x, w), name)
  (b,) = _eqns(jax.make_jaxpr(autocast(g))(x, w), name)
  assert a.params["policy"] is policy and a.params["prevent_cse"] is True
  assert b.params["policy"] is None and b.params["prevent_cse"] is False


def test_shard_map_keeps_its_manual_axes_and_check_vma():
  mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(AxisType.Explicit,) * 2)
  x = jax.device_put(_rand(0, (8, 4)), jax.NamedSharding(mesh, P("a")))
  w = _rand(1, (4, 4))
  # Manual over `a` only; the body's per-device result is declared replicated, which
  # only check_vma=False allows.
  body = lambda a, w: jnp.sum(a @ w, axis=0, keepdims=True)
  f = lambda x, w: jax.shard_map(
    body,
    mesh=mesh,
    in_specs=(P("a"), P()),
    out_specs=P(),
    axis_names={"a"},
    check_vma=False,
  )(x, w)
  with jax.set_mesh(mesh):
    (eqn,) = _eqns(jax.make_jaxpr(autocast(f))(x, w), "shard_map")
    (ref,) = _eqns(jax.make_jaxpr(f)(x, w), "shard_map")
    out = autocast(f)(x, w)
  manual = "newly_manual_axes" if "newly_manual_axes" in ref.params else "manual_axes"  # jax 0.9
  assert eqn.params[manual] == ref.params[manual] == frozenset({"a"})
  assert eqn.params["check_vma"] is False
  assert out.dtype == F32 and out.shape == (1, 4)  # a float16 matmul, a float32 sum
  first = jnp.sum(
    (_rand(0, (8, 4))[:2].astype(F16) @ w.astype(F16)).astype(F32), axis=0, keepdims=True
  )
  np.testing.assert_array_equal(np.asarray(out), np.asarray(first))
