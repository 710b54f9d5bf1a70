"""autocast's rules of the custom-derivative primitives (``_rules/_custom.py``): a
``custom_vjp``'s backward rule runs under the policy; from jax 0.11, one that returns logs
is refused.
"""

from helpers import half as _half
from helpers import rand
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_lossscale as jls

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
