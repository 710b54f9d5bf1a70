"""The scatter room (``_rules/_scatter.py``): operand and updates promoted together.

Scatters and segment ops of a float16 matmul's output stay float16 (torch's scatter,
scatter_reduce and index ops run in their input's dtype), and a bias added to a scattered
matmul output is still part of the matmul.
"""

from helpers import assert_equal_in_dtype as _eq
from helpers import matmul16 as _mm16
from helpers import rand as _rand
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_lossscale as jls

F16, F32 = np.dtype(jnp.float16), np.dtype(jnp.float32)

X = jax.random.normal(jax.random.key(0), (2, 3))
W = jax.random.normal(jax.random.key(1), (3, 4))


def test_a_scatter_into_a_matmul_output_keeps_it_the_ops_output():
  # h.at[0].set(0.0) is h with a row of zeros: the bias added to it is still part of the
  # matmul (float16).
  x, w, b = _rand(0, (4, 8)), _rand(1, (8, 8)), _rand(2, (8,))
  out = jls.autocast(lambda x, w, b: (x @ w).at[0].set(0.0) + b)(x, w, b)
  _eq(out, _mm16(x, w).at[0].set(0.0) + b.astype(F16))


@pytest.mark.parametrize(
  "scatter",
  [
    lambda h, i: h.at[i].max(0.0),
    lambda h, i: h.at[i].min(0.0),
    lambda h, i: h.at[i].multiply(2.0),
    lambda h, i: h.at[i].subtract(1.0),
    lambda h, i: h.at[i].add(1.0),
    lambda h, i: h.at[i].set(0.0),
    lambda h, i: jax.ops.segment_max(h, jnp.array([0, 0]), num_segments=2),
    lambda h, i: jax.ops.segment_min(h, jnp.array([1, 0]), num_segments=2),
    lambda h, i: jax.ops.segment_prod(h, jnp.array([0, 0]), num_segments=2),
    lambda h, i: jax.ops.segment_sum(h, jnp.array([1, 1]), num_segments=3),
  ],
)
def test_scatters_and_segment_ops_keep_a_float16_operand_float16(scatter):
  # GNN message passing: the messages are a float16 matmul's output. torch's scatter,
  # scatter_reduce and index ops run in their input's dtype.
  i = jnp.array([1, 0], dtype=jnp.int32)
  f = lambda x, w, i: scatter(x @ w, i)
  out = jax.jit(jls.autocast(f))(X, W, i)
  assert out.dtype == F16
  h = X.astype(F16) @ W.astype(F16)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(scatter(h, i)))
