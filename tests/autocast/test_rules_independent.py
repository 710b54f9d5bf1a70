"""The independent room (``_rules/_independent.py``): each operand is its own array.

A variadic primitive whose operands are separate arrays (``sort`` of keys and values, the
collectives) binds them as they are, never promoted together.
"""

from helpers import assert_equal_in_dtype as _eq
from helpers import matmul16 as _mm16
from helpers import rand as _rand
from jax import lax
import jax.numpy as jnp
import numpy as np

import jax_lossscale as jls

F16, F32 = np.dtype(jnp.float16), np.dtype(jnp.float32)


def test_sort_keeps_each_operand_in_its_own_dtype():
  # sort is independent: its operands are separate arrays, not promoted together.
  x, w, y = _rand(0, (4, 8)), _rand(1, (8, 8)), _rand(2, (4, 8))
  keys, vals = jls.autocast(lambda x, w, y: lax.sort((x @ w, y), num_keys=1))(x, w, y)
  ref_keys, ref_vals = lax.sort((_mm16(x, w), y), num_keys=1)
  _eq(keys, ref_keys)  # float16
  _eq(vals, ref_vals)  # float32, permuted by the float16 keys
