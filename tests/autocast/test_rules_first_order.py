"""autocast's first-order rules (``_rules/_first_order.py``): the policy's lower / float32 /
promote rules, torch's promotion of mixed float operands, and ``add``'s bias rule (a bias
added to a matmul keeps the matmul's dtype; a second vector promotes, as torch).
"""

import functools
import itertools

from helpers import rand_dtype as _rand
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_lossscale._autocast import _values
from jax_lossscale._autocast import autocast

BF16 = np.dtype(jnp.bfloat16)
F16 = np.dtype(jnp.float16)
F32 = np.dtype(jnp.float32)


def test_float16_plus_bfloat16_promotes_to_float32():
  # bf16 @ bf16 runs in float16; adding a bfloat16 matrix (not a bias) promotes as torch
  # does: float16 with bfloat16 is float32.
  a, b, c = _rand(0, (3, 4), BF16), _rand(1, (4, 5), BF16), _rand(2, (3, 5), BF16)
  out = autocast(lambda a, b, c: a @ b + c)(a, b, c)
  assert out.dtype == F32
  ref = (a.astype(F16) @ b.astype(F16)).astype(F32) + c.astype(F32)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


def test_a_bias_added_after_a_transpose_stays_float16():
  # einsum emits a dot_general and then a transpose: the transposed float16 product is
  # still the contraction's result, and the bias added onto it keeps it float16.
  w, x, b = _rand(0, (3, 4)), _rand(1, (2, 4, 5)), _rand(2, (5,))
  f = lambda w, x, b: jnp.einsum("ij,bjk->bik", w, x) + b
  prims = {e.primitive.name for e in jax.make_jaxpr(f)(w, x, b).jaxpr.eqns}
  assert "transpose" in prims
  out = autocast(f)(w, x, b)
  assert out.dtype == F16 and out.shape == (2, 3, 5)
  ref = jnp.einsum("ij,bjk->bik", w.astype(F16), x.astype(F16)) + b.astype(F16)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


def test_subtracting_a_vector_from_a_matmul_promotes_to_float32():
  # Only an `add` is a bias: `x @ w - b` promotes as torch's sub does.
  x, w, b = _rand(0, (2, 3)), _rand(1, (3, 4)), _rand(2, (4,))
  out = autocast(lambda x, w, b: x @ w - b)(x, w, b)
  assert out.dtype == F32
  ref = (x.astype(F16) @ w.astype(F16)).astype(F32) - b
  np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


def test_a_weakly_typed_scalar_does_not_promote_a_zero_dim_float16_tensor():
  # torch: a zero-dim float16 tensor plus a Python float stays float16. The scalar reaches
  # the add as a weakly typed jit argument (lax.add keeps its weak type).
  x, w = _rand(0, (4,)), _rand(1, (4,))
  inner = jax.jit(lambda d, s: lax.add(d, s))
  f = lambda x, w: inner(jnp.dot(x, w), 2.5)
  inner_jaxpr = jax.make_jaxpr(f)(x, w).jaxpr.eqns[-1].params["jaxpr"].jaxpr
  assert [v.aval.weak_type for v in inner_jaxpr.invars] == [False, True]
  out = autocast(f)(x, w)
  assert out.dtype == F16 and out.shape == ()
  ref = jnp.dot(x.astype(F16), w.astype(F16)) + jnp.float16(2.5)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


def test_a_second_vector_added_after_the_bias_promotes_as_torch():
  # torch's linear takes one bias: F.linear(x, w, b) is float16, and adding a float32
  # positional table of lower rank to it promotes to float32. The bias-add's sum is not
  # a lower-precision result that a second bias could join.
  torch = pytest.importorskip("torch")
  x, w, b, pos = _rand(0, (2, 3, 4)), _rand(1, (4, 5)), _rand(2, (5,)), _rand(3, (3, 5))
  out = autocast(lambda x, w, b, pos: x @ w + b + pos)(x, w, b, pos)
  assert out.dtype == F32
  ref = (x.astype(F16) @ w.astype(F16) + b.astype(F16)).astype(F32) + pos
  np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
  t = lambda a: torch.from_numpy(np.array(a))
  with torch.autocast("cpu", dtype=torch.float16):
    theirs = torch.nn.functional.linear(t(x), t(w).T, t(b)) + t(pos)
  assert theirs.dtype == torch.float32


def test_float_promotion_is_torchs_for_every_pair_and_triple():
  # float16 with bfloat16 is float32 in torch; the wider dtype wins otherwise.
  torch = pytest.importorskip("torch")
  to_torch = {F16: torch.float16, BF16: torch.bfloat16, F32: torch.float32}
  from_torch = {v: k for k, v in to_torch.items()}
  for ds in itertools.product([F16, BF16, F32], repeat=3):
    theirs = functools.reduce(torch.promote_types, [to_torch[d] for d in ds])
    assert _values.torch_promote(list(ds)) == from_torch[theirs], ds
    assert (
      _values.torch_promote(list(ds[:2]))
      == from_torch[torch.promote_types(*map(to_torch.get, ds[:2]))]
    )


def test_integer_operands_of_listed_ops_are_not_cast():
  # Only float operands are cast: an integer matmul (lower-precision list) and an
  # integer cumsum (float32 list) stay exact integers, as in torch.
  a = jnp.arange(12, dtype=jnp.int32).reshape(3, 4) * 1000
  b = jnp.arange(20, dtype=jnp.int32).reshape(4, 5)
  out = autocast(lambda a, b: (a @ b, jnp.cumsum(a, axis=1)))(a, b)
  assert out[0].dtype == out[1].dtype == np.dtype(jnp.int32)
  np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(a) @ np.asarray(b))
  np.testing.assert_array_equal(np.asarray(out[1]), np.cumsum(np.asarray(a), axis=1))


def test_an_activation_of_a_matmul_plus_a_vector_promotes_as_torch():
  # tanh(x @ w) is float16 but no longer the contraction's result: a float32 vector added
  # to it is no bias, and promotes as in torch (float16 + float32, both dimensioned).
  torch = pytest.importorskip("torch")
  x, w, b = _rand(0, (2, 3)), _rand(1, (3, 4)), _rand(2, (4,))
  out = autocast(lambda x, w, b: jnp.tanh(x @ w) + b)(x, w, b)
  assert out.dtype == F32
  ref = jnp.tanh(x.astype(F16) @ w.astype(F16)).astype(F32) + b
  np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
  t = lambda a: torch.from_numpy(np.array(a))
  with torch.autocast("cpu", dtype=torch.float16):
    assert (torch.tanh(torch.nn.functional.linear(t(x), t(w).T)) + t(b)).dtype == torch.float32


def test_a_python_scalar_added_to_a_matmul_keeps_it_float16():
  # The scalar is a jaxpr literal: it promotes nothing, and is no bias either.
  x, w = _rand(0, (2, 3)), _rand(1, (3, 4))
  out = autocast(lambda x, w: x @ w + 1.5)(x, w)
  assert out.dtype == F16
  ref = x.astype(F16) @ w.astype(F16) + jnp.float16(1.5)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
