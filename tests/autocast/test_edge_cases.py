"""Edge cases of autocast's promotion and dispatch (found by mutation testing)."""

from helpers import rand_dtype as _rand
from helpers import tanh_custom_vjp
import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
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


# -- parameters of the re-built higher-order primitives -------------------------------


def _eqns(closed, name):
  out = []

  def walk(jaxpr):
    for e in jaxpr.eqns:
      if e.primitive.name == name:
        out.append(e)
      for p in e.params.values():
        for q in p if isinstance(p, (tuple, list)) else (p,):
          if hasattr(q, "eqns"):
            walk(q)
          elif hasattr(q, "jaxpr") and hasattr(q.jaxpr, "eqns"):
            walk(q.jaxpr)

  walk(closed.jaxpr)
  return out


def _inner(eqns, mark="lambda"):
  return [e for e in eqns if mark in str(e.params.get("name", mark))]


def test_a_nested_jit_keeps_inline_keep_unused_and_a_partial_in_sharding():
  mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
  s = jax.NamedSharding(mesh, P("d"))
  x = jax.device_put(_rand(0, (8, 4)), s)
  w = _rand(1, (4, 4))
  # inline=True survives staging only with a sharding; keep_unused keeps `u`.
  inline = jax.jit(
    lambda a, w: (a @ w, w), inline=True, in_shardings=(s, None), out_shardings=(s, None)
  )
  unused = jax.jit(lambda a, u: a * 2.0, keep_unused=True)
  f = lambda x, w: unused(inline(x, w)[0], w)
  with jax.set_mesh(mesh):
    ours = _inner(_eqns(jax.make_jaxpr(autocast(f))(x, w), "jit"))
    theirs = _inner(_eqns(jax.make_jaxpr(f)(x, w), "jit"))
    out = autocast(f)(x, w)
  assert len(ours) == len(theirs) == 2
  for a, b in zip(ours, theirs, strict=True):
    assert a.params["inline"] == b.params["inline"]
    assert a.params["keep_unused"] == b.params["keep_unused"]
  # jax <= 0.10 spells `inline` as a bool; jax >= 0.11 as an enum (True is JAX_LATE).
  inline_params = [str(getattr(e.params["inline"], "value", e.params["inline"])) for e in ours]
  assert inline_params in (["True", "False"], ["jax_late", "auto"]), inline_params
  assert [e.params["keep_unused"] for e in ours] == [False, True]
  assert ours[0].params["in_shardings"][0].spec == P("d")
  assert ours[0].params["out_shardings"][0].spec == P("d")
  assert out.dtype == F16
  np.testing.assert_array_equal(
    np.asarray(out), np.asarray((x.astype(F16) @ w.astype(F16)) * jnp.float16(2))
  )


def test_remat_keeps_its_policy_and_prevent_cse():
  policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
  f = lambda x, w: jnp.sum(jax.checkpoint(lambda h: jnp.tanh(h @ w), policy=policy)(x))
  g = lambda x, w: jnp.sum(jax.checkpoint(lambda h: jnp.tanh(h @ w), prevent_cse=False)(x))
  x, w = _rand(0, (3, 4)), _rand(1, (4, 4))
  name = jax.make_jaxpr(f)(x, w).jaxpr.eqns[0].primitive.name
  (a,) = _eqns(jax.make_jaxpr(autocast(f))(x, w), name)
  (b,) = _eqns(jax.make_jaxpr(autocast(g))(x, w), name)
  assert a.params["policy"] is policy and a.params["prevent_cse"] is True
  assert b.params["policy"] is None and b.params["prevent_cse"] is False


def test_scan_keeps_its_unroll():
  ws, x = _rand(0, (4, 3, 3)), _rand(1, (2, 3))
  f = lambda ws, x: lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws, unroll=2)[0]
  (eqn,) = _eqns(jax.make_jaxpr(autocast(f))(ws, x), "scan")
  assert eqn.params["unroll"] == 2
  np.testing.assert_array_equal(
    np.asarray(autocast(f)(ws, x)),
    np.asarray(
      autocast(lambda ws, x: lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0])(ws, x)
    ),
  )


def test_shard_map_keeps_its_manual_axes_and_check_vma():
  mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(AxisType.Explicit,) * 2)
  x = jax.device_put(_rand(0, (8, 4)), jax.NamedSharding(mesh, P("a")))
  w = _rand(1, (4, 4))
  # Manual over `a` only; the body's per-device result is declared replicated, which
  # only check_vma=False allows.
  body = lambda a, w: jnp.sum(a @ w, axis=0, keepdims=True)
  f = lambda x, w: jax.shard_map(
    body,
    mesh=mesh,
    in_specs=(P("a"), P()),
    out_specs=P(),
    axis_names={"a"},
    check_vma=False,
  )(x, w)
  with jax.set_mesh(mesh):
    (eqn,) = _eqns(jax.make_jaxpr(autocast(f))(x, w), "shard_map")
    (ref,) = _eqns(jax.make_jaxpr(f)(x, w), "shard_map")
    out = autocast(f)(x, w)
  manual = "newly_manual_axes" if "newly_manual_axes" in ref.params else "manual_axes"  # jax 0.9
  assert eqn.params[manual] == ref.params[manual] == frozenset({"a"})
  assert eqn.params["check_vma"] is False
  assert out.dtype == F32 and out.shape == (1, 4)  # a float16 matmul, a float32 sum
  first = jnp.sum(
    (_rand(0, (8, 4))[:2].astype(F16) @ w.astype(F16)).astype(F32), axis=0, keepdims=True
  )
  np.testing.assert_array_equal(np.asarray(out), np.asarray(first))


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
