"""autocast: the policy per primitive, the layers, the higher-order primitives, overrides."""

import functools

from conftest import import_optional
from helpers import TORCH_CUDA_LAYER_DTYPES
from helpers import all_eqns
from helpers import assert_bits_equal
from helpers import rand as _rand
from helpers import tanh_custom_vjp
from helpers import transformer_layers
from helpers import transformer_params
from helpers import transformer_tokens as _tokens
import jax
from jax import lax
import jax.extend.core as jex
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import jax_lossscale as jls
from jax_lossscale._autocast import AutocastError
from jax_lossscale._autocast import UnsupportedPrimitiveError
from jax_lossscale._autocast import autocast
from jax_lossscale._autocast import float32
from jax_lossscale._autocast._policy import DEFAULT_POLICY
from jax_lossscale._autocast._policy import FLOAT32
from jax_lossscale._autocast._policy import LOWER
from jax_lossscale._autocast._policy import POLICY_TABLE
from jax_lossscale._autocast._policy import PROMOTE
from jax_lossscale._autocast._policy import autocast_policy

F16, BF16, F32 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)


# -- helpers ------------------------------------------------------------------------


def _eqns_of(fun, *args, name):
  jaxpr = jax.make_jaxpr(fun)(*args).jaxpr
  return [e for e in all_eqns(jaxpr) if e.primitive.name == name]


def _operand_dtypes(fun, *args, name):
  """The input dtypes of every ``name`` equation in ``fun``'s jaxpr (nested too)."""
  return [
    tuple(np.dtype(v.aval.dtype) for v in e.invars if hasattr(v.aval, "dtype"))
    for e in _eqns_of(fun, *args, name=name)
  ]


# -- the policy, primitive by primitive ------------------------------------------------

X = jnp.linspace(0.1, 0.9, 12, dtype=jnp.float32).reshape(3, 4)

# One function per primitive of the table, on float32 input (rule LOWER: cast down) or on
# float16 input (rule FLOAT32: cast up). Each emits the primitive it is named for.
_PRIMITIVE_FUNS = {
  "dot_general": lambda x: x @ x.T,
  "conv_general_dilated": lambda x: lax.conv(x[None, None], x[None, None, :2, :2], (1, 1), "SAME"),
  "exp": jnp.exp,
  "expm1": jnp.expm1,
  "log": jnp.log,
  "log1p": jnp.log1p,
  "pow": lambda x: lax.pow(x, x),
  "integer_pow": lambda x: x**3,
  "square": jnp.square,
  "rsqrt": lax.rsqrt,
  "acos": jnp.arccos,
  "asin": jnp.arcsin,
  "cosh": jnp.cosh,
  "sinh": jnp.sinh,
  "tan": jnp.tan,
  "erf_inv": lax.erf_inv,
  "reduce_sum": jnp.sum,
  "reduce_prod": jnp.prod,
  "cumsum": lambda x: jnp.cumsum(x, axis=1),
  "cumprod": lambda x: jnp.cumprod(x, axis=1),
  "cumlogsumexp": lambda x: lax.cumlogsumexp(x, axis=1),
  "atan2": lambda x: jnp.arctan2(x, x),
}


def test_every_table_row_is_tested_and_every_rule_is_known():
  assert autocast_policy() == POLICY_TABLE
  assert {row.primitive for row in POLICY_TABLE} == set(_PRIMITIVE_FUNS)
  assert set(DEFAULT_POLICY.values()) <= {LOWER, FLOAT32, PROMOTE}
  assert all(row.torch for row in POLICY_TABLE)


@pytest.mark.parametrize("row", POLICY_TABLE, ids=lambda r: r.primitive)
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_each_primitive_runs_in_the_dtype_of_its_list(row, dtype):
  fun = _PRIMITIVE_FUNS[row.primitive]
  dt = np.dtype(dtype)
  if row.rule == LOWER:
    x, want = X, dt  # float32 in, run in the lower dtype
  elif row.rule == FLOAT32:
    x, want = X.astype(dtype), F32  # lower dtype in, run in float32
  else:
    x, want = X.astype(dtype), dt  # one dtype in: promote keeps it
  seen = _operand_dtypes(autocast(fun, dtype=dtype), x, name=row.primitive)
  assert seen, f"{row.primitive} not emitted"
  for operands in seen:
    assert set(operands) == {want}, (row.primitive, operands)


@pytest.mark.parametrize("fun", [jnp.log2, jnp.log10], ids=["log2", "log10"])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_log2_and_log10_run_in_float32_in_every_jax_version(fun, dtype):
  # torch's fp32 list has log2 and log10. jnp.log2 is log then a div up to jax 0.10 and
  # the primitive log2 from jax 0.11 (jax_lossscale._autocast._policy.VERSIONED_ROWS).
  x = X.astype(dtype)
  names = {e.primitive.name for e in jax.make_jaxpr(fun)(x).jaxpr.eqns}
  name = "log2" if "log2" in names else "log"
  seen = _operand_dtypes(autocast(fun, dtype=dtype), x, name=name)
  assert seen and all(set(ops) == {F32} for ops in seen), (name, seen)
  np.testing.assert_allclose(
    np.asarray(autocast(fun, dtype=dtype)(x), np.float32),
    np.asarray(fun(x.astype(jnp.float32))),
    rtol=2e-3,
  )


@pytest.mark.parametrize("name", ["tanh", "logistic", "sqrt", "max", "exp2", "erf"])
def test_a_primitive_in_no_list_runs_in_its_operands_dtype(name):
  funs = {
    "tanh": jnp.tanh,
    "logistic": jax.nn.sigmoid,
    "sqrt": jnp.sqrt,
    "max": lambda x: jnp.maximum(x, x[::-1]),
    "exp2": jnp.exp2,
    "erf": lax.erf,
  }
  x16 = X.astype(jnp.float16)
  assert autocast(funs[name])(x16).dtype == F16
  assert autocast(funs[name])(X).dtype == F32  # nothing cast down


def test_integer_pow_negative_is_reciprocal_and_float32():
  (ops,) = _operand_dtypes(autocast(jnp.reciprocal), X.astype(jnp.float16), name="integer_pow")
  assert ops == (F32,)


# -- the mixed-dtype rule -------------------------------------------------------------


def test_promotion_follows_torch_categories():
  x = X
  r = jnp.float32(2.0)  # a rank-0 float32 array (not weak)

  def f(x, r, y):
    h = x @ x.T  # float16
    return h + h, h + x @ x.T.astype(jnp.float32), h * 2.0, h * r, h + y, h + jnp.ones_like(h)

  y = jnp.ones((X.shape[0], X.shape[0]))
  same, both16, weak, rank0, full32, like = autocast(f)(x, r, y)
  assert same.dtype == F16
  assert both16.dtype == F16
  assert weak.dtype == F16  # a Python scalar promotes nothing (torch: tensor * 2.0)
  assert rank0.dtype == F16  # a 0-dim tensor does not promote a dimensioned one
  assert full32.dtype == F32  # fp16 + full-size fp32 tensor -> fp32
  assert like.dtype == F16  # a constant takes the activation's dtype (torch: ones_like(h))


def test_bias_add_is_part_of_the_matmul_but_a_residual_promotes():
  x, w, b = _rand(0, (5, 4)), _rand(1, (4, 4)), _rand(2, (4,))

  def dense(x, w, b):
    return x @ w + b

  def residual(x, w):
    return x + x @ w

  assert autocast(dense)(x, w, b).dtype == F16  # torch linear(x, w, b): float16
  assert autocast(residual)(x, w).dtype == F32  # torch x + linear(x): float32
  # The bias is cast, then added in float16: the same program as by hand.
  by_hand = jax.jit(
    lambda x, w, b: x.astype(jnp.float16) @ w.astype(jnp.float16) + b.astype(jnp.float16)
  )
  assert_bits_equal(jax.jit(autocast(dense))(x, w, b), by_hand(x, w, b), dtypes=True)


def test_a_centred_activation_is_not_a_bias():
  # x - mean(x): the mean is computed from the activation, so it promotes (layer norm).
  x, w = _rand(0, (5, 4)), _rand(1, (4, 4))

  def f(x, w):
    h = x @ w
    return h - jnp.mean(h, axis=-1, keepdims=True)

  assert autocast(f)(x, w).dtype == F32


def test_flax_dense_and_conv_return_float16():
  nn = import_optional("flax.linen")
  x = _rand(0, (2, 6, 6, 3))
  for layer in (nn.Dense(5), nn.Conv(4, (3, 3))):
    params = layer.init(jax.random.key(0), x)
    out = autocast(layer.apply)(params, x)
    assert out.dtype == F16, layer
    ref = layer.apply(params, x)
    np.testing.assert_allclose(out.astype(jnp.float32), ref, rtol=2e-2, atol=2e-2)


def test_equinox_linear_under_vmap_returns_float16():
  eqx = import_optional("equinox")
  lin = eqx.nn.Linear(4, 3, key=jax.random.key(0))
  x = _rand(1, (5, 4))
  out = autocast(lambda m, x: jax.vmap(m)(x))(lin, x)
  assert out.dtype == F16


# -- layers: MLP and transformer block in plain JAX, Flax linen, Equinox -------------


def test_transformer_layer_dtypes_match_torch_cuda():
  p = transformer_params()
  tokens, labels = _tokens()
  layers = autocast(transformer_layers)(p, tokens, labels)
  assert {k: v.dtype for k, v in layers.items()} == TORCH_CUDA_LAYER_DTYPES


def test_approximate_gelu_is_one_op_in_its_inputs_dtype_as_torchs_fused_gelu():
  # jax.nn.gelu(approximate=True) is x * (1 + tanh(c * (x + 0.0447 x ** 3))) / 2: written
  # out, torch's float32 pow would make it float32. It is registered as one op, as torch's
  # fused gelu kernel, so it keeps float16; the same formula outside the registration
  # (a reference captured before autocast traces) still promotes.
  p = transformer_params()
  layers = autocast(functools.partial(transformer_layers, approximate_gelu=True))(p, *_tokens())
  assert layers["gelu"].dtype == F16
  assert layers["fc2_linear"].dtype == F16
  written_out = lambda x, w: (
    lambda h: 0.5 * h * (1 + jnp.tanh(0.79788456 * (h + 0.044715 * h**3)))
  )(x @ w)
  assert autocast(written_out)(_rand(0, (2, 3)), _rand(1, (3, 4))).dtype == F32


def test_mlp_layer_dtypes_plain_jax():
  x = _rand(0, (4, 8))
  w1, b1, w2, b2 = _rand(1, (8, 16)), _rand(2, (16,)), _rand(3, (16, 2)), _rand(4, (2,))

  def mlp(x, w1, b1, w2, b2):
    h = x @ w1 + b1
    a = jax.nn.relu(h)
    return h, a, a @ w2 + b2

  assert [o.dtype for o in autocast(mlp)(x, w1, b1, w2, b2)] == [F16, F16, F16]


class _FlaxBlock:
  """A linen transformer block built on demand (flax is optional)."""

  @staticmethod
  def make():
    nn = import_optional("flax.linen")

    class Block(nn.Module):
      d: int = 8
      heads: int = 2

      @nn.compact
      def __call__(self, x):
        h = nn.LayerNorm(name="ln1")(x)
        qkv = nn.Dense(3 * self.d, name="qkv")(h)
        q, k, v = jnp.split(qkv, 3, axis=-1)
        s = jnp.einsum("td,sd->ts", q, k) / np.sqrt(self.d)
        a = self.sow("intermediates", "softmax", jax.nn.softmax(s))
        a = jax.nn.softmax(s)
        o = nn.Dense(self.d, name="out")(a @ v)
        x = x + o
        h = nn.LayerNorm(name="ln2")(x)
        m = nn.Dense(2 * self.d, name="fc1")(h)
        m = nn.gelu(m, approximate=False)
        m = nn.Dense(self.d, name="fc2")(m)
        return x + m

    return Block()


def test_flax_linen_block_layer_dtypes():
  block = _FlaxBlock.make()
  x = _rand(0, (6, 8))
  params = block.init(jax.random.key(0), x)
  out, state = autocast(
    lambda p, x: block.apply(p, x, capture_intermediates=True, mutable=["intermediates"])
  )(params, x)
  inter = state["intermediates"]
  got = {k: v["__call__"][0].dtype for k, v in inter.items() if "__call__" in v}
  assert got == {"ln1": F32, "qkv": F16, "out": F16, "ln2": F32, "fc1": F16, "fc2": F16}
  assert inter["softmax"][0].dtype == F32
  assert out.dtype == F32  # the residual stream
  ref = block.apply(params, x)
  np.testing.assert_allclose(out, ref, rtol=0, atol=2e-2)


def test_equinox_mlp_layer_dtypes_and_gradients():
  eqx = import_optional("equinox")
  model = eqx.nn.MLP(4, 2, 8, 2, activation=jax.nn.relu, key=jax.random.key(0))
  x = _rand(1, (5, 4))

  def loss(m, x):
    y = jax.vmap(m)(x)
    return jnp.mean(jnp.square(y)), y

  (value, y), grads = eqx.filter_jit(eqx.filter_value_and_grad(autocast(loss), has_aux=True))(
    model, x
  )
  assert y.dtype == F16
  assert value.dtype == F32
  leaves = jax.tree.leaves(eqx.filter(grads, eqx.is_array))
  assert leaves and all(g.dtype == F32 for g in leaves)
  ref = eqx.filter_grad(lambda m, x: loss(m, x)[0])(model, x)
  for g, r in zip(leaves, jax.tree.leaves(eqx.filter(ref, eqx.is_array)), strict=True):
    np.testing.assert_allclose(g, r, rtol=0, atol=2e-2 * float(jnp.max(jnp.abs(r))) + 1e-3)


# -- gradients, dtypes of params, ints and bools ------------------------------------


def test_gradients_come_back_in_each_params_dtype():
  p = {"w": _rand(0, (4, 4)), "v": _rand(1, (4, 4)).astype(jnp.bfloat16), "s": jnp.float32(0.5)}
  x = _rand(2, (3, 4))

  def loss(p, x):
    h = (x @ p["w"]) @ p["v"].astype(jnp.float32)
    return jnp.sum(jnp.square(h)) * p["s"]

  grads = jax.grad(autocast(loss))(p, x)
  assert {k: g.dtype for k, g in grads.items()} == {"w": F32, "v": BF16, "s": F32}


def test_integers_and_bools_are_never_touched():
  def f(x, idx, mask, n):
    h = x @ x.T
    return h[idx], jnp.where(mask, idx, 0), n * 3, jnp.sum(mask)

  x = _rand(0, (4, 4))
  idx = jnp.array([0, 2], jnp.int32)
  mask = jnp.array([True, False])
  gathered, sel, n3, count = autocast(f)(x, idx, mask, jnp.int32(2))
  assert gathered.dtype == F16
  assert (sel.dtype, n3.dtype, count.dtype) == (np.dtype("int32"),) * 3
  args = (x, idx, mask, jnp.int32(2))

  def non_float_converts(fun):
    eqns = _eqns_of(fun, *args, name="convert_element_type")
    return sorted(
      (str(e.invars[0].aval.dtype), str(e.params["new_dtype"]))
      for e in eqns
      if not jnp.issubdtype(e.invars[0].aval.dtype, jnp.floating)
    )

  # autocast added no cast of an int or a bool: only the function's own ones remain.
  assert non_float_converts(autocast(f)) == non_float_converts(f)


def test_float32_dtype_is_the_identity_bit_for_bit():
  p = transformer_params()
  tokens, labels = _tokens()

  def loss(p):
    return transformer_layers(p, tokens, labels)["cross_entropy"]

  ref_v, ref_g = jax.jit(jax.value_and_grad(loss))(p)
  v, g = jax.jit(jax.value_and_grad(autocast(loss, dtype=jnp.float32)))(p)
  assert_bits_equal((v, g), (ref_v, ref_g), dtypes=True)
  layers = autocast(transformer_layers, dtype=jnp.float32)(p, tokens, labels)
  assert_bits_equal(layers, jax.jit(transformer_layers)(p, tokens, labels), dtypes=True)
  # No cast added: the only converts are the function's own.
  n_own = len(_eqns_of(loss, p, name="convert_element_type"))
  assert len(_eqns_of(autocast(loss, dtype=jnp.float32), p, name="convert_element_type")) == n_own


def test_bfloat16_works_like_float16():
  p = transformer_params()
  layers = autocast(transformer_layers, dtype=jnp.bfloat16)(p, *_tokens())
  want = {k: (BF16 if v == F16 else v) for k, v in TORCH_CUDA_LAYER_DTYPES.items()}
  assert {k: v.dtype for k, v in layers.items()} == want


def test_autocast_is_bit_identical_to_the_same_casts_by_hand():
  x, w1, b1, w2 = _rand(0, (4, 8)), _rand(1, (8, 16)), _rand(2, (16,)), _rand(3, (16, 8))

  def model(x, w1, b1, w2):
    h = jax.nn.relu(x @ w1 + b1)
    return jax.nn.softmax(h @ w2)

  def by_hand(x, w1, b1, w2):
    f16 = jnp.float16
    h = jax.nn.relu(x.astype(f16) @ w1.astype(f16) + b1.astype(f16))
    z = h @ w2.astype(f16)
    z = z - lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
    e = jnp.exp(z.astype(jnp.float32))
    return e / jnp.sum(e, axis=-1, keepdims=True)

  got = jax.jit(autocast(model))(x, w1, b1, w2)
  want = jax.jit(by_hand)(x, w1, b1, w2)
  assert got.dtype == want.dtype == F32
  assert_bits_equal(got, want, dtypes=True)


# -- jit, vmap, recompilation -------------------------------------------------------


def test_jit_traces_once_and_does_not_recompile():
  traces = []

  def f(x, w):
    traces.append(1)
    return jnp.sum(jnp.exp(x @ w))

  g = jax.jit(autocast(f))
  x, w = _rand(0, (3, 4)), _rand(1, (4, 4))
  a = g(x, w)
  b = g(x + 1, w)
  assert len(traces) == 1
  assert g._cache_size() == 1
  assert a.dtype == b.dtype == F32


def test_eager_second_call_reuses_the_compiled_region():
  traces = []

  def f(x):
    traces.append(1)
    return x @ x

  g = autocast(f)
  x = _rand(0, (3, 3))
  g(x)
  g(x * 2)
  assert len(traces) == 1


@pytest.mark.parametrize("region", ["autocast", "float32"])
def test_a_region_called_eagerly_keeps_at_most_64_static_configurations(region):
  # Each distinct static argument is a region of its own; the 64 newest are kept, so the
  # oldest is traced again after 64 others, and the newest is not.
  traces = []

  def f(x, name):
    traces.append(name)
    return x @ x

  g = jls.autocast(f) if region == "autocast" else jls.float32(f)
  x = _rand(0, (3, 3))
  for i in range(65):
    g(x, f"k{i}")
  assert len(traces) == 65
  g(x, "k64")
  assert len(traces) == 65
  g(x, "k0")
  assert traces[-1] == "k0" and len(traces) == 66


def test_a_static_argument_that_cannot_be_hashed_takes_no_slot_of_the_64():
  class Unhashable:
    __hash__ = None

  traces = []

  def f(x, name):
    traces.append(name)
    return x @ x

  g = jls.autocast(f)
  x = _rand(0, (3, 3))
  for i in range(63):
    g(x, f"k{i}")
  g(x, Unhashable())  # traced each time, kept nowhere
  g(x, "k63")  # the 64th kept: nothing evicted
  assert len(traces) == 65
  g(x, "k0")
  assert len(traces) == 65


@pytest.mark.parametrize("region", ["autocast", "float32"])
def test_a_region_passes_keyword_arguments(region):
  def f(x, *, w, scale):
    return (x @ w) * scale

  x, w = _rand(0, (3, 4)), _rand(1, (4, 4))
  g = jls.autocast(f) if region == "autocast" else jls.float32(f)
  got = g(x, w=w, scale=2.0)
  if region == "autocast":
    want = (x.astype(F16) @ w.astype(F16)) * 2.0
  else:
    want = (x @ w) * 2.0
  assert_bits_equal(got, want, dtypes=True)


def test_a_registered_function_given_as_an_argument_calls_its_registration():
  # An activation held by a module (equinox.nn.MLP(activation=jax.nn.gelu)) is the
  # function as written, not the attribute autocast installs: it is mapped to its
  # registration, so it runs as one float16 op, as written inline.
  x, w = _rand(0, (4, 8)), _rand(1, (8, 8))
  held = jls.autocast(lambda x, w, act: act(x @ w))(x, w, jax.nn.gelu)
  inline = jls.autocast(lambda x, w: jax.nn.gelu(x @ w))(x, w)
  assert held.dtype == F16
  assert_bits_equal(held, inline, dtypes=True)


def test_vmap_of_autocast_and_autocast_of_vmap_agree():
  x, w = _rand(0, (5, 3, 4)), _rand(1, (4, 4))

  def f(x, w):
    return jax.nn.softmax(x @ w), x @ w

  a = jax.vmap(autocast(f), in_axes=(0, None))(x, w)
  b = autocast(jax.vmap(f, in_axes=(0, None)))(x, w)
  assert [t.dtype for t in a] == [t.dtype for t in b] == [F32, F16]
  assert_bits_equal(jax.jit(lambda: a)(), b, dtypes=True)


# -- higher-order primitives ------------------------------------------------------------

W = _rand(7, (4, 4), 0.5)
XS = _rand(8, (5, 4))


def _hop_funs():
  def scan(x, w):
    def body(c, xi):
      return jnp.tanh(c @ w), jnp.sum(c @ w) * xi

    c, ys = lax.scan(body, x[0], x)
    return jnp.sum(c) + jnp.sum(ys)

  def while_(x, w):
    def body(c):
      i, h = c
      return i + 1, jnp.tanh(h @ w)

    return jnp.sum(lax.while_loop(lambda c: c[0] < 3, body, (0, x))[1])

  def fori(x, w):
    return jnp.sum(lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ w), x))

  def cond(x, w):
    return jnp.sum(lax.cond(jnp.sum(x) > 0, lambda h: h @ w, lambda h: jnp.tanh(h @ w), x))

  def remat(x, w):
    return jnp.sum(jax.checkpoint(lambda h: jnp.tanh(h @ w))(x))

  def jit(x, w):
    return jnp.sum(jax.jit(lambda h, w: jnp.tanh(h @ w))(x, w))

  def custom_jvp(x, w):
    return jnp.sum(jax.nn.relu(x @ w))

  def custom_vjp(x, w):
    return jnp.sum(_user_vjp(x @ w))

  return {
    "scan": scan,
    "while": while_,
    "fori": fori,
    "cond": cond,
    "remat": remat,
    "jit": jit,
    "custom_jvp": custom_jvp,
    "custom_vjp": custom_vjp,
  }


_BWD_CALLS: list = []
_user_vjp = tanh_custom_vjp(_BWD_CALLS)


@pytest.mark.parametrize("name", list(_hop_funs()))
def test_higher_order_bodies_are_cast_and_gradients_are_right(name):
  fun = _hop_funs()[name]
  dots = _operand_dtypes(autocast(fun), XS, W, name="dot_general")
  assert dots and all(set(d) == {F16} for d in dots), dots
  if name == "while":  # reverse mode does not go through while_loop: forward mode
    v, t = jax.jit(lambda w: jax.jvp(lambda w: autocast(fun)(XS, w), (w,), (W,)))(W)
    rv, rt = jax.jvp(lambda w: fun(XS, w), (W,), (W,))
    assert (v.dtype, t.dtype) == (F32, F32)
    np.testing.assert_allclose(v, rv, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(t, rt, rtol=2e-2, atol=2e-2)
    return
  v, g = jax.jit(jax.value_and_grad(autocast(fun), argnums=(0, 1)))(XS, W)
  assert v.dtype == F32
  assert [t.dtype for t in g] == [F32, F32]
  rv, rg = jax.value_and_grad(fun, argnums=(0, 1))(XS, W)
  np.testing.assert_allclose(v, rv, rtol=1e-2, atol=1e-2)
  for a, b in zip(g, rg, strict=True):
    np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2)


def test_loop_carries_keep_their_declared_dtypes():
  def f(x, w):
    return lax.scan(lambda c, _: (c @ w, c @ w), x, None, length=3)

  carry, ys = autocast(f)(XS, W)
  assert carry.dtype == F32  # declared float32
  assert ys.dtype == F16  # a per-step output is whatever the body makes
  (scan,) = _eqns_of(autocast(f), XS, W, name="scan")
  body = scan.params["jaxpr"].jaxpr
  assert np.dtype(body.invars[-1].aval.dtype) == F32
  assert np.dtype(body.outvars[0].aval.dtype) == F32


def test_relu_gradient_at_zero_stays_zero():
  # relu's custom_jvp rule gives 0 at 0; differentiating max(x, 0) inlined would give 0.5.
  x = jnp.array([-1.0, 0.0, 2.0])
  g = jax.grad(autocast(lambda x: jnp.sum(jax.nn.relu(x * x.astype(jnp.float32)))))(x)
  np.testing.assert_array_equal(g, jax.grad(lambda x: jnp.sum(jax.nn.relu(x * x)))(x))
  gz = jax.grad(autocast(lambda x, w: jnp.sum(jax.nn.relu(x @ w))))(jnp.zeros((2, 2)), W[:2, :2])
  np.testing.assert_array_equal(gz, np.zeros((2, 2)))
  (jvp,) = _eqns_of(autocast(jax.nn.relu), jnp.zeros(3), name="custom_jvp_call")
  assert jvp  # the rule survives as a custom_jvp


def test_a_users_custom_vjp_backward_runs_under_the_policy():
  _BWD_CALLS.clear()
  fun = _hop_funs()["custom_vjp"]
  jaxpr = jax.make_jaxpr(jax.grad(autocast(fun), argnums=1))(XS, W)
  assert len(_BWD_CALLS) == 1
  assert any(
    e.primitive.name == "custom_vjp_call"
    for e in all_eqns(jax.make_jaxpr(autocast(fun))(XS, W).jaxpr)
  )
  # The backward multiplies float16 cotangents with float16 residuals: no float32 mul.
  muls = [e for e in all_eqns(jaxpr.jaxpr) if e.primitive.name == "mul"]
  assert muls and all(np.dtype(e.outvars[0].aval.dtype) == F16 for e in muls)
  g = jax.grad(autocast(fun), argnums=1)(XS, W)
  np.testing.assert_allclose(g, jax.grad(fun, argnums=1)(XS, W), rtol=2e-2, atol=2e-2)


def test_custom_vjp_with_integer_argument_returns_no_cotangent_for_it():
  @jax.custom_vjp
  def scaled(x, n):
    return x * n.astype(jnp.float32)

  scaled.defvjp(lambda x, n: (scaled(x, n), n), lambda n, g: (g * n.astype(g.dtype), None))
  g = jax.grad(autocast(lambda x, w: jnp.sum(scaled(x @ w, jnp.int32(3)))), argnums=1)(XS, W)
  np.testing.assert_allclose(g, jax.grad(lambda w: 3 * jnp.sum(XS @ w))(W), rtol=2e-2)


def test_shard_map_body_is_cast_and_sharding_kept():
  mesh = jax.make_mesh((8,), ("d",))
  x = jax.device_put(_rand(0, (8, 4)), NamedSharding(mesh, P("d")))

  def f(x, w):
    body = jax.shard_map(
      lambda a, w: lax.psum(jnp.sum(a @ w, axis=0), "d"),
      mesh=mesh,
      in_specs=(P("d"), P()),
      out_specs=P(),
    )
    return body(x, w)

  dots = _operand_dtypes(autocast(f), x, W, name="dot_general")
  assert dots == [(F16, F16)]
  out = jax.jit(autocast(f))(x, W)
  np.testing.assert_allclose(out, f(x, W), rtol=1e-2, atol=1e-2)
  with jax.set_mesh(mesh):
    g = jax.grad(lambda w: jnp.sum(autocast(f)(x, w)))(W)
    ref = jax.grad(lambda w: jnp.sum(f(x, w)))(W)
  assert g.dtype == F32
  np.testing.assert_allclose(g, ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=str)
def test_sharded_arrays_keep_their_sharding(axis_type):
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)
  x = jax.device_put(_rand(0, (8, 4)), NamedSharding(mesh, P("data")))
  w = jax.device_put(_rand(1, (4, 6)), NamedSharding(mesh, P(None, "model")))
  b = jax.device_put(_rand(2, (6,)), NamedSharding(mesh, P("model")))

  def f(x, w, b):
    return jnp.sum(jax.nn.softmax(x @ w + b)), x @ w + b

  with jax.set_mesh(mesh):
    (loss, h), g = jax.jit(jax.value_and_grad(autocast(f), argnums=(1, 2), has_aux=True))(x, w, b)
  assert h.dtype == F16 and loss.dtype == F32
  assert h.sharding.spec == P("data", "model")
  assert g[0].sharding.spec == P(None, "model")
  assert (g[0].dtype, g[1].dtype) == (F32, F32)
  np.testing.assert_allclose(h.astype(jnp.float32), x @ w + b, rtol=1e-2, atol=1e-2)


def test_flax_scan_remat_and_nnx_scan_bodies_are_cast():
  nn = import_optional("flax.linen")
  nnx = import_optional("flax.nnx")

  class Cell(nn.Module):
    @nn.compact
    def __call__(self, c, x):
      h = nn.Dense(4)(c) + x
      return jnp.tanh(h), h

  scanned = nn.scan(
    nn.remat(Cell), variable_broadcast="params", split_rngs={"params": False}, length=5
  )()
  x = _rand(0, (5, 4))
  params = scanned.init(jax.random.key(0), x[0], x)
  dots = _operand_dtypes(autocast(scanned.apply), params, x[0], x, name="dot_general")
  assert dots and all(d == (F16, F16) for d in dots)
  prims = {
    e.primitive.name
    for e in all_eqns(jax.make_jaxpr(autocast(scanned.apply))(params, x[0], x).jaxpr)
  }
  assert {"scan", "remat2"} <= prims or {"scan", "checkpoint"} <= prims

  class Stack(nnx.Module):
    def __init__(self, rngs):
      @nnx.split_rngs(splits=3)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def make(rngs):
        return nnx.Linear(4, 4, rngs=rngs)

      self.layers = make(rngs)

    def __call__(self, x):
      @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
      def step(h, layer):
        return jnp.tanh(layer(h))

      return step(x, self.layers)

  model = Stack(nnx.Rngs(0))
  graphdef, state = nnx.split(model)

  def apply(state, x):
    return nnx.merge(graphdef, state)(x)

  dots = _operand_dtypes(autocast(apply), state, x, name="dot_general")
  assert dots and all(d == (F16, F16) for d in dots)
  np.testing.assert_allclose(autocast(apply)(state, x), apply(state, x), atol=2e-2)


# -- overrides ----------------------------------------------------------------------


def test_float32_region_stays_float32_inside_jit_and_scan():
  def f(x, w):
    kept = float32(lambda a, b: a @ b)(x, w)

    def body(c, _):
      return float32(lambda c: jnp.tanh(c @ w))(c), c @ w

    c, ys = lax.scan(body, x, None, length=2)
    return kept, c, ys

  kept, c, ys = jax.jit(autocast(f))(XS, W)
  assert (kept.dtype, c.dtype, ys.dtype) == (F32, F32, F16)
  dots = _operand_dtypes(autocast(f), XS, W, name="dot_general")
  assert sorted(dots) == sorted([(F32, F32), (F32, F32), (F16, F16)])
  np.testing.assert_array_equal(kept, XS @ W)


def test_float32_region_casts_float16_inputs_back():
  def f(x, w):
    h = x @ w  # float16
    return float32(jnp.exp)(h), jnp.exp(h)

  a, b = autocast(f)(XS, W)
  assert a.dtype == b.dtype == F32
  assert float32(jnp.exp)(XS).dtype == F32  # outside autocast: just the function


def test_policy_forces_a_primitive_into_either_list():
  x = XS
  (ops,) = _operand_dtypes(
    autocast(lambda x: x @ x.T, policy={"dot_general": FLOAT32}), x, name="dot_general"
  )
  assert ops == (F32, F32)
  (ops,) = _operand_dtypes(autocast(jnp.exp, policy={lax.exp_p: LOWER}), x, name="exp")
  assert ops == (F16,)
  (ops,) = _operand_dtypes(autocast(jnp.tanh, policy={"tanh": LOWER}), x, name="tanh")
  assert ops == (F16,)
  (ops,) = _operand_dtypes(
    autocast(jnp.exp, policy={"exp": PROMOTE}), x.astype(jnp.float16), name="exp"
  )
  assert ops == (F16,)


def test_nested_autocast_keeps_the_inner_policy():
  def f(x, w):
    return autocast(lambda a, b: a @ b, dtype=jnp.bfloat16)(x, w), x @ w

  inner, outer = autocast(f)(XS, W)
  assert (inner.dtype, outer.dtype) == (BF16, F16)


# -- errors ----------------------------------------------------------------------------


def test_unknown_higher_order_primitive_raises_naming_it_and_the_fix():
  # A higher-order primitive the kind table does not know (a new JAX primitive).
  hop = jex.Primitive("my_new_hop")
  hop.def_impl(lambda x, *, jaxpr: jex.jaxpr_as_fun(jaxpr)(x)[0])
  hop.def_abstract_eval(lambda x, *, jaxpr: x)
  inner = jax.make_jaxpr(jnp.sin)(jnp.ones(4))

  def f(x):
    return hop.bind(x @ x.T, jaxpr=inner)

  with pytest.raises(UnsupportedPrimitiveError, match=r"`my_new_hop` \(at .*test_api_autocast\.py"):
    autocast(f)(XS)
  with pytest.raises(AutocastError, match=r"jax_lossscale\.float32"):
    autocast(f)(XS)


@pytest.mark.parametrize(
  ("kwargs", "error", "match"),
  [
    ({"fun": 3}, TypeError, "fun must be callable"),
    ({"dtype": jnp.int32}, ValueError, "dtype must be float16, bfloat16 or float32"),
    ({"dtype": jnp.float64}, ValueError, "dtype must be"),
    ({"dtype": "not a dtype"}, TypeError, "dtype must be a float dtype"),
    ({"policy": ["exp"]}, TypeError, "policy must be a mapping"),
    ({"policy": {"exp": "half"}}, ValueError, r"policy\['exp'\] must be one of"),
    ({"policy": {3: "lower"}}, TypeError, "policy keys"),
  ],
)
def test_bad_arguments_are_refused_eagerly(kwargs, error, match):
  args = {"fun": jnp.exp, **kwargs}
  with pytest.raises(error, match=match):
    autocast(**args)


def test_float32_refuses_a_non_callable():
  with pytest.raises(TypeError, match="fun must be callable"):
    float32("exp")


# -- the AMP step ------------------------------------------------------------------


def test_amp_step_with_dynamic_loss_scale():
  p = transformer_params()
  tokens, labels = _tokens()
  tx = jls.dynamic_loss_scale(optax.sgd(0.1), init_scale=2.0**10)
  opt_state = tx.init(p)

  def loss_fn(p, tokens, labels):
    return transformer_layers(p, tokens, labels)["cross_entropy"]

  @jax.jit
  def step(p, opt_state):
    def scaled(p):
      loss = autocast(loss_fn)(p, tokens, labels)
      return jls.scale_loss(loss, opt_state), loss

    grads, loss = jax.grad(scaled, has_aux=True)(p)
    updates, opt_state = tx.update(grads, opt_state, p)
    return optax.apply_updates(p, updates), opt_state, loss, grads

  new_p, new_state, loss, grads = step(p, opt_state)
  assert loss.dtype == F32
  assert all(g.dtype == F32 for g in jax.tree.leaves(grads))
  ref = jax.grad(loss_fn)(p, tokens, labels)
  for k in p:
    # The gradients are the scaled ones: 2**10 times the float32 gradient, to float16.
    np.testing.assert_allclose(grads[k] / 2.0**10, ref[k], rtol=5e-2, atol=5e-3)
    assert new_p[k].dtype == F32
  assert int(jls.get_scale_state(new_state).scale) == 2**10
  # The backward runs in float16: the cotangent of each float16 matmul is float16.
  jaxpr = jax.make_jaxpr(jax.grad(lambda p: autocast(loss_fn)(p, tokens, labels)))(p)
  dots = [e for e in all_eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
  assert len(dots) >= 15 and all(np.dtype(e.outvars[0].aval.dtype) == F16 for e in dots)


# -- the guide ----------------------------------------------------------------------

GUIDE = __import__("pathlib").Path(__file__).resolve().parents[2] / "docs/guides/autocast.md"


def _guide_blocks():
  import re

  return re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)


@pytest.mark.parametrize("index", range(len(_guide_blocks())))
def test_the_guides_python_blocks_run(index):
  exec(compile(_guide_blocks()[index], f"{GUIDE.name}[{index}]", "exec"), {})


def test_a_custom_jvp_rule_closing_over_an_intermediate_is_refused_clearly():
  # jax itself fails on grad(jit(g)) here ("No constant handler" for a tracer).
  def g(x, w):
    h = x @ w
    f = jax.custom_jvp(lambda y: jnp.sin(y) * h)
    f.defjvp(lambda p, t: (f(p[0]), jnp.cos(p[0]) * h * t[0]))
    return jnp.sum(f(x @ w))

  assert autocast(g)(XS, W).dtype == F32  # the forward pass works
  with pytest.raises(AutocastError, match="closes over a traced intermediate"):
    jax.grad(autocast(g), argnums=1)(XS, W)


def test_autocast_example_equinox_trains():
  import pathlib
  import runpy
  import sys

  path = pathlib.Path(__file__).resolve().parents[2] / "examples/autocast_equinox.py"
  module = runpy.run_path(str(path))
  argv = sys.argv
  try:
    assert module["main"](["--smoke", "--steps", "30"]) == 0
  finally:
    sys.argv = argv


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=str)
def test_a_nested_jit_keeps_its_in_and_out_shardings(axis_type):
  if axis_type == AxisType.Explicit and jax.__version_info__ < (0, 10):
    # Not autocast's limit: plain jax.grad of f raises the same ShardingTypeError there.
    pytest.skip("jax < 0.10 cannot differentiate a sharded contraction under an Explicit mesh")
  mesh = jax.make_mesh((8,), ("d",), axis_types=(axis_type,))
  s = NamedSharding(mesh, P("d"))
  x = jax.device_put(_rand(0, (8, 4)), s)
  inner = jax.jit(lambda a, w: a @ w, in_shardings=(s, None), out_shardings=s)

  def f(x, w):
    return inner(x, w) + 1.0

  with jax.set_mesh(mesh):
    out = jax.jit(autocast(f))(x, W)
    g = jax.grad(lambda w: jnp.sum(autocast(f)(x, w).astype(jnp.float32)))(W)
    ref = f(x, W)
  assert out.dtype == F16 and out.sharding.spec[0] == "d"
  (jit_eqn,) = [
    e for e in _eqns_of(autocast(f), x, W, name="jit") if "lambda" in str(e.params["name"])
  ]
  assert jit_eqn.params["out_shardings"][0].spec[0] == "d"
  assert g.dtype == F32
  np.testing.assert_allclose(out.astype(jnp.float32), ref, rtol=1e-2, atol=1e-2)


def test_softmax_as_a_custom_jvp_gives_the_same_layers():
  # jax_softmax_custom_jvp makes jax.nn.softmax a custom_jvp (the future default).
  p = transformer_params()
  tokens, labels = _tokens()
  old = jax.config.jax_softmax_custom_jvp
  jax.config.update("jax_softmax_custom_jvp", True)
  try:
    assert _eqns_of(jax.nn.softmax, jnp.ones(3), name="custom_jvp_call")
    layers = autocast(transformer_layers)(p, tokens, labels)
    g = jax.grad(lambda p: autocast(transformer_layers)(p, tokens, labels)["cross_entropy"])(p)
    ref = jax.grad(lambda p: transformer_layers(p, tokens, labels)["cross_entropy"])(p)
  finally:
    jax.config.update("jax_softmax_custom_jvp", old)
  assert {k: v.dtype for k, v in layers.items()} == TORCH_CUDA_LAYER_DTYPES
  for k in p:
    np.testing.assert_allclose(g[k], ref[k], rtol=0, atol=5e-3)


def test_static_arguments_are_held_static_and_told_apart():
  def f(x, n, flag, act):
    h = act(x @ x) * n
    return h if flag is True else -h

  x = _rand(0, (3, 3))
  g = autocast(f)
  a = g(x, 2.0, True, jnp.tanh)
  b = g(x, 2.0, 1, jnp.tanh)  # True == 1 and hash(True) == hash(1): not the same call
  np.testing.assert_array_equal(a, -b)
  assert a.dtype == F16
  np.testing.assert_array_equal(
    g(x, 2.0, True, jax.nn.relu), autocast(f)(x, 2.0, True, jax.nn.relu)
  )


def test_trace_cost_example_runs_and_its_hand_cast_model_agrees(capsys):
  import pathlib
  import runpy

  path = pathlib.Path(__file__).resolve().parents[2] / "examples/autocast_trace_cost.py"
  module = runpy.run_path(str(path))
  module["main"](["--smoke"])
  out = capsys.readouterr().out
  assert "ratio" in out and "autocast / by hand" in out
  # The two float16 programs compute the same loss to float16 accuracy.
  params = module["init"](jax.random.key(0), 2, 32, 256)
  tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, 256)
  a = jax.jit(autocast(module["loss_fn"]))(params, tokens)
  b = jax.jit(module["loss_by_hand"])(params, tokens)
  np.testing.assert_allclose(a, b, rtol=1e-3)
