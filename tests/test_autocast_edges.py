"""Edge cases of autocast's promotion and dispatch (found by mutation testing)."""

import functools
import itertools

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from jax_lossscale import _autocast
from jax_lossscale._autocast import AutocastError
from jax_lossscale._autocast import autocast

F16, BF16, F32 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)


def _rand(seed, shape, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


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


def test_a_handler_missing_a_parameter_raises_naming_it(monkeypatch):
  # A jax version whose higher-order primitive lacks a parameter the handler reads.
  def handler(interp, eqn, invals):
    return eqn.params["no_such_param"]

  monkeypatch.setitem(_autocast._HANDLERS, "cond", handler)
  f = lambda p, x: lax.cond(p, jnp.sin, jnp.cos, x)
  with pytest.raises(AutocastError, match="its parameter 'no_such_param' is missing"):
    autocast(f)(True, jnp.ones(3))


def test_shard_map_blocks_follow_the_declared_in_specs():
  # The input is not sharded: only the declared in_specs split it into per-device blocks.
  mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
  x = jnp.arange(8.0, dtype=jnp.float32)
  w = _rand(0, (1, 1))

  def f(x, w):
    body = jax.shard_map(
      lambda a, w: (a[:, None] @ w)[:, 0] * lax.axis_index("d").astype(jnp.float32),
      mesh=mesh,
      in_specs=(P("d"), P()),
      out_specs=P("d"),
    )
    return body(x, w)

  out = autocast(f)(x, w)
  assert out.dtype == F16 and out.shape == (8,)
  ref = (x.astype(F16) * w[0, 0].astype(F16)) * jnp.arange(8.0, dtype=F16)
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


@jax.custom_vjp
def _tanh_vjp(x):
  return jnp.tanh(x)


def _tanh_vjp_fwd(x):
  y = jnp.tanh(x)
  return y, y


def _tanh_vjp_bwd(y, g):
  return (g * (1 - y * y),)


_tanh_vjp.defvjp(_tanh_vjp_fwd, _tanh_vjp_bwd)


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


def test_float_promotion_is_torchs_for_every_pair_and_triple():
  # float16 with bfloat16 is float32 in torch; the wider dtype wins otherwise.
  torch = pytest.importorskip("torch")
  to_torch = {F16: torch.float16, BF16: torch.bfloat16, F32: torch.float32}
  from_torch = {v: k for k, v in to_torch.items()}
  for ds in itertools.product([F16, BF16, F32], repeat=3):
    theirs = functools.reduce(torch.promote_types, [to_torch[d] for d in ds])
    assert _autocast._promote(list(ds)) == from_torch[theirs], ds
    assert (
      _autocast._promote(list(ds[:2]))
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


def test_a_value_already_in_the_target_dtype_keeps_its_weak_type():
  # A weakly typed float32 input (a Python scalar) into a float32-list op is not
  # converted, so the result stays weakly typed as without autocast.
  f = lambda s: jnp.exp(s) * 2.0
  ours = jax.make_jaxpr(autocast(f))(1.5).out_avals[0]
  theirs = jax.make_jaxpr(f)(1.5).out_avals[0]
  assert theirs.weak_type and ours.weak_type
  assert ours.dtype == theirs.dtype == F32
