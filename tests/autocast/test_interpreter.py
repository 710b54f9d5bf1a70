"""The autocast interpreter, rule by rule (``jax_lossscale/_autocast/_interpreter.py``).

Each test pins one documented behaviour of ``docs/guides/autocast.md`` through the public
API (``jls.autocast``, ``jls.autocast_op``, ``check_underflow``), with exact dtypes and
values computed by hand:

* the kinds: ``sort`` (an independent primitive) keeps each operand in its own dtype; a
  policy entry by name for a primitive JAX exports no object for takes effect;
* the facts through layouts: a select of two matmul outputs is one (the bias rule holds),
  a select of a matmul output and another float16 value is not, a select of two constants
  is a constant (it follows), a row gathered from a parameter table is no bias, a scatter
  into a matmul output keeps it one;
* conversions: a cast to another half dtype is honoured, a weak float made strong (an
  identity of the model) is not;
* torch's categories: a rank-0 array does not promote a dimensioned one, a weakly typed
  array promotes nothing, two rank-0 arrays promote;
* check_underflow's taps: integer outputs of a lower-precision primitive are neither
  tapped nor counted as unchecked, an op with a float and an integer output inside a loop
  is counted, and a user's tap is a duplicate of an automatic one exactly when it is added
  to a value with that output's gradient (a same-shape add, a reshape; not a tile, not a
  scalar added to a larger array), however the tap itself is laid out.
"""

from helpers import assert_equal_in_dtype as _eq
from helpers import matmul16 as _mm16
from helpers import rand as _rand
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_lossscale as jls
from jax_lossscale.diagnostics import check_underflow

F16, BF16, F32 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)


# -- the kinds -----------------------------------------------------------------------


def test_a_policy_entry_by_name_for_a_primitive_without_an_exported_object_takes_effect():
  # ragged_dot_general runs in its operands' dtypes by default; a policy entry naming it
  # (JAX 0.10 exports no Primitive object for it) makes it lower precision.
  lhs, rhs = _rand(0, (6, 8)), _rand(1, (2, 8, 4))
  sizes = jnp.array([2, 4], jnp.int32)
  lowered = jls.autocast(lax.ragged_dot, policy={"ragged_dot_general": "lower"})
  _eq(lowered(lhs, rhs, sizes), lax.ragged_dot(lhs.astype(F16), rhs.astype(F16), sizes))
  _eq(jls.autocast(lax.ragged_dot)(lhs, rhs, sizes), lax.ragged_dot(lhs, rhs, sizes))


# -- facts through layouts -----------------------------------------------------------


def test_a_select_of_two_matmul_outputs_keeps_the_bias_in_float16():
  x, w1, w2, b = _rand(0, (4, 8)), _rand(1, (8, 8)), _rand(2, (8, 8)), _rand(3, (8,))
  m = _rand(4, (4, 8)) > 0
  out = jls.autocast(lambda x, w1, w2, b, m: jnp.where(m, x @ w1, x @ w2) + b)(x, w1, w2, b, m)
  _eq(out, jnp.where(m, _mm16(x, w1), _mm16(x, w2)) + b.astype(F16))


def test_a_select_of_a_matmul_output_and_another_float16_value_is_not_the_ops_output():
  # tanh(h) is float16 but no lower-precision result: the select is not one, and the
  # vector added to it promotes (torch: tanh(linear(x)) + b is float32).
  x, w1, w2, b = _rand(0, (4, 8)), _rand(1, (8, 8)), _rand(2, (8, 8)), _rand(3, (8,))
  m = _rand(4, (4, 8)) > 0
  f = lambda x, w1, w2, b, m: jnp.where(m, x @ w1, jnp.tanh(x @ w2)) + b
  out = jls.autocast(f)(x, w1, w2, b, m)
  _eq(out, jnp.where(m, _mm16(x, w1), jnp.tanh(_mm16(x, w2))).astype(F32) + b)


def test_a_select_of_two_constants_follows_the_activation():
  # A constant selected between constants is a constant: the float16 matmul output keeps
  # its dtype (torch: h * torch.where(m, 1.0, 0.5) is float16).
  x, w = _rand(0, (4, 8)), _rand(1, (8, 8))
  m = _rand(2, (4, 8)) > 0

  def f(x, w, m):
    h = x @ w
    return h * jnp.where(m, jnp.ones_like(h), jnp.full_like(h, 0.5))

  out = jls.autocast(f)(x, w, m)
  _eq(out, _mm16(x, w) * jnp.where(m, jnp.float16(1.0), jnp.float16(0.5)))


def test_a_row_gathered_from_a_parameter_table_is_not_a_bias():
  # An embedding lookup is a computed value, not a layout of the table (torch:
  # linear(x) + table[tokens] is float32), even where its rank is below the output's.
  x, w, table = _rand(0, (2, 3, 8)), _rand(1, (8, 8)), _rand(2, (5, 8))
  tokens = jnp.array([[0, 4, 2], [1, 1, 3]], jnp.int32)
  out = jls.autocast(lambda x, w, t, tok: x @ w + t[tok])(x, w, table, tokens)
  _eq(out, _mm16(x, w).astype(F32) + table[tokens])


# -- conversions -----------------------------------------------------------------------


def test_a_cast_of_a_matmul_output_to_another_half_dtype_is_honoured():
  x, w = _rand(0, (4, 8)), _rand(1, (8, 8))
  out = jls.autocast(lambda x, w: (x @ w).astype(jnp.bfloat16))(x, w)
  _eq(out, _mm16(x, w).astype(BF16))


def test_a_weak_float_made_strong_on_a_lowered_value_stays_float16():
  # The function's cast to its own dtype is an identity of the jaxpr (here a weakly typed
  # dot made strong): it cannot be told from no cast, and the value keeps autocast's
  # float16 (the guide's own_dtype_cast deviation).
  def f(s, t):
    d = lax.dot(lax.broadcast(s, (8,)), lax.broadcast(t, (8,)))  # weakly typed float32
    return d.astype(jnp.float32), jnp.tanh(d.astype(jnp.float32))

  s, t = jnp.asarray(0.3), jnp.asarray(-0.7)  # weakly typed arrays
  jaxpr = jax.make_jaxpr(f)(s, t).jaxpr
  converts = [e for e in jaxpr.eqns if e.primitive.name == "convert_element_type"]
  assert [np.dtype(e.invars[0].aval.dtype) for e in converts] == [F32, F32]
  assert [e.invars[0].aval.weak_type for e in converts] == [True, True]
  cast, tanh = jls.autocast(f)(s, t)
  d16 = lax.dot(jnp.full(8, s, F16), jnp.full(8, t, F16))
  _eq(cast, d16)
  _eq(tanh, jnp.tanh(d16))


def test_only_a_direct_conversion_of_an_integer_array_follows():
  # A count converted to float follows the activation it meets (the guide's "a bool or
  # integer array converted to float"); once it has been a float8 value it is a float
  # value of its own, and a float32 one promotes the float16 activation as torch does.
  x, w = _rand(0, (4, 8)), _rand(1, (8, 8))
  c = jnp.arange(32, dtype=jnp.int32).reshape(4, 8)  # the output's rank: not a bias
  direct = jls.autocast(lambda x, w, c: x @ w + c.astype(jnp.float32))(x, w, c)
  assert direct.dtype == F16
  _eq(direct, x.astype(F16) @ w.astype(F16) + c.astype(F16))
  via_f8 = jls.autocast(lambda x, w, c: x @ w + c.astype(jnp.float8_e4m3fn).astype(jnp.float32))(
    x, w, c
  )
  assert via_f8.dtype == jnp.float32
  c32 = c.astype(jnp.float8_e4m3fn).astype(jnp.float32)
  _eq(via_f8, (x.astype(F16) @ w.astype(F16)).astype(jnp.float32) + c32)


# -- torch's promotion categories -------------------------------------------------------


def test_a_rank0_float32_array_does_not_promote_a_dimensioned_float16_value():
  x, w = _rand(0, (4, 8)), _rand(1, (8, 8))
  s = jnp.float32(1.5)  # rank 0, strongly typed
  assert not s.weak_type
  out = jls.autocast(lambda x, w, s: (x @ w) * s)(x, w, s)
  _eq(out, _mm16(x, w) * jnp.float16(1.5))


def test_a_weakly_typed_array_promotes_nothing_but_a_strong_rank0_one_promotes_a_rank0_value():
  # A zero-dim float16 dot times a weakly typed float32 (a Python scalar carried as an
  # array; lax.mul keeps its weak type, where jnp's multiply would make it strong first)
  # stays float16, as torch's zero-dim half tensor * 2.5; times a zero-dim float32 tensor
  # it is float32, the widest of one category.
  u, v = _rand(0, (8,)), _rand(1, (8,))
  weak, strong = jnp.asarray(2.5), jnp.float32(2.5)
  assert weak.weak_type and not strong.weak_type
  f = jls.autocast(lambda u, v, s: lax.mul(jnp.dot(u, v), s))
  d16 = jnp.dot(u.astype(F16), v.astype(F16))
  _eq(f(u, v, weak), d16 * jnp.float16(2.5))
  _eq(f(u, v, strong), d16.astype(F32) * strong)


# -- check_underflow's taps ------------------------------------------------------------


def _acts(report):
  return sorted(report.looked_at()["activations"])


def test_an_integer_matmul_is_not_tapped():
  # Only the float outputs of a lower-precision primitive are half-precision activations.
  w, x = _rand(0, (8, 4)), _rand(1, (6, 8))
  counts = jnp.arange(12, dtype=jnp.int32).reshape(3, 4)

  def loss(w, batch):
    x, counts = batch
    n = counts @ counts.T  # an integer matmul: dot_general, not tapped
    return 1e-6 * jnp.sum(x @ w) + jnp.sum(n).astype(jnp.float32)

  report = check_underflow(jls.autocast(loss), w, (x, counts))
  assert _acts(report) == ["activations/dot_general#0"]
  assert int(report.nonzero["activations/dot_general#0"]) == 6 * 4


def test_an_integer_matmul_in_a_scan_gets_no_tap():
  w, x = _rand(0, (8, 8), 0.3), _rand(1, (3, 4, 8))
  c = jnp.arange(16, dtype=jnp.int32).reshape(4, 4)

  def loss(w, batch):
    xs, c = batch

    def step(carry, x):
      n = c @ c  # an integer matmul: no half-precision output
      return carry, jnp.tanh(x @ w) + jnp.sum(n).astype(jnp.float32)

    return 1e-6 * jnp.sum(lax.scan(step, 0.0, xs)[1])

  report = check_underflow(jls.autocast(loss), w, (x, c))
  # The float matmul is tapped once per iteration; the integer one has no half output.
  assert report.not_checked == {}
  assert report.looked_at()["activations"] == [
    f"activations/scan#0[{i}]/dot_general#0" for i in range(3)
  ]


def test_an_op_with_a_float_and_an_integer_output_in_a_scan_is_tapped_on_its_float_output():
  @jls.autocast_op(rule="lower")
  def scores(x, w):
    s = x @ w
    return s, jnp.argmax(s, axis=-1)

  w, x = _rand(0, (8, 8), 0.3), _rand(1, (3, 4, 8))

  def loss(w, xs):
    def step(carry, x):
      s, idx = scores(x, w)
      assert s.dtype == F32 and idx.dtype == jnp.int32  # as traced
      return carry, jnp.tanh(s) * (idx > 3).astype(jnp.float32)[:, None]

    return 1e-6 * jnp.sum(lax.scan(step, 0.0, xs)[1])

  report = check_underflow(jls.autocast(loss), w, x)
  assert report.not_checked == {}
  assert report.looked_at()["activations"] == [
    f"activations/scan#0[{i}]/scores#0" for i in range(3)
  ]
  assert all(int(report.nonzero[k]) > 0 for k in report.looked_at()["activations"])


def _user_tapped(body, tap_shape):
  """The activation names check_underflow reports for ``body(h, p, taps)``, ``h = x @ w``."""
  w, x, r = _rand(0, (8, 4)), _rand(1, (6, 8)), _rand(2, (6, 4))

  def loss(p, x, taps):
    return 1e-6 * jnp.sum(body(x @ p["w"], p, taps))

  report = check_underflow(
    jls.autocast(loss),
    {"w": w, "r": r, "v": _rand(3, (4,))},
    x,
    activations={"y": jnp.zeros(tap_shape)},
  )
  return _acts(report)


AUTO = "activations/dot_general#0"


@pytest.mark.parametrize(
  "body",
  [
    lambda h, p, taps: h + taps["y"],
    lambda h, p, taps: taps["y"] + h,  # the tap first
    lambda h, p, taps: (h + p["r"]) + taps["y"],  # a same-shape add: h's gradient
    lambda h, p, taps: (p["r"] + h) + taps["y"],
    lambda h, p, taps: taps["y"] + (p["r"] + h),
  ],
  ids=["h+tap", "tap+h", "(h+r)+tap", "(r+h)+tap", "tap+(r+h)"],
)
def test_a_users_tap_on_a_value_with_a_tapped_outputs_gradient_counts_once(body):
  assert _user_tapped(body, (6, 4)) == ["activations/y"]


def test_a_users_tap_on_a_reshaped_tapped_output_counts_once():
  # A reshape keeps the output's gradient (element for element): the automatic tap is
  # a duplicate.
  body = lambda h, p, taps: h.reshape(24) + taps["y"]
  assert _user_tapped(body, (24,)) == ["activations/y"]


def test_a_reshaped_users_tap_on_a_tapped_output_counts_once():
  # The user's tap laid out (here reshaped to the activation's shape) is still the tap.
  body = lambda h, p, taps: h + taps["y"].reshape(6, 4)
  assert _user_tapped(body, (24,)) == ["activations/y"]


def test_a_users_tap_on_a_tiled_tapped_output_is_another_activation():
  # A tiled output's gradient is the sum of its copies', not the output's: both taps stay.
  body = lambda h, p, taps: jnp.tile(h, (2, 1)) + taps["y"]
  assert _user_tapped(body, (12, 4)) == [AUTO, "activations/y"]


def test_a_users_tap_on_a_tapped_scalar_added_to_a_vector_is_another_activation():
  # lax.add broadcasts a rank-0 operand: the sum is a vector whose gradient is not the
  # scalar's (that is its sum), so the automatic tap of the dot stays.
  def body(h, p, taps):
    d = jnp.dot(h[0], p["v"])  # a tapped rank-0 output
    return lax.add(d, p["v"]) + taps["y"]

  names = _user_tapped(body, (4,))
  assert names == ["activations/dot_general#0", "activations/dot_general#1", "activations/y"]
