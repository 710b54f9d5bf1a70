"""autocast's handlers of the higher-order primitives keep what JAX relies on when they
rebind ``jit``, ``scan``, ``while``, ``cond``, ``shard_map`` and ``custom_vjp_call``.

* A constant of an interpreted body (an ``autocast_op`` closing over an array: autocast calls
  that function again while it traces the body again) is hoisted into a leading input of
  the ``jit``, ``scan``, ``while`` (its cond and its body) or ``cond``; the parameters
  counted per input grow with it (``donated_invars``, ``in_layouts``, ``in_shardings``,
  the consts counts): the constant is donated by none and sharded by none, and the results
  are the ones computed by hand in float16.
* Every other parameter of a rebound ``scan`` is carried as it was.
* The facts cross the boundaries: a scanned layer's per-step slice of a stacked parameter
  is a parameter one rank lower (its bias stays float16, as in torch's ``linear``); a
  ``cond`` output is a lower-precision result only where every branch gives one.
* A ``while`` loop's cond runs under the policy; a ``cond`` whose branches give float16
  and float32 promotes each output to the widest.
* ``check_underflow`` counts the ops inside a ``shard_map`` once.
* A ``jit`` region's mark is declared once.
* jax >= 0.11: a ``custom_vjp`` backward rule that returns logs is refused, and one that
  returns none is differentiated.

The cases where autocast is wrong today are ``xfail(strict=True)``, with the reason.
"""

from helpers import all_eqns
from helpers import rand
import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import jax_lossscale as jls
from jax_lossscale.diagnostics import check_underflow

F16, F32 = np.dtype(jnp.float16), np.dtype(jnp.float32)

_TABLE = jnp.arange(1.0, 5.0, dtype=jnp.float32)


@jls.autocast_op(rule="float32")
def _scaled(h):
  """A float32 op closing over an array: under autocast each interpreted body that calls
  it holds ``_TABLE`` as a constant, which its handler hoists into a leading input."""
  return h * _TABLE


def _scaled_by_hand(h16):
  return h16.astype(F32) * _TABLE


def _eqn(fun, *args, name, jit_name=None):
  """The one ``name`` equation of ``fun``'s jaxpr (nested too); for a ``jit``, the one
  named ``jit_name``."""
  found = [
    e
    for e in all_eqns(jax.make_jaxpr(fun)(*args).jaxpr)
    if e.primitive.name == name and (jit_name is None or str(e.params["name"]) == jit_name)
  ]
  assert len(found) == 1, found
  return found[0]


def _half(x):
  return x.astype(F16)


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


# -- scan -------------------------------------------------------------------------------


def test_a_scanned_layers_bias_stays_float16():
  # Stacked layers (flax.linen.scan, nnx.scan): each step's slice of a stacked parameter is
  # a parameter of one rank less, so its bias is part of the matmul, as in torch's linear.
  x, ws, bs = rand(0, (4, 8)), rand(1, (3, 8, 8), 0.3), rand(2, (3, 8))

  def f(x, ws, bs):
    def layer(h, wb):
      w, b = wb
      y = h @ w + b
      return y, y

    return lax.scan(layer, x, (ws, bs))

  h, ys = jls.autocast(f)(x, ws, bs)
  assert (h.dtype, ys.dtype) == (F32, F16)  # the carry back in its declared dtype
  want_h, want_ys = x, []
  for w, b in zip(ws, bs, strict=True):
    y = _half(want_h) @ _half(w) + _half(b)
    want_ys.append(y)
    want_h = y.astype(F32)
  np.testing.assert_array_equal(ys, jnp.stack(want_ys))
  np.testing.assert_array_equal(h, want_h)


def test_a_rebound_scan_keeps_its_parameters():
  xs, w = rand(0, (5, 2, 4)), rand(1, (4, 4))

  def f(xs, w):
    return lax.scan(lambda c, x: (c + jnp.sum(x @ w), x @ w), 0.0, xs, reverse=True, unroll=2)

  before = _eqn(f, xs, w, name="scan")
  after = _eqn(jls.autocast(f), xs, w, name="scan")
  assert {k: v for k, v in after.params.items() if k != "jaxpr"} == {
    k: v for k, v in before.params.items() if k != "jaxpr"
  }


def test_a_scan_whose_body_holds_a_constant_takes_it_as_a_leading_const():
  xs, w = rand(0, (3, 2, 4)), rand(1, (4, 4))

  def f(xs, w):
    def step(c, x):
      y = _scaled(x @ w)
      return c + jnp.sum(y), y

    return lax.scan(step, jnp.float32(0.0), xs)

  after = _eqn(jls.autocast(f), xs, w, name="scan")
  # the table, hoisted, then w (a const of the body as written), the carry, xs
  assert [v.aval.shape for v in after.invars] == [(4,), (4, 4), (), (3, 2, 4)]
  if "num_consts" in after.params:  # jax 0.9-0.10 (ft_in from jax 0.11)
    assert (after.params["num_consts"], after.params["num_carry"]) == (2, 1)
  total, ys = jls.autocast(f)(xs, w)
  want = jnp.stack([_scaled_by_hand(_half(x) @ _half(w)) for x in xs])
  assert ys.dtype == F32
  np.testing.assert_array_equal(ys, want)
  np.testing.assert_allclose(total, jnp.sum(want), rtol=1e-6)


# -- while ------------------------------------------------------------------------------


def _loop_by_hand(cond, body, init):
  carry = init
  while cond(carry):
    carry = body(carry)
  return carry


def test_a_while_loops_cond_runs_under_the_policy():
  x, w = rand(0, (2, 4)), rand(1, (4, 4), 0.5)

  def f(x, w):
    return lax.while_loop(
      lambda c: jnp.sum(c[1] @ w) < 50.0, lambda c: (c[0] + 1, c[1] + 0.5), (0, x)
    )

  loop = _eqn(jls.autocast(f), x, w, name="while")
  (dot,) = [e for e in loop.params["cond_jaxpr"].jaxpr.eqns if e.primitive.name == "dot_general"]
  assert [np.dtype(v.aval.dtype) for v in (*dot.invars, *dot.outvars)] == [F16, F16, F16]
  n, h = jls.autocast(f)(x, w)
  want_n, want_h = _loop_by_hand(
    lambda c: float(jnp.sum((_half(c[1]) @ _half(w)).astype(F32))) < 50.0,
    lambda c: (c[0] + 1, c[1] + 0.5),
    (0, x),
  )
  assert int(n) == want_n > 0
  np.testing.assert_array_equal(h, want_h)


def test_a_while_whose_cond_and_body_hold_a_constant_takes_it_in_each():
  x, w = jnp.full((2, 4), 0.5, jnp.float32), 0.75 * jnp.eye(4, dtype=jnp.float32)

  def f(x, w):
    return lax.while_loop(
      lambda c: jnp.sum(_scaled(c[1] @ w)) < 100.0,
      lambda c: (c[0] + 1, _scaled(c[1] @ w)),
      (0, x),
    )

  loop = _eqn(jls.autocast(f), x, w, name="while")
  # cond: the table, hoisted, then w; body: the same; then the carry (the count, h)
  assert (loop.params["cond_nconsts"], loop.params["body_nconsts"]) == (2, 2)
  assert [v.aval.shape for v in loop.invars] == [(4,), (4, 4), (4,), (4, 4), (), (2, 4)]
  n, h = jls.autocast(f)(x, w)
  want_n, want_h = _loop_by_hand(
    lambda c: float(jnp.sum(_scaled_by_hand(_half(c[1]) @ _half(w)))) < 100.0,
    lambda c: (c[0] + 1, _scaled_by_hand(_half(c[1]) @ _half(w))),
    (0, x),
  )
  assert int(n) == want_n > 1
  assert h.dtype == F32
  np.testing.assert_array_equal(h, want_h)


# -- cond -------------------------------------------------------------------------------


def test_a_cond_whose_branches_give_float16_and_float32_promotes():
  x, w = rand(0, (4, 4)), rand(1, (4, 4))

  def f(p, x, w):
    return lax.cond(p, lambda: (x @ w, jnp.int32(1)), lambda: (x * 2.0, jnp.int32(2)))

  for p, want in ((True, _half(x) @ _half(w)), (False, x * 2.0)):
    out, n = jls.autocast(f)(p, x, w)
    assert (out.dtype, n.dtype) == (F32, jnp.int32)
    np.testing.assert_array_equal(out, want.astype(F32))
    assert int(n) == (1 if p else 2)


def test_a_cond_output_is_a_lower_precision_result_only_where_every_branch_gives_one():
  # The bias rule: a float32 bias added to a matmul's float16 output stays float16. A cond
  # whose other branch gives a float16 tanh gives no op's output: the bias promotes it, as
  # torch's `h + b` of a float16 tensor and a float32 parameter does.
  x, w, b = rand(0, (4, 4)), rand(1, (4, 4)), rand(2, (4,))

  def f(p, x, w, b):
    both = lax.cond(p, lambda: x @ w, lambda: (x * 2.0) @ w)
    one = lax.cond(p, lambda: x @ w, lambda: jnp.tanh(x @ w))
    return both + b, one + b

  both, one = jls.autocast(f)(True, x, w, b)
  assert (both.dtype, one.dtype) == (F16, F32)
  np.testing.assert_array_equal(both, _half(x) @ _half(w) + _half(b))
  np.testing.assert_array_equal(one, (_half(x) @ _half(w)).astype(F32) + b)


def test_a_cond_whose_branch_holds_a_constant_takes_it_as_an_operand():
  x, w = rand(0, (2, 4)), rand(1, (4, 4))

  def f(p, x, w):
    return lax.cond(p, lambda: _scaled(x @ w), lambda: x)

  cond = _eqn(jls.autocast(f), True, x, w, name="cond")
  # the index, the table (hoisted), x, w
  assert [v.aval.shape for v in cond.invars] == [(), (4,), (2, 4), (4, 4)]
  np.testing.assert_array_equal(jls.autocast(f)(True, x, w), _scaled_by_hand(_half(x) @ _half(w)))
  np.testing.assert_array_equal(jls.autocast(f)(False, x, w), x)


def test_a_cond_may_give_a_prng_key():
  def f(p, key, x):
    key = lax.cond(p, lambda k: k, lambda k: jax.random.split(k)[0], key)
    return jax.random.normal(key, (2,)) + x

  x = jnp.ones(2)
  for p in (True, False):
    # Against f compiled, as autocast's function is: f run op by op differs in the last bit
    # of normal's float32 polynomial.
    np.testing.assert_array_equal(
      jls.autocast(f)(p, jax.random.key(0), x), jax.jit(f)(p, jax.random.key(0), x)
    )


def _not_checked(report):
  return {k: tuple(int(v) for v in n) for k, n in report.not_checked.items()}


def test_check_underflow_counts_the_ops_inside_a_cond_once():
  w, x = rand(0, (4, 4)), rand(1, (8, 4))

  def loss(w, x):
    h = lax.cond(x[0, 0] > 0, lambda: x @ w, lambda: (x @ w) * 2.0)
    return jnp.sum(h.astype(F32))

  assert _not_checked(check_underflow(jls.autocast(loss), w, x)) == {"cond": (1, 2)}


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


# -- custom_vjp (jax >= 0.11: a backward rule may return logs) ---------------------------


def _matmul_vjp():
  @jax.custom_vjp
  def matmul(x, w):
    return x @ w

  def fwd(x, w):
    return x @ w, (x, w)

  def bwd(res, g):
    x, w = res
    return g @ w.T, x.T @ g

  return matmul, fwd, bwd


def test_a_custom_vjps_backward_rule_runs_under_the_policy():
  x, w = rand(0, (2, 4)), rand(1, (4, 4))
  matmul, fwd, bwd = _matmul_vjp()
  matmul.defvjp(fwd, bwd)
  gx, gw = jax.grad(lambda x, w: jnp.sum(jls.autocast(matmul)(x, w)), argnums=(0, 1))(x, w)
  assert (gx.dtype, gw.dtype) == (F32, F32)  # each input's dtype
  # the cotangent of a float16 output, float16 matmuls, each cast back to float32
  g = jnp.ones((2, 4), F16)
  np.testing.assert_array_equal(gx, (g @ _half(w).T).astype(F32))
  np.testing.assert_array_equal(gw, (_half(x).T @ g).astype(F32))


@pytest.mark.skipif(
  not hasattr(jax.custom_vjp, "defvjp_with_logs"), reason="custom_vjp logs: jax >= 0.11"
)
def test_a_custom_vjp_whose_backward_rule_returns_logs_is_refused():
  x, w = rand(0, (2, 4)), rand(1, (4, 4))
  matmul, fwd, bwd = _matmul_vjp()
  matmul.defvjp_with_logs(fwd, lambda res, g: (bwd(res, g), {"g": g}))
  with pytest.raises(jls.UnsupportedPrimitiveError, match="returns logs"):
    jax.grad(lambda w: jnp.sum(jls.autocast(matmul)(x, w)))(w)
