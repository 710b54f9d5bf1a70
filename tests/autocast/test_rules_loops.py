"""autocast's rules of the loops (``_rules/_loops.py``): a scanned layer's per-step slice
of a stacked parameter is a parameter (its bias stays float16); a rebound ``scan`` keeps
its parameters and takes a constant of its body as a leading const; a ``while`` loop's
cond runs under the policy, and a constant of its cond and body is hoisted into each.
"""

from helpers import eqn_named as _eqn
from helpers import eqns_named as _eqns
from helpers import half as _half
from helpers import rand
from helpers import rand_dtype as _rand
from helpers import scaled_by_table as _scaled
from helpers import scaled_by_table_by_hand as _scaled_by_hand
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

import jax_lossscale as jls
from jax_lossscale._autocast import autocast

F16, F32 = np.dtype(jnp.float16), np.dtype(jnp.float32)


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


def test_a_reverse_scan_keeps_its_direction():
  # scan(reverse=True) is the forward scan over the reversed sequence, its outputs
  # reversed back; under autocast too (each step a float16 matmul).
  ws, x = _rand(0, (3, 4, 4)), _rand(1, (2, 4))

  def body(h, w):
    h = jnp.tanh(h @ w)
    return h, h

  backwards = autocast(lambda ws, x: lax.scan(body, x, ws, reverse=True))(ws, x)
  by_hand = autocast(lambda ws, x: lax.scan(body, x, ws[::-1]))(ws, x)
  forwards = autocast(lambda ws, x: lax.scan(body, x, ws))(ws, x)
  np.testing.assert_array_equal(np.asarray(backwards[0]), np.asarray(by_hand[0]))
  np.testing.assert_array_equal(np.asarray(backwards[1]), np.asarray(by_hand[1][::-1]))
  assert backwards[1].dtype == by_hand[1].dtype == F16
  assert not np.array_equal(np.asarray(backwards[0]), np.asarray(forwards[0]))


def test_scan_keeps_its_unroll():
  ws, x = _rand(0, (4, 3, 3)), _rand(1, (2, 3))
  f = lambda ws, x: lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws, unroll=2)[0]
  (eqn,) = _eqns(jax.make_jaxpr(autocast(f))(ws, x), "scan")
  assert eqn.params["unroll"] == 2
  np.testing.assert_array_equal(
    np.asarray(autocast(f)(ws, x)),
    np.asarray(
      autocast(lambda ws, x: lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0])(ws, x)
    ),
  )
