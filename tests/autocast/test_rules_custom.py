"""autocast's rules of the custom-derivative primitives (``_rules/_custom.py``): a
``custom_vjp``'s backward rule runs under the policy; from jax 0.11, one that returns logs
is refused.
"""

from helpers import half as _half
from helpers import rand
from helpers import rand_dtype as _rand
from helpers import tanh_custom_vjp
import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import jax_lossscale as jls
from jax_lossscale._autocast import autocast

F16, F32 = np.dtype(jnp.float16), np.dtype(jnp.float32)


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


_tanh_vjp = tanh_custom_vjp()


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=str)
def test_a_custom_vjp_backward_sees_its_residuals_sharding(axis_type):
  # The backward is traced again for its residuals and cotangents with their shardings:
  # on an Explicit mesh a sharded residual traced as unsharded is a type error.
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)
  x = jax.device_put(_rand(0, (8, 4)), jax.NamedSharding(mesh, P("data")))
  w = jax.device_put(_rand(1, (4, 6)), jax.NamedSharding(mesh, P(None, "model")))
  f = lambda x, w: jnp.sum(_tanh_vjp(x @ w).astype(jnp.float32))
  with jax.set_mesh(mesh):
    g = jax.jit(jax.grad(autocast(f), argnums=1))(x, w)
    ref = jax.jit(jax.grad(lambda x, w: f(x.astype(F16), w.astype(F16)), argnums=1))(x, w)
  assert g.dtype == F32 and g.sharding.spec == P(None, "model")
  np.testing.assert_array_equal(np.asarray(g), np.asarray(ref))


# -- custom_jvp symbolic zeros -----------------------------------------------------------


@jax.custom_jvp
def _sin_cos_argmax(x):
  return jnp.sin(x), jnp.cos(x), jnp.argmax(x)


def _sin_cos_argmax_jvp(primals, tangents):
  (x,), (t,) = primals, tangents
  out = _sin_cos_argmax(x)
  zero = jax.custom_derivatives.SymbolicZero
  return out, (
    jnp.cos(x) * t,
    zero(jax.typeof(out[1]).to_tangent_aval()),
    zero(jax.typeof(out[2]).to_tangent_aval()),
  )


_sin_cos_argmax.defjvp(_sin_cos_argmax_jvp, symbolic_zeros=True)


def test_a_custom_jvp_rules_symbolic_zero_tangents_come_back_as_zeros():
  # A symbolic-zero tangent of a float output is a float zero of its dtype; that of an
  # integer output is float0; the nonzero tangent is the rule's.
  x = jnp.array([0.5, 2.0, -1.0])
  ours = jax.jvp(autocast(_sin_cos_argmax), (x,), (jnp.ones(3),))
  theirs = jax.jvp(_sin_cos_argmax, (x,), (jnp.ones(3),))
  (t0, t1, t2), (r0, r1, r2) = ours[1], theirs[1]
  np.testing.assert_array_equal(np.asarray(t0), np.asarray(r0))
  assert t1.dtype == F32 and t1.shape == (3,)
  np.testing.assert_array_equal(np.asarray(t1), np.asarray(r1))
  np.testing.assert_array_equal(np.asarray(t1), np.zeros(3, np.float32))
  assert t2.dtype == r2.dtype == jax.dtypes.float0


@jax.custom_vjp
def _times_count(x, n):
  return x * n.astype(x.dtype)


def _times_count_fwd(x, n):
  return _times_count(x, n), n


def _times_count_bwd(n, g):
  # The cotangent of an integer argument written out as float0 zeros (not None).
  return g * n.astype(g.dtype), np.zeros(np.shape(n), jax.dtypes.float0)


_times_count.defvjp(_times_count_fwd, _times_count_bwd)


def test_a_custom_vjp_backwards_float0_cotangent_for_an_integer_argument_is_dropped():
  x, w, n = _rand(0, (2, 3)), _rand(1, (3, 4)), jnp.int32(3)
  f = lambda x, w, n: jnp.sum(_times_count(x @ w, n).astype(jnp.float32))
  gw, gn = jax.grad(autocast(f), argnums=(1, 2), allow_int=True)(x, w, n)
  assert gw.dtype == F32 and gn.dtype == jax.dtypes.float0
  ref = jax.grad(lambda w: jnp.sum((x.astype(F16) @ w.astype(F16) * jnp.float16(3)).astype(F32)))(w)
  np.testing.assert_array_equal(np.asarray(gw), np.asarray(ref))
