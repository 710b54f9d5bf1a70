"""Each autocast rule through each higher-order primitive, and the interpreter's findings.

A rule is checked where it applies: in the jaxpr autocast builds, every equation of the
rule's primitive (in any sub-jaxpr) has the expected output dtype, and where the
higher-order primitive hands the value out unchanged (everything but a loop carry), the
function's output has it too.
"""

import jax
from jax import lax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import pytest

import jax_lossscale as jls
from jax_lossscale._autocast import _values

F16, F32 = np.dtype(jnp.float16), np.dtype(jnp.float32)

X = jax.random.normal(jax.random.key(0), (2, 3))
W = jax.random.normal(jax.random.key(1), (3, 4))
B = jax.random.normal(jax.random.key(2), (4,))
Y = jax.random.normal(jax.random.key(3), (2, 4))
M = Y > 0

#: rule -> (function of (x, w, b, y, m), the primitive that shows it, its dtype)
RULES = {
  "lower": (lambda x, w, b, y, m: x @ w, "dot_general", F16),
  "float32": (lambda x, w, b, y, m: jnp.exp(x @ w), "exp", F32),
  "promote": (lambda x, w, b, y, m: (x @ w) * y, "mul", F32),
  "bias": (lambda x, w, b, y, m: x @ w + b, "add", F16),
  "mask": (lambda x, w, b, y, m: jnp.where(m, x @ w, 0.0), "select_n", F16),
  "bool_mul": (lambda x, w, b, y, m: (x @ w) * m.astype(jnp.float32), "mul", F16),
  "zeros_like": (lambda x, w, b, y, m: lax.select(m, x @ w, jnp.zeros_like(y)), "select_n", F16),
}


def _custom_jvp(f):
  g = jax.custom_jvp(f)
  g.defjvp(lambda primals, tangents: (g(*primals), jnp.zeros_like(g(*primals))))
  return g


def _custom_vjp(f):
  g = jax.custom_vjp(f)
  g.defvjp(lambda *a: (f(*a), None), lambda res, ct: (None,) * 5)
  return g


def _shard_map(f):
  mesh = jax.make_mesh((1,), ("d",))
  return jax.shard_map(f, mesh=mesh, in_specs=P_REPL * 5, out_specs=jax.P(), check_vma=False)


P_REPL = (jax.P(),)


def _closed_call(f):
  """f as one `closed_call` equation (JAX has no public constructor for it)."""

  def g(*args):
    closed = jax.make_jaxpr(f)(*args)
    prim = jex.primitives.closed_call_p
    params = prim.get_bind_params({"call_jaxpr": closed})
    if isinstance(params, tuple):  # jax < 0.10
      subfuns, params = params
      return prim.bind(*subfuns, *args, **params)[0]
    return prim.bind(*args, **params)[0]

  return g


#: higher-order primitive -> (wrapper of f, whether f's value leaves it as it is)
HOPS = {
  "jit": (lambda f: jax.jit(f), True),
  "remat": (lambda f: jax.checkpoint(f), True),
  "scan": (lambda f: lambda *a: lax.scan(lambda c, _: (c, f(*a)), 0.0, None, length=2)[1][0], True),
  "while": (
    lambda f: (
      lambda *a: lax.while_loop(
        lambda c: c[0] < 1, lambda c: (c[0] + 1, f(*a).astype(jnp.float32)), (0, jnp.zeros((2, 4)))
      )[1]
    ),
    False,
  ),
  "cond": (lambda f: lambda x, *a: lax.cond(x[0, 0] > -100, f, f, x, *a), True),
  "shard_map": (_shard_map, True),
  "custom_jvp": (_custom_jvp, True),
  "custom_vjp": (_custom_vjp, True),
  "closed_call": (_closed_call, True),
}


def _eqns(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn
    for param in eqn.params.values():
      for p in param if isinstance(param, (tuple, list)) else (param,):
        if isinstance(p, jex.ClosedJaxpr):
          yield from _eqns(p.jaxpr)
        elif isinstance(p, jex.Jaxpr):
          yield from _eqns(p)


def _out_dtypes(fun, name, *args):
  closed = jax.make_jaxpr(fun)(*args)
  return [
    np.dtype(v.aval.dtype)
    for e in _eqns(closed.jaxpr)
    if e.primitive.name == name
    for v in e.outvars
  ]


@pytest.mark.parametrize("hop", list(HOPS))
@pytest.mark.parametrize("rule", list(RULES))
def test_every_rule_holds_through_every_higher_order_primitive(rule, hop):
  f, name, want = RULES[rule]
  wrap, passes_through = HOPS[hop]
  g = jls.autocast(wrap(f))
  args = (X, W, B, Y, M)
  seen = [d for d in _out_dtypes(g, name, *args) if d in (F16, F32)]
  # The rule's own equation (the op's outputs are (2, 4); the where's zero, a scalar
  # literal, is broadcast before it).
  assert want in seen, (rule, hop, seen)
  assert F32 not in seen if want == F16 else True, (rule, hop, seen)
  if passes_through:
    assert g(*args).dtype == want
  ref = wrap(f)(*args)
  np.testing.assert_allclose(
    np.asarray(g(*args), np.float32), np.asarray(ref), rtol=2e-2, atol=2e-2
  )


def test_a_rebound_jit_keeps_donation_layouts_and_compiler_options():
  inner = jax.jit(lambda x, w, b: x @ w + b, donate_argnums=(0,), keep_unused=True)
  f = lambda x, w, b: inner(x * 1.0, w, b)
  (ref,) = [e for e in jax.make_jaxpr(f)(X, W, B).eqns if e.primitive.name == "jit"]
  outer = jax.make_jaxpr(jls.autocast(f))(X, W, B).eqns[0].params["jaxpr"]
  (got,) = [e for e in outer.eqns if e.primitive.name == "jit"]
  for key in ref.params:
    if key != "jaxpr":
      assert got.params[key] == ref.params[key], key
  assert got.params["donated_invars"] == (True, False, False)


def test_a_rebound_cond_keeps_its_branches_platforms():
  f = lambda x, w: lax.platform_dependent(x @ w, cpu=jnp.sin, default=jnp.cos)
  (ref,) = [e for e in jax.make_jaxpr(f)(X, W).eqns if e.primitive.name == "cond"]
  outer = jax.make_jaxpr(jls.autocast(f))(X, W).eqns[0].params["jaxpr"]
  (got,) = [e for e in outer.eqns if e.primitive.name == "cond"]
  assert "branches_platforms" in ref.params
  assert got.params["branches_platforms"] == ref.params["branches_platforms"]
  assert jls.autocast(f)(X, W).dtype == F16  # sin of a float16 matmul


def test_the_named_scopes_of_the_model_reach_the_autocast_hlo():
  def f(x, w, b):
    with jax.named_scope("block0"):
      with jax.named_scope("mlp"):
        h = jax.nn.relu(x @ w + b)
    with jax.named_scope("head"):
      return jnp.sum(jax.checkpoint(lambda h: h * 2.0)(h))

  def names(fun):
    text = jax.jit(fun).lower(X, W, B).as_text(debug_info=True)
    return {n for n in ("block0/mlp", "head") if n in text}

  assert names(f) == {"block0/mlp", "head"}
  assert names(jls.autocast(f)) == names(f)


def test_a_python_scalar_literal_follows_and_a_float32_input_promotes():
  # The facts of each value: a constant has no dtype of its own; an input has.
  f = lambda x, w, y: ((x @ w) + 1.0, (x @ w) + jnp.full((2, 4), 3.0), (x @ w) + y)
  a, c, p = jls.autocast(f)(X, W, Y)
  assert (a.dtype, c.dtype, p.dtype) == (F16, F16, F32)


def test_facts_are_the_values_own():
  v = _values.Val(jnp.ones(2), _values.Facts(lowp=True))
  assert v.facts.lowp and v.facts.input_rank is None and not v.facts.follows


@pytest.mark.parametrize("hop", [h for h, (_, through) in HOPS.items() if through])
def test_a_bias_added_outside_a_higher_order_primitive_stays_in_the_matmuls_dtype(hop):
  # `jax.checkpoint(mm)(x, w) + b` as `mm(x, w) + b`: the lower-precision fact of the
  # matmul's output leaves the higher-order primitive with the value.
  wrap, _ = HOPS[hop]
  mm = wrap(lambda x, w, b, y, m: x @ w)
  f = lambda x, w, b, y, m: mm(x, w, b, y, m) + b
  out = jls.autocast(f)(X, W, B, Y, M)
  assert out.dtype == F16
  ref = X.astype(F16) @ W.astype(F16) + B.astype(F16)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=2e-3)


def test_log2_takes_the_rule_of_the_log_row():
  # jnp.log2 is log then a div up to jax 0.10 and the primitive log2 from jax 0.11, which
  # takes the rule of the `log` row (float32): a float16 operand is computed in float32.
  f = lambda x, w: jnp.log2(jnp.abs(x @ w))
  out = jls.autocast(f)(X, W)
  assert out.dtype == F32
  ref = jnp.log2(jnp.abs(X.astype(F16) @ W.astype(F16)).astype(F32))
  np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
  if hasattr(lax, "log2_p"):
    assert jls.autocast(lambda x: lax.log2(x))(X.astype(F16)).dtype == F32
