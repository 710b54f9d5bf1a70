"""Edge cases of autocast's promotion and dispatch (found by mutation testing)."""

from helpers import rand_dtype as _rand
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_lossscale as jls
from jax_lossscale import _autocast
from jax_lossscale._autocast import AutocastError
from jax_lossscale._autocast import _values
from jax_lossscale._autocast import autocast
from jax_lossscale._autocast._rules import _registry as registry

F16, BF16, F32 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)


def _replace_rule(monkeypatch, name, fn):
  """The registry's rule of the exported primitive ``name``, with ``fn`` as its function."""
  prim = registry.resolve(name)
  monkeypatch.setitem(registry._BY_OBJECT, prim, registry.lookup(prim)._replace(fn=fn))


def test_a_handler_missing_a_parameter_raises_naming_it(monkeypatch):
  # A jax version whose higher-order primitive lacks a parameter the handler reads.
  def handler(interp, eqn, invals):
    return _values.param(eqn, "no_such_param", "its_old_name")

  _replace_rule(monkeypatch, "cond", handler)
  f = lambda p, x: lax.cond(p, jnp.sin, jnp.cos, x)
  with pytest.raises(
    AutocastError,
    match=rf"`cond`.*its parameter 'no_such_param' or 'its_old_name' is missing in jax "
    rf"{jax.__version__}, whose parameters for it are \['branches'\]",
  ):
    autocast(f)(True, jnp.ones(3))


def test_a_key_error_inside_a_handler_is_not_taken_for_a_missing_parameter(monkeypatch):
  # Only the parameter reads turn a missing key into UnsupportedPrimitiveError: a KeyError
  # from anything else a handler does (a bug) propagates as itself.
  def handler(interp, eqn, invals):
    return {}["not_a_parameter"]

  _replace_rule(monkeypatch, "cond", handler)
  f = lambda p, x: lax.cond(p, jnp.sin, jnp.cos, x)
  with pytest.raises(KeyError, match="not_a_parameter"):
    autocast(f)(True, jnp.ones(3))


def test_a_value_already_in_the_target_dtype_keeps_its_weak_type():
  # A weakly typed float32 input (a Python scalar) into a float32-list op is not
  # converted, so the result stays weakly typed as without autocast.
  f = lambda s: jnp.exp(s) * 2.0
  ours = jax.make_jaxpr(autocast(f))(1.5).out_avals[0]
  theirs = jax.make_jaxpr(f)(1.5).out_avals[0]
  assert theirs.weak_type and ours.weak_type
  assert ours.dtype == theirs.dtype == F32


# -- the cache of jitted regions -------------------------------------------------------


class _Unhashable:
  __hash__ = None  # type: ignore[assignment]


def test_the_region_cache_keeps_the_64_newest_and_an_unhashable_call_takes_no_slot():
  # Eager calls with static arguments reuse their jitted region from a cache of 64; the
  # oldest goes first. A call whose static part is unhashable is not cached at all.
  traces = []

  def f(x, n):
    traces.append(n)
    return x * 2.0 if isinstance(n, _Unhashable) else x * n

  g = autocast(f)
  x = jnp.ones(2)
  g(x, 0)
  g(x, _Unhashable())
  for n in range(1, 64):
    g(x, n)
  assert len(traces) == 65
  g(x, 0)  # 64 cached keys (0..63): 0 is still there
  assert len(traces) == 65
  g(x, 64)  # a 65th key evicts the oldest, 0
  g(x, 1)
  assert len(traces) == 66
  out = g(x, 0)
  assert len(traces) == 67 and traces[-1] == 0
  np.testing.assert_array_equal(np.asarray(out), np.zeros(2, np.float32))


def test_keyword_arguments_reach_the_function():
  x, w = _rand(0, (2, 3)), _rand(1, (3, 4))
  out = autocast(lambda x, *, w: x @ w)(x, w=w)
  assert out.dtype == F16
  np.testing.assert_array_equal(np.asarray(out), np.asarray(x.astype(F16) @ w.astype(F16)))
  kept = _autocast.float32(lambda x, *, w: x @ w)(x, w=w)
  np.testing.assert_array_equal(np.asarray(kept), np.asarray(x @ w))


def test_autocast_spec_is_none_for_an_attribute_of_another_type():
  def f(x):
    return x

  f.autocast_spec = ("not", "a", "spec")
  assert _autocast.autocast_spec(f) is None
  spec = _autocast.autocast_spec(autocast(f))
  assert spec is not None and spec.fun is f and spec.dtype == F16


# -- dispatch and the lower-precision flags ---------------------------------------------


def test_primitives_with_declared_dtypes_get_their_operands_back_in_them():
  # A scalar reduce_precision and a host callback run on their operands cast back to the
  # declared float32. A scatter-add promotes its operand and updates as torch's
  # scatter_add does, a constant operand taking the updates' float16 (its update jaxpr
  # is traced again for float16).
  x, w = _rand(0, (2, 3)), _rand(1, (3, 4))
  i = jnp.array([0, 2], dtype=jnp.int32)
  spec = jax.ShapeDtypeStruct((2, 4), jnp.float32)

  def f(x, w, i):
    h = x @ w  # float16
    acc = jnp.zeros((3, 4), jnp.float32).at[i].add(h)
    r = lax.reduce_precision(h[0, 0].astype(jnp.float32) * 1.0, exponent_bits=5, mantissa_bits=2)
    cb = jax.pure_callback(lambda a: (np.asarray(a) * 2).astype(np.float32), spec, h)
    return acc, r, cb

  names = {e.primitive.name for e in jax.make_jaxpr(f)(x, w, i).jaxpr.eqns}
  assert {"scatter-add", "reduce_precision", "pure_callback"} <= names, names
  acc, r, cb = autocast(f)(x, w, i)
  h = (x.astype(F16) @ w.astype(F16)).astype(F32)
  assert r.dtype == cb.dtype == F32 and r.shape == () and acc.dtype == F16
  np.testing.assert_array_equal(
    np.asarray(acc), np.asarray(jnp.zeros((3, 4), F16).at[i].add(h.astype(F16)))
  )
  np.testing.assert_array_equal(
    np.asarray(r), np.asarray(lax.reduce_precision(h[0, 0], exponent_bits=5, mantissa_bits=2))
  )
  np.testing.assert_array_equal(np.asarray(cb), np.asarray(h) * 2)


def test_an_autocast_op_outside_autocast_is_the_function_itself():
  # No marker and no cast outside autocast: a float16 input stays float16 under "lower"
  # (the op is not cast to any dtype), its bits the plain function's.
  op = jls.autocast_op(lambda a: jnp.tanh(a) * 3, rule="lower")
  x = jnp.asarray([0.1, -2.0, 7.5], jnp.float16)
  assert "jit" not in str(jax.make_jaxpr(op)(x))
  out = op(x)
  assert out.dtype == jnp.float16
  np.testing.assert_array_equal(np.asarray(out), np.asarray(jnp.tanh(x) * 3))


def test_a_promote_op_of_integer_inputs_only_runs_as_written():
  op = jls.autocast_op(lambda n: n * 2 + 1, rule="promote")
  out = jls.autocast(lambda n, x: (op(n), x @ x.T))(jnp.arange(4), jnp.ones((2, 3)))
  assert out[0].dtype == jnp.arange(4).dtype
  np.testing.assert_array_equal(np.asarray(out[0]), np.arange(4) * 2 + 1)


def test_an_autocast_op_is_traced_again_on_the_dtypes_it_gets():
  # The op's Python runs again on its actual (promoted) inputs, as a torch op registered
  # for autocast sees the tensors it is given: a branch on the dtype takes the float16 one.
  op = jls.autocast_op(lambda a: a * (2 if a.dtype == jnp.float16 else 3), rule="promote")
  x, w = jnp.ones((2, 3)), jnp.ones((3, 4))
  out = jls.autocast(lambda x, w: op(x @ w))(x, w)
  assert out.dtype == jnp.float16
  np.testing.assert_array_equal(np.asarray(out), np.full((2, 4), 6.0, np.float16))


def test_a_promote_op_lets_a_converted_mask_follow_as_an_inline_product_does():
  # h * mask.astype(float32), written inline, stays float16 (a bool made float has no dtype of
  # its own, as torch's bool * half is half); the same product as a "promote" op does too,
  # called as it is and under vmap (the plain call promoted the float16 h to float32).
  op = jls.autocast_op(lambda a, m: a * m, rule="promote")
  x, w = _rand(0, (2, 3)), _rand(1, (3, 4))
  mask = jnp.asarray([[True, False, True, True], [False, True, True, False]])
  inline = jls.autocast(lambda x, w, m: (x @ w) * m.astype(jnp.float32))(x, w, mask)
  plain = jls.autocast(lambda x, w, m: op(x @ w, m.astype(jnp.float32)))(x, w, mask)
  mapped = jls.autocast(lambda x, w, m: jax.vmap(op)(x @ w, m.astype(jnp.float32)))(x, w, mask)
  assert inline.dtype == plain.dtype == mapped.dtype == jnp.float16
  np.testing.assert_array_equal(np.asarray(plain), np.asarray(inline))
  np.testing.assert_array_equal(np.asarray(mapped), np.asarray(inline))


def test_a_float32_compute_op_under_vmap_restores_its_float_outputs_only():
  # "float32_compute": the outputs shaped like the primary input come back in its dtype,
  # the float ones only (an int32 output of that shape stays int32), under vmap too; and
  # a primary input the model itself keeps in float16 is restored as well.
  op = jls.autocast_op(
    lambda a: ((a - a.mean()) * 2, (a > 0).astype(jnp.int32)), rule="float32_compute"
  )
  x, w = _rand(0, (2, 3)), _rand(1, (3, 4))
  for f in (
    lambda x, w: jax.vmap(op)(x @ w),
    lambda x, w: jax.vmap(op)((x @ w).astype(jnp.float16)),
  ):
    norm, sign = jls.autocast(f)(x, w)
    assert norm.dtype == jnp.float16 and sign.dtype == jnp.int32, (norm.dtype, sign.dtype)
    h = (x.astype(jnp.float16) @ w.astype(jnp.float16)).astype(jnp.float32)
    expected = ((h - h.mean(axis=1, keepdims=True)) * 2).astype(jnp.float16)
    np.testing.assert_array_equal(np.asarray(norm), np.asarray(expected))
    np.testing.assert_array_equal(np.asarray(sign), np.asarray(h > 0, np.int32))


def test_a_lower_op_under_vmap_casts_its_float_outputs_only():
  op = jls.autocast_op(lambda a: (a * 2, (a > 0).astype(jnp.int32)), rule="lower")
  x, w = _rand(0, (2, 3)), _rand(1, (3, 4))
  doubled, sign = jls.autocast(lambda x, w: jax.vmap(op)(x @ w))(x, w)
  assert doubled.dtype == jnp.float16 and sign.dtype == jnp.int32, (doubled.dtype, sign.dtype)
  h = x.astype(jnp.float16) @ w.astype(jnp.float16)
  np.testing.assert_array_equal(np.asarray(doubled), np.asarray(h * 2))
  np.testing.assert_array_equal(np.asarray(sign), np.asarray(h > 0, np.int32))


def test_an_equation_keeps_its_xla_metadata_and_the_casts_for_it_take_it_too():
  # The equation's context (set_xla_metadata, compute_on) is entered around its rebinding:
  # the float16 matmul and the casts of its operands carry the annotation; the tanh
  # outside the block does not.
  from jax.experimental.xla_metadata import set_xla_metadata

  def f(x, w):
    with set_xla_metadata(jls_tag="kept"):
      y = x @ w
    return jnp.tanh(y)

  x, w = jnp.ones((4, 8)), jnp.ones((8, 8))
  lines = jax.jit(jls.autocast(f)).lower(x, w).as_text().splitlines()
  tagged = {
    op
    for op in ("dot_general", "convert", "tanh")
    for ln in lines
    if f"stablehlo.{op}" in ln and 'jls_tag = "kept"' in ln
  }
  assert tagged == {"dot_general", "convert"}
