"""The composite-op registry: bounded by the traces that hold a call, never evicting one.

Each call of an ``autocast_op`` under autocast is recorded for the marker equation that
stands for it, keyed weakly by that equation's jaxpr: thousands of distinct calls (new
shapes, new static arguments, hashable or not) leave nothing behind once their traces
are gone, and a trace JAX keeps (a ``jax.jit`` traced under autocast) keeps its calls,
however many other calls come after it (the registry was an LRU of 4096 calls, which
raised "registration is gone" there).

Compiling is most of the time here (tracing a call costs about a millisecond): the
distinct calls are traced 250 to an autocast function, each compiled once, at XLA's
lowest optimisation level.

Then the op itself: its arguments refused when ``autocast_op`` is called, its keyword
arguments outside autocast, the facts of its outputs (a ``"lower"`` op's result takes a
float32 bias of lower rank in the autocast dtype, as a matmul's) and its
``"float32_compute"`` rule under ``vmap`` and ``grad``.
"""

import dataclasses
import gc
import weakref

from helpers import rand
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_lossscale as jls
from jax_lossscale._autocast import _composite
from jax_lossscale._autocast import _registrations
from jax_lossscale._autocast._errors import AutocastError

F16, F32 = np.dtype(jnp.float16), np.dtype(jnp.float32)
N_CALLS = 1000  # distinct calls (input lengths) per kind of static argument
CHUNK = 250  # calls per autocast function (one trace, one compilation)
OLD_BOUND = 4096  # the LRU the registry was


class Scale:
  """An unhashable static argument (a config object)."""

  __hash__ = None  # type: ignore[assignment]

  def __init__(self, value):
    self.value = value


@dataclasses.dataclass(frozen=True)
class HashableScale:
  """A hashable static argument (weakly referenceable, as ``Scale``)."""

  value: float


@jls.autocast_op(rule="lower")
def scaled(x, scale):
  return x * scale.value


def _scale(n):  # exact in float16: 1, 1.25, ..., 2
  return 1 + (n % 5) / 4


def _expected(x, scale):
  """The op called directly with its rule's cast (the inputs to float16), in NumPy."""
  return np.asarray(x).astype(np.float16) * np.float16(scale)


def _live():
  gc.collect()
  return len(_composite._REGISTRY)


def _fast(fun):  # the value checks compile many tiny ops: XLA's cheapest compilation
  return jax.jit(fun, compiler_options={"xla_backend_optimization_level": 0})


@pytest.mark.parametrize("kind", [HashableScale, Scale])
def test_thousands_of_distinct_calls_are_each_right_and_leave_nothing_behind(kind):
  before = _live()
  xs = np.arange(N_CALLS, dtype=np.float32) / 3  # thirds: float16 rounds them
  x = jnp.asarray(xs)
  refs, after_chunk = [], []
  for start in range(1, N_CALLS + 1, CHUNK):
    lengths = range(start, start + CHUNK)
    scales = [kind(_scale(n)) for n in lengths]
    refs += [weakref.ref(s) for s in scales]

    def f(x, lengths=lengths, scales=scales):
      return [scaled(x[:n], s) for n, s in zip(lengths, scales, strict=True)]

    outs = _fast(jls.autocast(f))(x)
    for n, out in zip(lengths, outs, strict=True):
      assert out.dtype == F16 and out.shape == (n,), (n, out.dtype, out.shape)
      np.testing.assert_array_equal(np.asarray(out), _expected(xs[:n], _scale(n)), err_msg=f"{n}")
    del f, outs, scales
    after_chunk.append(_live())
  # Nothing accumulates: each chunk's CHUNK entries died with its trace.
  assert max(after_chunk) <= before, (before, after_chunk)
  # The static arguments are not kept (a hashable one was, for ever, by the token table).
  assert all(r() is None for r in refs), sum(r() is not None for r in refs)


def test_a_trace_jax_keeps_keeps_its_call_past_the_old_bound():
  # A jitted step traced under autocast is cached by JAX with the op's marker in it. It
  # holds an unhashable static argument (a new call, in the old registry, each time).
  scale = Scale(1.25)
  step = jax.jit(lambda x: scaled(x, scale))
  x = jnp.arange(6, dtype=jnp.float32) / 3
  expected = _expected(x, 1.25)
  np.testing.assert_array_equal(np.asarray(jls.autocast(step)(x)), expected)
  live = _live()
  assert live >= 1  # step's cached trace holds its call

  # More distinct calls than the old LRU held (traced only: make_jaxpr compiles nothing).
  others = [Scale(2.0) for _ in range(OLD_BOUND + 4)]
  jax.make_jaxpr(jls.autocast(lambda y: [scaled(y, s) for s in others]))(x)
  assert _live() == live  # the others died with their trace; step's call did not

  # A new autocast function traces step again: JAX's cache gives the same trace back.
  out = jls.autocast(step)(x)
  assert out.dtype == F16
  np.testing.assert_array_equal(np.asarray(out), expected)


def test_the_marker_binds_the_jaxpr_it_was_registered_for():
  # The equation of an untransformed call holds the very jaxpr its entry is keyed by
  # (jit's cache gives the call what its trace made), and the entry goes with it.
  with _registrations.tracing(jnp.float16):
    closed = jax.make_jaxpr(lambda x: scaled(x, Scale(2.0)))(jnp.ones(3))
  (eqn,) = closed.jaxpr.eqns
  assert eqn.params["name"] == "jls_op_lower_pn_i1_o1_scaled"
  assert _composite._lookup(eqn.params["jaxpr"]) is not None
  ref = weakref.ref(eqn.params["jaxpr"])
  del closed, eqn
  gc.collect()
  assert ref() is None
  assert _live() <= 1  # (step's trace above may still be alive in this process)


def test_the_marker_name_says_what_a_transformed_marker_needs():
  @jls.autocast_op(rule="float32_compute", primary=1)
  def norm(scale, x, y):  # x's position in the dynamic leaves is 0 (scale is static)
    return x / scale.value, (y.sum(), x)

  with _registrations.tracing(jnp.float16):
    closed = jax.make_jaxpr(lambda x, y: norm(Scale(2.0), x, y))(jnp.ones(3), jnp.ones(2))
  name = closed.jaxpr.eqns[0].params["name"]
  assert name == "jls_op_float32_compute_p0_i2_o3_norm"
  assert _composite._parse(name) == ("float32_compute", 0, 2, 3, "norm")
  lam = _composite._marker_name("promote", None, 1, 1, "<lambda>")
  assert _composite._parse(lam) == ("promote", None, 1, 1, "<lambda>")
  assert _composite._parse(_composite._marker_name("lower", None, 0, 2, None)).label is None


def test_a_jit_that_only_looks_like_a_marker_is_named():
  def jls_op_mine(x):
    return x * 2

  with pytest.raises(AutocastError, match="reserved"):
    jls.autocast(jax.jit(jls_op_mine))(jnp.ones(3))


def test_a_jax_that_names_the_marker_first_gets_a_marker_traced_again(monkeypatch):
  # Where a JAX does not say the name it gave the traced jit (or names it before its body
  # is traced), the marker is traced again under a jit named from the start.
  from jax._src import stages

  monkeypatch.setattr(stages.Traced, "fun_name", property(lambda self: None), raising=False)
  x = jnp.arange(4, dtype=jnp.float32) / 3
  f = jls.autocast(lambda x: scaled(x, Scale(1.5)))
  np.testing.assert_array_equal(np.asarray(f(x)), _expected(x, 1.5))
  with _registrations.tracing(jnp.float16):
    closed = jax.make_jaxpr(lambda x: scaled(x, Scale(2.0)))(x)
  (eqn,) = closed.jaxpr.eqns
  assert eqn.params["name"] == "jls_op_lower_pn_i1_o1_scaled"
  assert _composite._lookup(eqn.params["jaxpr"]) is not None


# -- the op's arguments, its outputs' facts and its rules under transformations -----------


@pytest.mark.parametrize(
  ("make", "error", "match"),
  [
    (lambda: jls.autocast_op(3), TypeError, r"fun must be callable, got int\."),
    (
      lambda: jls.autocast_op(jnp.exp, "float32_compute", primary=-1),
      ValueError,
      r"primary must be >= 0, got -1\.",
    ),
    (lambda: jls.autocast_op(rule="float32_compute", primary=-2), ValueError, "primary must be"),
  ],
  ids=["fun", "primary", "primary of the decorator"],
)
def test_autocast_op_refuses_a_bad_argument_when_called_naming_it(make, error, match):
  with pytest.raises(error, match=match):
    make()


def test_outside_autocast_the_op_gets_its_keyword_arguments():
  op = jls.autocast_op(lambda a, *, scale=1.0, shift=0.0: a * scale + shift, rule="lower")
  x = jnp.asarray([0.5, -1.5, 3.0], jnp.float16)
  out = op(x, scale=jnp.float16(4), shift=jnp.float16(1))
  assert out.dtype == F16
  np.testing.assert_array_equal(np.asarray(out), np.asarray([3.0, -5.0, 13.0], np.float16))


def _whole(key, shape):
  """float32 whole numbers in [-4, 4]: every product and sum here is exact in each dtype."""
  return jax.random.randint(jax.random.key(key), shape, -4, 5).astype(jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_a_lower_ops_output_takes_a_float32_bias_of_lower_rank_in_its_dtype(dtype):
  # A "lower" op's float outputs in the autocast dtype are lower-precision results, as a
  # matmul's: a float32 parameter of lower rank added onto one is its bias and stays in
  # the autocast dtype (as torch's linear). Its outputs of another dtype are not: a
  # float32 one takes the bias in float32, an int32 one stays int32.
  @jls.autocast_op(rule="lower")
  def op(a):
    return a * 2, jnp.sum(a.astype(jnp.float32), axis=-1), jnp.argmax(a, axis=-1)

  x, w, b, c = _whole(0, (3, 4)), _whole(1, (4, 5)), _whole(2, (5,)), _whole(3, (3,)) / 8

  def f(x, w, b, c):
    doubled, total, idx = op(x @ w)
    return doubled + b, total + c, idx

  biased, total, idx = jls.autocast(f, dtype)(x, w, b, c)
  assert (biased.dtype, total.dtype, idx.dtype) == (np.dtype(dtype), F32, np.dtype(jnp.int32))
  h = np.asarray(x) @ np.asarray(w)  # whole numbers: the same in every dtype
  np.testing.assert_array_equal(np.asarray(biased, np.float32), h * 2 + np.asarray(b))
  np.testing.assert_array_equal(np.asarray(total), h.sum(axis=-1) + np.asarray(c))
  np.testing.assert_array_equal(np.asarray(idx), h.argmax(axis=-1))


def test_a_lower_ops_output_of_the_other_half_dtype_is_not_its_result():
  # Under a bfloat16 autocast, a float16 output of a "lower" op is not a lower-precision
  # result: a float32 bias of lower rank promotes it to float32.
  op = jls.autocast_op(lambda a: (a * 2, (a * 2).astype(jnp.float16)), rule="lower")
  x, w, b = _whole(0, (3, 4)), _whole(1, (4, 5)), _whole(2, (5,)) / 8

  def f(x, w, b):
    same, other = op(x @ w)
    return same + b, other + b

  same, other = jls.autocast(f, jnp.bfloat16)(x, w, b)
  assert (same.dtype, other.dtype) == (np.dtype(jnp.bfloat16), F32)
  h = np.asarray(x) @ np.asarray(w)
  np.testing.assert_array_equal(np.asarray(other), h * 2 + np.asarray(b))
  expected = jnp.asarray(h * 2, jnp.bfloat16) + b.astype(jnp.bfloat16)  # rounded in bfloat16
  np.testing.assert_array_equal(np.asarray(same), np.asarray(expected))


def test_a_float32_compute_op_under_vmap_restores_a_primary_the_model_gives_as_it_is():
  # The primary is a float16 input of the model (autocast did not cast it) and a float32
  # parameter comes in next to it: the batched op's output takes the primary's float16,
  # as each plain call's does.
  op = jls.autocast_op(lambda a, s: (a - a.mean()) * s, rule="float32_compute")
  h, s = rand(0, (4, 6)).astype(jnp.float16), rand(1, (6,))

  def f(h, s):
    return jax.vmap(lambda r: op(r, s))(h), jnp.stack([op(r, s) for r in h])

  mapped, looped = jls.autocast(f)(h, s)
  assert mapped.dtype == looped.dtype == F16
  a = h.astype(jnp.float32)
  expected = ((a - a.mean(axis=1, keepdims=True)) * s).astype(jnp.float16)
  np.testing.assert_array_equal(np.asarray(looped), np.asarray(expected))
  np.testing.assert_array_equal(np.asarray(mapped), np.asarray(expected))


@pytest.mark.parametrize(
  "fun",
  [
    pytest.param(lambda a: jnp.tanh(a) * a, id="saves_its_primary"),
    pytest.param(jnp.sin, id="saves_only_cos"),
    pytest.param(
      lambda a: a * 2,
      id="saves_nothing",
      marks=pytest.mark.xfail(
        strict=True,
        reason="an op linear in its primary saves no residual: its backward part gets the "
        "cotangent alone (as many inputs as the op, so taken for the op's inputs), and "
        "nothing there says the primary's dtype: the gradient comes back float32",
      ),
    ),
  ],
)
def test_a_float32_compute_ops_gradient_inside_autocast_uses_its_float32_residuals(fun):
  # Differentiated inside the autocast function, the op's backward runs in float32 on the
  # float32 values its forward saved: the gradient is the float32 one, rounded once to
  # the primary's float16 (torch's gradient of an input has the input's dtype), whether
  # or not the primary itself is saved: each residual carries the primary's dtype.
  op = jls.autocast_op(fun, rule="float32_compute")
  x, w = rand(0, (16, 32)), rand(1, (32, 64))

  def f(x, w):
    h = x @ w
    return h, jax.grad(lambda h: jnp.sum(op(h)))(h)

  h, grad = jls.autocast(f)(x, w)
  assert h.dtype == grad.dtype == F16
  _, vjp = jax.vjp(fun, h.astype(jnp.float32))
  (expected,) = vjp(jnp.ones(h.shape, jnp.float32))
  np.testing.assert_array_equal(np.asarray(grad), np.asarray(expected.astype(jnp.float16)))


@pytest.mark.parametrize(
  ("fun", "primary_grad"),
  [
    pytest.param(lambda a, b: jnp.tanh(a) * a * b, F16, id="saves_its_primary"),
    # the primary's gradient stays float32 here, as for an op that saves nothing (a
    # known issue): its residuals cannot say which same-shaped gradient is whose
    pytest.param(lambda a, b: jnp.sin(a) * b, jnp.float32, id="saves_only_cos"),
  ],
)
def test_a_float32_input_shaped_like_the_primary_keeps_a_float32_gradient(fun, primary_grad):
  # torch: the gradient of an input has the input's dtype. A float32 b of the float16
  # primary's shape is not given the primary's dtype by shape.
  op = jls.autocast_op(fun, rule="float32_compute")
  x, w, b = rand(0, (16, 32)), rand(1, (32, 64)), rand(2, (16, 64))

  def f(x, w, b):
    h = x @ w
    return jax.grad(lambda h, b: jnp.sum(op(h, b)), argnums=(0, 1))(h, b)

  gh, gb = jls.autocast(f)(x, w, b)
  assert gh.dtype == primary_grad and gb.dtype == jnp.float32
  h = (x.astype(F16) @ w.astype(F16)).astype(jnp.float32)
  _, vjp = jax.vjp(fun, h, b)
  expected_b = vjp(jnp.ones(h.shape, jnp.float32))[1]
  np.testing.assert_array_equal(np.asarray(gb), np.asarray(expected_b))


@pytest.mark.parametrize("wrap", ["jit", "scan", "checkpoint"])
def test_a_float32_compute_ops_residuals_carry_the_primarys_dtype_across_a_region(wrap):
  # The residual (sin's cos) crosses from the forward part to the backward part through a
  # jit's outputs, a scan's stacked rows or a rematerialised region: the gradient of the
  # float16 primary is still float16, the float32 gradient rounded once.
  op = jls.autocast_op(jnp.sin, rule="float32_compute")
  x, w = rand(0, (16, 32)), rand(1, (32, 64))

  def loss(h):
    if wrap == "scan":
      return jax.lax.scan(lambda c, r: (c + jnp.sum(op(r)), None), jnp.float32(0), h)[0]
    region = jax.jit if wrap == "jit" else jax.checkpoint
    return region(lambda h: jnp.sum(op(h)))(h)

  h, grad = jls.autocast(lambda x, w: (x @ w, jax.grad(loss)(x @ w)))(x, w)
  assert h.dtype == grad.dtype == F16
  expected = jnp.cos(h.astype(jnp.float32)).astype(jnp.float16)
  np.testing.assert_array_equal(np.asarray(grad), np.asarray(expected))


def test_a_float32_compute_op_whose_primary_is_not_an_array_restores_nothing():
  # The primary argument is static (a Python number here): there is no dtype to restore,
  # and the outputs are the float32 computation's.
  @jls.autocast_op(rule="float32_compute", primary=1)
  def op(a, eps):
    return a / (jnp.abs(a).max() + eps)

  x, w = rand(0, (3, 4)), rand(1, (4, 5))
  out = jls.autocast(lambda x, w: op(x @ w, 0.5))(x, w)
  assert out.dtype == F32
  a = (x.astype(jnp.float16) @ w.astype(jnp.float16)).astype(jnp.float32)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(a / (jnp.abs(a).max() + 0.5)))


def test_a_float32_compute_ops_tangents_take_their_primals_dtype_under_jvp():
  op = jls.autocast_op(lambda a: (jnp.tanh(a) * a, a * 2), rule="float32_compute")
  x, w = rand(0, (3, 4)), rand(1, (4, 5))
  primals, tangents = jls.autocast(lambda x, w: jax.jvp(op, (x @ w,), (x @ w,)))(x, w)
  assert [p.dtype for p in primals] == [F16, F16]
  assert [t.dtype for t in tangents] == [F16, F16]


def test_a_promote_op_under_vmap_promotes_as_its_plain_call():
  op = jls.autocast_op(lambda a, t: a * jnp.argmax(t).astype(a.dtype), rule="promote")
  x, w, s = rand(0, (4, 3)), rand(1, (3, 5)), rand(2, (5,))

  def f(x, w, s):
    h = x @ w
    return jnp.stack([op(r, s) for r in h]), jax.vmap(lambda r: op(r, s))(h)

  looped, mapped = jls.autocast(f)(x, w, s)
  assert looped.dtype == F32  # "promote": the widest float dtype among the inputs
  assert mapped.dtype == F32


def test_a_promote_op_under_jvp_promotes_as_its_plain_call():
  # The marker under jvp holds the op's inputs then their tangents: the primals are
  # promoted together as the plain call's inputs are, and each tangent with them.
  op = jls.autocast_op(lambda a, s: jnp.tanh(a) * s, rule="promote")
  x, w, s = rand(0, (4, 3)), rand(1, (3, 5)), rand(2, (5,))

  def f(x, w, s):
    h = x @ w
    return op(h, s), jax.jvp(op, (h, s), (h, s))

  plain, (primal, tangent) = jls.autocast(f)(x, w, s)
  assert plain.dtype == primal.dtype == tangent.dtype == F32
  np.testing.assert_array_equal(np.asarray(primal), np.asarray(plain))
  h = (x.astype(jnp.float16) @ w.astype(jnp.float16)).astype(jnp.float32)
  _, expected = jax.jvp(lambda a, s: jnp.tanh(a) * s, (h, s), (h, s))
  # float32 throughout; XLA fuses the tangent's products its own way (1 ulp), where the
  # float16 tanh it replaced was 1e-3 off
  np.testing.assert_allclose(np.asarray(tangent), np.asarray(expected), rtol=4e-7, atol=0)


def test_a_promote_op_under_jvp_promotes_on_its_primals_and_a_wider_tangent_follows():
  # The primal is a float16 activation, its tangent a float32 input: the primals alone
  # choose the dtype (float16), as the plain call's inputs do, and the tangent follows.
  op = jls.autocast_op(lambda a: jnp.tanh(a) * 2, rule="promote")
  x, w, t = rand(0, (4, 3)), rand(1, (3, 5)), rand(2, (4, 5))

  def f(x, w, t):
    h = x @ w
    return op(h), jax.jvp(op, (h,), (t,))

  plain, (primal, tangent) = jls.autocast(f)(x, w, t)
  assert plain.dtype == primal.dtype == tangent.dtype == F16
  np.testing.assert_array_equal(np.asarray(primal), np.asarray(plain))
  h = x.astype(jnp.float16) @ w.astype(jnp.float16)
  _, expected = jax.jvp(lambda a: jnp.tanh(a) * 2, (h,), (t.astype(jnp.float16),))
  assert expected.dtype == F16  # computed in float16 throughout
  np.testing.assert_allclose(
    np.asarray(tangent, np.float32), np.asarray(expected, np.float32), rtol=2e-3, atol=2e-3
  )


def test_a_promote_op_under_grad_casts_the_cotangent_to_the_ops_dtype_as_torch():
  # Under grad the marker is split: its transposed part takes the residuals (float16, as
  # the op's inputs h and s) then the cotangent. As torch casts the gradient of an output
  # to the output's dtype, a float32 cotangent (the weight c) is cast to the op's float16
  # before the product, and the gradient is float16 (it was float32: the product was
  # promoted); the cotangent of a sum too.
  op = jls.autocast_op(lambda a, s: jnp.tanh(a) * s, rule="promote")
  x, w, v, c = rand(0, (4, 3)), rand(1, (3, 5)), rand(2, (3, 5)), rand(3, (4, 5))

  def f(x, w, v, c):
    h, s = x @ w, (x @ v)[0]
    weighted = jax.grad(lambda h, s: (op(h, s) * c).sum())(h, s)
    summed = jax.grad(lambda h, s: op(h, s).sum())(h, s)
    return weighted, summed

  weighted, summed = jls.autocast(f)(x, w, v, c)
  assert weighted.dtype == summed.dtype == F16
  x16 = x.astype(jnp.float16)
  h, s = x16 @ w.astype(jnp.float16), (x16 @ v.astype(jnp.float16))[0]
  d = (1 - jnp.tanh(h) ** 2) * s  # float16, as the residuals
  # Both sides round 1 - tanh(h)**2 in float16, in their own order: where tanh(h) is near 1
  # the difference cancels, and the two may differ by a few float16 ulps of the product
  # (measured: 0.2383 against 0.2408 at one element, fresh install of 2026-12-04).
  expected = d * c.astype(jnp.float16)
  np.testing.assert_allclose(
    np.asarray(weighted, np.float32), np.asarray(expected, np.float32), rtol=2e-3, atol=4e-3
  )
  np.testing.assert_allclose(
    np.asarray(summed, np.float32), np.asarray(d, np.float32), rtol=2e-3, atol=4e-3
  )


def test_a_promote_ops_backward_computes_in_the_ops_dtype_as_torch():
  # The backward part of a "promote" op computes in the op's dtype, the promotion of its
  # inputs, as its forward did: the first inputs of its transposed part (the residuals)
  # drive the promotion and the cotangents follow. A one-input op on a float16 h: its
  # gradient is float16 (the float32 cotangent of the sum is cast, as torch casts the
  # gradient of its float16 output). h times a float32 s: float32, and the gradient of s
  # is the float32 one (it was float16: the residual h drove the product alone).
  double = jls.autocast_op(lambda a: jnp.tanh(a) * 2, rule="promote")
  scale = jls.autocast_op(lambda a, s: a * s, rule="promote")
  x, w, s = _whole(0, (4, 3)), _whole(1, (3, 5)), _whole(2, (5,)) / 8

  def f(x, w, s):
    h = x @ w
    dh = jax.grad(lambda h: double(h).sum())(h)
    _, ds = jax.grad(lambda h, s: scale(h, s).sum(), argnums=(0, 1))(h, s)
    return h, dh, ds

  h, dh, ds = jls.autocast(f)(x, w, s)
  assert (h.dtype, dh.dtype, ds.dtype) == (F16, F16, F32)
  _, vjp = jax.vjp(lambda a: jnp.tanh(a) * 2, h)  # JAX's own float16 backward
  (expected,) = vjp(jnp.ones(h.shape, jnp.float16))
  np.testing.assert_allclose(
    np.asarray(dh, np.float32), np.asarray(expected, np.float32), rtol=2e-3, atol=4e-3
  )
  # h holds whole numbers (exact in float16): the column sums are exact in float32.
  np.testing.assert_array_equal(np.asarray(ds), np.asarray(h, np.float32).sum(axis=0))


def test_a_float32_compute_ops_gradient_keeps_its_one_float32_residual_shaped_like_the_primary():
  # sin saves one residual, cos(a), shaped like the primary and as many as the op's
  # outputs: it stays float32 (it is no output of the op), so the gradient is the
  # float32 one (rounded once to the gradient's dtype), not one of a float16 cos.
  op = jls.autocast_op(jnp.sin, rule="float32_compute")
  x, w = rand(0, (16, 32)), rand(1, (32, 64))

  def f(x, w):
    h = x @ w
    return h, jax.grad(lambda h: jnp.sum(op(h) * 3))(h)

  h, grad = jls.autocast(f)(x, w)
  expected = 3 * jnp.cos(h.astype(jnp.float32))
  np.testing.assert_array_equal(np.asarray(grad), np.asarray(expected.astype(grad.dtype)))


def test_a_promote_op_under_jvp_with_no_output_tangent_still_promotes_its_inputs_together():
  # floor has no derivative: the marker under jvp takes the inputs then their tangents
  # and gives no tangent out. Its inputs are still promoted together (to the float32 of
  # s), so tanh is computed in float32 as in the plain call, not on the float16 h.
  op = jls.autocast_op(lambda a, s: jnp.floor(jnp.tanh(a) * s * 1000), rule="promote")
  x, w, s = rand(0, (16, 32)), rand(1, (32, 64)), rand(2, (64,))

  def f(x, w, s):
    h = x @ w
    return op(h, s), jax.jvp(op, (h, s), (h, s))

  plain, (primal, tangent) = jls.autocast(f)(x, w, s)
  assert plain.dtype == primal.dtype == F32
  np.testing.assert_array_equal(np.asarray(primal), np.asarray(plain))
  np.testing.assert_array_equal(np.asarray(tangent), np.zeros(plain.shape, np.float32))
