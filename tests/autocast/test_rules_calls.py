"""autocast's rules of the call primitives (``_rules/_calls.py``): a rebound ``jit`` keeps
its donation, layouts and shardings when its body holds a constant (hoisted into a leading
input, donated by none and sharded by none); a ``jit`` region's mark is declared once;
``shard_map`` takes a constant of its body as an operand and ``check_underflow`` counts the
ops inside it once.

The cases where autocast is wrong today are ``xfail(strict=True)``, with the reason.
"""

from helpers import eqn_named as _eqn
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
