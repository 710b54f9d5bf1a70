"""autocast's rule of ``cond`` (``_rules/_branches.py``): branches giving float16 and
float32 promote each output to the widest; an output is a lower-precision result only
where every branch gives one; a constant of a branch becomes an operand; a branch may give
a PRNG key; ``check_underflow`` counts the ops inside a ``cond`` once.
"""

from helpers import eqn_named as _eqn
from helpers import half as _half
from helpers import not_checked as _not_checked
from helpers import rand
from helpers import scaled_by_table as _scaled
from helpers import scaled_by_table_by_hand as _scaled_by_hand
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

import jax_lossscale as jls
from jax_lossscale.diagnostics import check_underflow

F16, F32 = np.dtype(jnp.float16), np.dtype(jnp.float32)


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


def test_check_underflow_counts_the_ops_inside_a_cond_once():
  w, x = rand(0, (4, 4)), rand(1, (8, 4))

  def loss(w, x):
    h = lax.cond(x[0, 0] > 0, lambda: x @ w, lambda: (x @ w) * 2.0)
    return jnp.sum(h.astype(F32))

  assert _not_checked(check_underflow(jls.autocast(loss), w, x)) == {"cond": (1, 2)}
