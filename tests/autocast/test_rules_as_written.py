"""The as-written room (``_rules/_as_written.py``): opaque primitives run as written.

An opaque or dtype-bound primitive (here ``custom_linear_solve``) gets its operands back in the
dtypes the function was traced with and runs exactly as written.
"""

from helpers import rand as _rand
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

import jax_lossscale as jls

F16, F32 = np.dtype(jnp.float16), np.dtype(jnp.float32)

autocast = jls.autocast
W = _rand(7, (4, 4), 0.5)
XS = _rand(8, (5, 4))


def test_a_linear_solve_runs_as_written():
  def f(x, w):
    a = x.T @ x + 4 * jnp.eye(4)
    return lax.custom_linear_solve(lambda v: a @ v, w[0], lambda mv, b: b / jnp.diag(a))

  out = autocast(f)(XS, W)  # its matvec and solve run on their declared float32 inputs
  assert out.dtype == F32
  names = {
    e.primitive.name for e in jax.make_jaxpr(autocast(f))(XS, W).eqns[0].params["jaxpr"].eqns
  }
  assert "custom_linear_solve" in names
  np.testing.assert_allclose(out, jax.jit(f)(XS, W), rtol=2e-3)  # a is a float16 matmul
