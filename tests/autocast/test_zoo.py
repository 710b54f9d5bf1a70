"""autocast layer zoo: the standard layers of Flax linen, Flax NNX and Equinox, and the
plain-JAX patterns models are built of, against ``torch.autocast("cuda", torch.float16)``.

Each case is a float32 model ``fn(params, *inputs)`` returning a dict of named outputs
(for a cell, each carry; for a batch norm, the updated statistics). Under
``jls.autocast(fn, jnp.float16)``:

1. every output has the dtype :data:`TORCH_CUDA_ZOO` gives, the dtype the equivalent torch
   code returns under CUDA autocast (unless :data:`DEVIATIONS` names it: a difference the
   guide states);
2. the gradients w.r.t. the params, taken through the autocast function, are float32 (the
   params' dtype), finite, and not all zero;
3. the values are close to the float32 run of ``fn`` (see :data:`TOL`).

The reference is torch's CUDA policy: the lists of ``aten/src/ATen/autocast_mode.h`` of
torch 2.13, read from the installed torch (``AT_FORALL_LOWER_PRECISION_FP``, ``AT_FORALL_FP32``,
``AT_FORALL_FP32_SET_OPT_DTYPE``, ``AT_FORALL_PROMOTE``; an op in none of them runs in its
inputs' dtype). torch's CPU autocast list is not the CUDA one (on CPU softmax, layer_norm and
exp stay float16, lstm_cell promotes its float32 carry), so each torch equivalent runs on
CPU with the CUDA policy emulated op by op (:func:`_cuda`: an op's floating tensor inputs are
cast as the header's list for that op says, then the real torch kernel runs): the dtypes of the
table are derived from real torch, and cannot drift from it. Where the CPU and CUDA lists agree
for every op of an equivalent (linear, conv, matmul, einsum, scaled_dot_product_attention and
ops in no list), it also runs under ``torch.autocast("cpu", torch.float16)`` itself and must give
the emulation's dtypes and values bit for bit.
"""

import functools
import math
from pathlib import Path
import re
from typing import Any
from typing import Callable
from typing import NamedTuple
import warnings

from conftest import import_optional
from conftest import import_torch
from helpers import DEVIATIONS
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_lossscale as jls
from jax_lossscale._autocast import _values  # jaxprs_in_params on each jax version

F16, F32 = np.dtype(jnp.float16), np.dtype(jnp.float32)
GUIDE = Path(__file__).resolve().parents[2] / "docs/guides/autocast.md"

#: Value tolerance, as a fraction of the largest magnitude of each float32 output: 2**-7,
#: at least 8 float16 ulps at that magnitude (an ulp is 2**-10 of the value's binade). A
#: case rounds its inputs and params to float16 (half an ulp each) and each float16 result
#: (half an ulp), through a chain of at most a few such steps (a cell's two matmuls, its
#: gates and its carry update; three steps of a recurrence), each carried with a gain near
#: 1; the float32 accumulation of the matmuls adds nothing comparable. Measured on every
#: case that runs: at most 2.44 ulps (scan_bias, a three-step recurrence), most cases under
#: 1.2; the bound leaves room for another summation order, or float16 carries once cells
#: return them.
TOL = 2.0**-7


def _rand(seed, shape, scale=1.0):
  # NumPy, not jax.random: no compilation per shape (the file must stay fast).
  return jnp.asarray(scale * np.random.default_rng(seed).standard_normal(shape), jnp.float32)


# -- the cases ----------------------------------------------------------------------------


class Case(NamedTuple):
  fn: Callable[..., dict]  # fn(params, *inputs) -> {output name: array or pytree}
  params: Any  # differentiated: float32 arrays only
  inputs: tuple = ()


_CASES: dict[str, Callable[[], Case]] = {}


def case(*names):
  """Registers a case builder (built on first use: flax and equinox are optional)."""

  def register(builder):
    for name in names:
      _CASES[name] = functools.partial(builder, name) if len(names) > 1 else builder
    return builder

  return register


def _linen():
  return import_optional("flax.linen")


def _nnx():
  return import_optional("flax.nnx")


def _eqx():
  return import_optional("equinox")


X = _rand(0, (4, 6))  # a batch of 4 feature vectors
IMG = _rand(1, (2, 6, 6, 3))  # NHWC for Flax
IMG_CHW = jnp.transpose(IMG, (0, 3, 1, 2))  # per-example CHW for Equinox
SEQ = _rand(2, (2, 5, 8))  # batch, time, features
TOKENS = jnp.array([1, 4, 0, 7, 4, 10], jnp.int32)
DROP_KEY = jax.random.key(42)


def _dense_params(seed, din, dout, bias=True):
  p = {"w": _rand(seed, (din, dout), din**-0.5)}
  if bias:
    p["b"] = _rand(seed + 1, (dout,), 0.1)
  return p


def _dense(p, x):
  return x @ p["w"] + p["b"] if "b" in p else x @ p["w"]


# Layers are built abstractly (jax.eval_shape) and their arrays filled from NumPy: eager
# initialisers would compile once per shape, and dominate the file's run time.


def _fill(tree, seed=0, stats=False):
  """Concrete arrays for the abstract leaves of ``tree``.

  Floats: normal, scaled by 1/sqrt(fan-in) (the size over the largest dimension, which is
  the fan-in of Flax's and Equinox's kernel layouts here), 1-d ones by 0.5; with ``stats``
  (running mean and variance) uniform in [0.5, 1.5). Keys: a key; ints and bools: zeros.
  """
  rng = np.random.default_rng(seed)

  def one(leaf):
    if not isinstance(leaf, jax.ShapeDtypeStruct):
      return leaf
    if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      return jax.random.key(seed)
    if not jnp.issubdtype(leaf.dtype, jnp.floating):
      return jnp.zeros(leaf.shape, leaf.dtype)
    if stats:
      return jnp.asarray(0.5 + rng.random(leaf.shape), leaf.dtype)
    size = math.prod(leaf.shape)
    scale = 0.5 if len(leaf.shape) < 2 else (size / max(leaf.shape)) ** -0.5
    return jnp.asarray(scale * rng.standard_normal(leaf.shape), leaf.dtype)

  return jax.tree.map(one, tree)


def _shape(x):
  return jax.ShapeDtypeStruct(x.shape, x.dtype)


# Flax linen: a layer alone, or after a float16 layer (so that it sees float16 input).


def _linen_init(layer, x, seed):
  return _fill(jax.eval_shape(layer.init, {"params": jax.random.key(0)}, _shape(x)), seed)


def _linen_pair(first, layer, x, *, rngs=False, **apply_kw):
  p = {}
  h = x
  if first is not None:
    p["first"] = _linen_init(first, x, 3)
    h = jax.eval_shape(first.apply, p["first"], x)
  p["layer"] = _linen_init(layer, h, 4)

  def fn(p, x, *rng):
    h = first.apply(p["first"], x) if first is not None else x
    kw = {"rngs": {"dropout": rng[0]}} if rng else {}
    out = {"y": layer.apply(p["layer"], h, **kw, **apply_kw)}
    if first is not None:
      out["h"] = h
    return out

  return Case(fn, p, (x, DROP_KEY) if rngs else (x,))


@case("linen_dense")
def _():
  nn = _linen()
  return _linen_pair(None, nn.Dense(5), X)


@case("linen_conv1d")
def _():
  nn = _linen()
  return _linen_pair(None, nn.Conv(4, (3,)), SEQ[..., :3])


@case("linen_conv2d")
def _():
  nn = _linen()
  return _linen_pair(None, nn.Conv(4, (3, 3)), IMG)


@case("linen_conv_transpose")
def _():
  nn = _linen()
  return _linen_pair(None, nn.ConvTranspose(4, (3, 3)), IMG)


@case("linen_embed")
def _():
  nn = _linen()
  layer = nn.Embed(11, 8)
  return Case(lambda p, t: {"y": layer.apply(p, t)}, _linen_init(layer, TOKENS, 0), (TOKENS,))


@case("linen_layer_norm")
def _():
  nn = _linen()
  return _linen_pair(nn.Dense(8), nn.LayerNorm(), X)


@case("linen_rms_norm")
def _():
  nn = _linen()
  return _linen_pair(nn.Dense(8), nn.RMSNorm(), X)


@case("linen_group_norm")
def _():
  nn = _linen()
  return _linen_pair(nn.Conv(4, (3, 3)), nn.GroupNorm(num_groups=2), IMG)


@case("linen_dropout")
def _():
  nn = _linen()
  return _linen_pair(nn.Dense(8), nn.Dropout(0.5, deterministic=False), X, rngs=True)


@case("linen_batch_norm_train", "linen_batch_norm_eval")
def _(name):
  nn = _linen()
  train = name.endswith("train")
  conv = nn.Conv(4, (3, 3))
  bn = nn.BatchNorm(use_running_average=not train, momentum=0.9)
  pc = _linen_init(conv, IMG, 3)
  abstract = jax.eval_shape(bn.init, jax.random.key(0), jax.eval_shape(conv.apply, pc, IMG))
  p = {"conv": pc, "bn": _fill(abstract["params"], 4)}
  stats = _fill(abstract["batch_stats"], 5, stats=True)  # real (positive) running statistics

  def fn(p, stats, x):
    h = conv.apply(p["conv"], x)
    v = {"params": p["bn"], "batch_stats": stats}
    if not train:
      return {"h": h, "y": bn.apply(v, h)}
    y, new = bn.apply(v, h, mutable=["batch_stats"])
    return {"h": h, "y": y, "batch_stats": new["batch_stats"]}

  return Case(fn, p, (stats, IMG))


@case("linen_mha")
def _():
  nn = _linen()
  return _linen_pair(None, nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8), SEQ)


def _linen_cell(cell, carry, x):
  p = _fill(jax.eval_shape(cell.init, jax.random.key(0), carry, _shape(x)), 5)
  return p, lambda p, carry, x: cell.apply(p, carry, x)


@case("linen_lstm_cell", "linen_optimized_lstm_cell")
def _(name):
  nn = _linen()
  cell = (nn.LSTMCell if name == "linen_lstm_cell" else nn.OptimizedLSTMCell)(features=5)
  carry = (_rand(6, (4, 5), 0.5), _rand(7, (4, 5), 0.5))  # (c, h), float32
  p, apply = _linen_cell(cell, carry, X)

  def fn(p, carry, x):
    (c, h), y = apply(p, carry, x)
    return {"h": h, "c": c, "y": y}

  return Case(fn, p, (carry, X))


@case("linen_gru_cell")
def _():
  nn = _linen()
  carry = _rand(6, (4, 5), 0.5)
  p, apply = _linen_cell(nn.GRUCell(features=5), carry, X)

  def fn(p, carry, x):
    h, y = apply(p, carry, x)
    return {"h": h, "y": y}

  return Case(fn, p, (carry, X))


@case("avg_pool", "max_pool")
def _(name):
  nn = _linen()
  conv = nn.Conv(4, (3, 3))
  pool = nn.avg_pool if name == "avg_pool" else nn.max_pool

  def fn(p, x):
    h = conv.apply(p, x)
    with jax.numpy_dtype_promotion("standard"):  # flax's avg_pool divides by an int32 count
      return {"h": h, "y": pool(h, (2, 2), strides=(2, 2))}

  return Case(fn, _linen_init(conv, IMG, 3), (IMG,))


# Flax NNX: split into params, batch statistics and the rest (rng state), merged in fn.


def _nnx_case(make, *inputs, stats=False):
  nnx = _nnx()
  abstract = nnx.eval_shape(lambda: make(nnx))
  graphdef, params, batch_stats, rest = nnx.split(abstract, nnx.Param, nnx.BatchStat, ...)
  params, rest = _fill(params, 4), _fill(rest, 42)
  batch_stats = _fill(batch_stats, 5, stats=True)

  def fn(params, batch_stats, rest, *inputs):
    m = nnx.merge(graphdef, params, batch_stats, rest)
    out = m(*inputs)
    out = out if isinstance(out, dict) else {"y": out}
    if stats:
      out["batch_stats"] = nnx.state(m, nnx.BatchStat)
    return out

  return Case(fn, params, (batch_stats, rest, *inputs))


def _nnx_pair(nnx, first, layer):
  class Pair(nnx.Module):
    def __init__(self):
      self.first, self.layer = first, layer

    def __call__(self, x):
      h = self.first(x)
      return {"h": h, "y": self.layer(h)}

  return Pair()


@case("nnx_linear")
def _():
  return _nnx_case(lambda nnx: nnx.Linear(6, 5, rngs=nnx.Rngs(0)), X)


@case("nnx_conv2d")
def _():
  return _nnx_case(lambda nnx: nnx.Conv(3, 4, (3, 3), rngs=nnx.Rngs(0)), IMG)


@case("nnx_conv_transpose")
def _():
  return _nnx_case(lambda nnx: nnx.ConvTranspose(3, 4, (3, 3), rngs=nnx.Rngs(0)), IMG)


@case("nnx_embed")
def _():
  return _nnx_case(lambda nnx: nnx.Embed(11, 8, rngs=nnx.Rngs(0)), TOKENS)


@case("nnx_layer_norm", "nnx_rms_norm", "nnx_group_norm", "nnx_dropout")
def _(name):
  def make(nnx):
    if name == "nnx_group_norm":
      return _nnx_pair(
        nnx, nnx.Conv(3, 4, (3, 3), rngs=nnx.Rngs(0)), nnx.GroupNorm(4, 2, rngs=nnx.Rngs(1))
      )
    layer = {
      "nnx_layer_norm": lambda: nnx.LayerNorm(8, rngs=nnx.Rngs(1)),
      "nnx_rms_norm": lambda: nnx.RMSNorm(8, rngs=nnx.Rngs(1)),
      "nnx_dropout": lambda: nnx.Dropout(0.5, deterministic=False, rngs=nnx.Rngs(dropout=42)),
    }[name]()
    return _nnx_pair(nnx, nnx.Linear(6, 8, rngs=nnx.Rngs(0)), layer)

  return _nnx_case(make, IMG if name == "nnx_group_norm" else X)


@case("nnx_batch_norm_train", "nnx_batch_norm_eval")
def _(name):
  train = name.endswith("train")

  def make(nnx):
    bn = nnx.BatchNorm(4, use_running_average=not train, momentum=0.9, rngs=nnx.Rngs(1))
    return _nnx_pair(nnx, nnx.Conv(3, 4, (3, 3), rngs=nnx.Rngs(0)), bn)

  return _nnx_case(make, IMG, stats=train)


@case("nnx_mha")
def _():
  return _nnx_case(lambda nnx: nnx.MultiHeadAttention(2, 8, 8, decode=False, rngs=nnx.Rngs(0)), SEQ)


@case("nnx_lstm_cell", "nnx_optimized_lstm_cell", "nnx_gru_cell")
def _(name):
  carry = (_rand(6, (4, 5), 0.5), _rand(7, (4, 5), 0.5))  # (c, h), float32
  if name == "nnx_gru_cell":
    carry = carry[1]

  def make(nnx):
    cls = {
      "nnx_lstm_cell": nnx.LSTMCell,
      "nnx_optimized_lstm_cell": nnx.OptimizedLSTMCell,
      "nnx_gru_cell": nnx.GRUCell,
    }[name]
    cell = cls(6, 5, rngs=nnx.Rngs(0))

    class Step(nnx.Module):
      def __init__(self):
        self.cell = cell

      def __call__(self, carry, x):
        new, y = self.cell(carry, x)
        if name == "nnx_gru_cell":
          return {"h": new, "y": y}
        return {"c": new[0], "h": new[1], "y": y}

    return Step()

  return _nnx_case(make, carry, X)


# Equinox: per-example layers, vmapped over the batch inside the autocast function.


def _eqx_build(make):
  """``make(eqx.nn, key)``'s modules, abstract, then filled."""
  eqx = _eqx()
  return _fill(eqx.filter_eval_shape(lambda: make(eqx.nn, jax.random.key(0))), 4)


def _eqx_case(modules, body, *inputs):
  eqx = _eqx()
  params, static = eqx.partition(modules, eqx.is_inexact_array)

  def fn(params, *inputs):
    return body(eqx.combine(params, static), *inputs)

  return Case(fn, params, inputs)


def _eqx_after(ms, x):
  """The second of ``ms`` after the first, both vmapped over the batch."""

  def body(ms, x):
    h = jax.vmap(ms[0])(x)
    return {"h": h, "y": jax.vmap(ms[1])(h)}

  return _eqx_case(ms, body, x)


@case("eqx_linear")
def _():
  lin = _eqx_build(lambda nn, k: nn.Linear(6, 5, key=k))
  return _eqx_case(lin, lambda m, x: {"y": jax.vmap(m)(x)}, X)


@case("eqx_linear_unbatched")
def _():
  lin = _eqx_build(lambda nn, k: nn.Linear(6, 5, key=k))
  return _eqx_case(lin, lambda m, x: {"y": m(x)}, X[0])


@case("eqx_conv1d", "eqx_conv2d", "eqx_conv_transpose")
def _(name):
  make = {
    "eqx_conv1d": lambda nn, k: nn.Conv1d(3, 4, 3, key=k),
    "eqx_conv2d": lambda nn, k: nn.Conv2d(3, 4, 3, key=k),
    "eqx_conv_transpose": lambda nn, k: nn.ConvTranspose2d(3, 4, 3, key=k),
  }[name]
  x = jnp.transpose(SEQ[..., :3], (0, 2, 1)) if name == "eqx_conv1d" else IMG_CHW
  return _eqx_case(_eqx_build(make), lambda m, x: {"y": jax.vmap(m)(x)}, x)


@case("eqx_embedding")
def _():
  emb = _eqx_build(lambda nn, k: nn.Embedding(11, 8, key=k))
  return _eqx_case(emb, lambda m, t: {"y": jax.vmap(m)(t)}, TOKENS)


@case("eqx_layer_norm", "eqx_rms_norm", "eqx_group_norm", "eqx_avg_pool", "eqx_max_pool")
def _(name):
  second = {
    "eqx_layer_norm": lambda nn: nn.LayerNorm(8),
    "eqx_rms_norm": lambda nn: nn.RMSNorm(8),
    "eqx_group_norm": lambda nn: nn.GroupNorm(2, 4),
    "eqx_avg_pool": lambda nn: nn.AvgPool2d(2, 2),
    "eqx_max_pool": lambda nn: nn.MaxPool2d(2, 2),
  }[name]
  if name in ("eqx_layer_norm", "eqx_rms_norm"):
    ms = _eqx_build(lambda nn, k: (nn.Linear(6, 8, key=k), second(nn)))
    return _eqx_after(ms, X)
  ms = _eqx_build(lambda nn, k: (nn.Conv2d(3, 4, 3, key=k), second(nn)))
  return _eqx_after(ms, IMG_CHW)


@case("eqx_dropout")
def _():
  ms = _eqx_build(lambda nn, k: (nn.Linear(6, 8, key=k), nn.Dropout(0.5, inference=False)))

  def body(ms, x, key):
    h = jax.vmap(ms[0])(x)
    return {"h": h, "y": ms[1](h, key=key)}

  return _eqx_case(ms, body, X, DROP_KEY)


@case("eqx_batch_norm_train", "eqx_batch_norm_eval")
def _(name):
  eqx = _eqx()
  train = name.endswith("train")

  def make():
    conv = eqx.nn.Conv2d(3, 4, 3, key=jax.random.key(0))
    bn, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(4, "batch", momentum=0.9, mode="ema")
    return (conv, bn), state

  modules, state = eqx.filter_eval_shape(make)
  modules, state = _fill(modules, 4), _fill(state, 5, stats=True)  # not the first step
  params, static = eqx.partition(modules, eqx.is_inexact_array)

  def fn(params, state, x):
    conv, bn = eqx.combine(params, static)
    h = jax.vmap(conv)(x)
    y, new = jax.vmap(
      functools.partial(bn, inference=not train),
      axis_name="batch",
      in_axes=(0, None),
      out_axes=(0, None),
    )(h, state)
    return {"h": h, "y": y, "batch_stats": new} if train else {"h": h, "y": y}

  return Case(fn, params, (state, IMG_CHW))


@case("eqx_mha")
def _():
  mha = _eqx_build(lambda nn, k: nn.MultiheadAttention(2, 8, key=k))
  return _eqx_case(mha, lambda m, x: {"y": jax.vmap(lambda s: m(s, s, s))(x)}, SEQ)


@case("eqx_lstm_cell", "eqx_gru_cell")
def _(name):
  h0, c0 = _rand(6, (4, 5), 0.5), _rand(7, (4, 5), 0.5)  # float32 carry
  if name == "eqx_lstm_cell":
    cell = _eqx_build(lambda nn, k: nn.LSTMCell(6, 5, key=k))

    def body(m, x, hc):
      h, c = jax.vmap(m)(x, hc)
      return {"h": h, "c": c}

    return _eqx_case(cell, body, X, (h0, c0))
  cell = _eqx_build(lambda nn, k: nn.GRUCell(6, 5, key=k))
  return _eqx_case(cell, lambda m, x, h: {"h": jax.vmap(m)(x, h)}, X, h0)


# Plain JAX.


def _act_case(act):
  return Case(lambda p, x: {"h": (h := _dense(p, x)), "y": act(h)}, _dense_params(20, 6, 8), (X,))


@case("relu")
def _():
  return _act_case(jax.nn.relu)


@case("gelu_exact")
def _():
  return _act_case(functools.partial(jax.nn.gelu, approximate=False))


@case("gelu_approximate")
def _():
  # Looked up when called, as `jax.nn.gelu(h)` in a model: the registered op runs in h's
  # dtype, as torch's fused gelu (its `x ** 3` alone would be torch's float32 `pow`).
  return _act_case(lambda h: jax.nn.gelu(h, approximate=True))


@case("silu")
def _():
  return _act_case(jax.nn.silu)


@case("softmax")
def _():
  return _act_case(jax.nn.softmax)


@case("mean")
def _():
  return _act_case(lambda h: jnp.mean(h, axis=-1))


@case("jax_dot_product_attention")
def _():
  p = {k: _rand(i, (8, 8), 8**-0.5) for i, k in enumerate(("wq", "wk", "wv"), 30)}

  def fn(p, x):
    q, k, v = (jnp.reshape(x @ p[n], (2, 5, 2, 4)) for n in ("wq", "wk", "wv"))
    return {"q": q, "y": jax.nn.dot_product_attention(q, k, v, is_causal=True)}

  return Case(fn, p, (SEQ,))


@case("causal_mask_softmax")
def _():
  p = {k: _rand(i, (8, 8), 8**-0.5) for i, k in enumerate(("wq", "wk", "wv"), 40)}

  def fn(p, x):
    q, k, v = x @ p["wq"], x @ p["wk"], x @ p["wv"]
    s = q @ k.T
    mask = jnp.tril(jnp.ones(s.shape, bool))
    masked = jnp.where(mask, s, -jnp.inf)
    probs = jax.nn.softmax(masked, axis=-1)
    return {"scores": s, "masked": masked, "probs": probs, "y": probs @ v}

  return Case(fn, p, (SEQ[0],))


@case("where_mask")
def _():
  mask = _rand(50, (4, 8)) > 0

  def fn(p, x, mask):
    h = _dense(p, x)
    return {"h": h, "y": jnp.where(mask, h, 0.0)}

  return Case(fn, _dense_params(20, 6, 8), (X, mask))


@case("mul_bool_mask")
def _():
  def fn(p, x, z):
    h = _dense(p, x)
    with jax.numpy_dtype_promotion("standard"):  # as models are written: bool promotes
      return {"h": h, "y": h * (z > 0)}

  return Case(fn, _dense_params(20, 6, 8), (X, _rand(51, (4, 8))))


_AT_OPS = ("set", "add", "max", "min", "multiply", "subtract")


@case(*(f"at_{op}" for op in _AT_OPS))
def _(name):
  op = name.removeprefix("at_")
  idx = jnp.array([0, 3], jnp.int32)
  p = {"w": _rand(60, (6, 8), 6**-0.5), "w2": _rand(61, (6, 8), 6**-0.5)}

  def fn(p, x, y):
    h, u = x @ p["w"], y @ p["w2"]  # float16 activation, float16 updates
    return {"h": h, "y": getattr(h.at[idx], op)(u)}

  return Case(fn, p, (X, _rand(62, (2, 6))))


@case("at_set_scalar")
def _():
  def fn(p, x):
    h = _dense(p, x)
    return {"h": h, "y": h.at[:, 0].set(0.0)}

  return Case(fn, _dense_params(20, 6, 8), (X,))


_SEGMENT_OPS = ("sum", "max", "min", "prod")
SENDERS = jnp.array([0, 1, 2, 3, 4, 0, 2], jnp.int32)
RECEIVERS = jnp.array([1, 2, 3, 4, 0, 0, 1], jnp.int32)  # every node receives a message


@case(*(f"segment_{op}" for op in _SEGMENT_OPS))
def _(name):
  segment = getattr(jax.ops, name)

  def fn(p, nodes, senders, receivers):
    h = nodes @ p["w"]  # float16 node features
    messages = h[senders]  # float16 messages, gathered along the edges
    return {"messages": messages, "y": segment(messages, receivers, num_segments=5)}

  return Case(fn, {"w": _rand(70, (6, 8), 6**-0.5)}, (_rand(71, (5, 6)), SENDERS, RECEIVERS))


@case("associative_scan_cummax")
def _():
  def fn(p, x):
    h = _dense(p, x)
    return {"h": h, "y": lax.associative_scan(jnp.maximum, h, axis=0)}

  return Case(fn, _dense_params(20, 6, 8), (X,))


@case("associative_scan_linear_recurrence")
def _():
  def combine(left, right):
    a1, b1 = left
    a2, b2 = right
    return a1 * a2, a2 * b1 + b2

  def fn(p, x):
    a = jax.nn.sigmoid(x @ p["wa"])  # float16 decay
    b = x @ p["wb"]  # float16 input
    return {"a": a, "y": lax.associative_scan(combine, (a, b), axis=0)[1]}

  p = {"wa": _rand(80, (6, 8), 6**-0.5), "wb": _rand(81, (6, 8), 6**-0.5)}
  return Case(fn, p, (X,))


@case("top_k_routing")
def _():
  n_experts, k = 4, 2
  p = {
    "w_in": _rand(90, (6, 8), 6**-0.5),
    "router": _rand(91, (8, n_experts), 3.0),  # well separated logits: no near ties
    "experts": _rand(92, (n_experts, 8, 8), 8**-0.5),
  }

  def fn(p, x):
    h = x @ p["w_in"]
    logits = h @ p["router"]
    top_values, top_idx = lax.top_k(logits, k)
    gates = jax.nn.softmax(top_values, axis=-1)
    # one_hot dispatch: combine weights per expert, then every expert, then combine.
    combine = jnp.sum(gates[..., None] * jax.nn.one_hot(top_idx, n_experts), axis=1)
    all_experts = jnp.einsum("bd,edf->bef", h, p["experts"])
    # gather dispatch: the chosen experts' weights, applied, weighted by the gates.
    chosen = jnp.einsum("bd,bkdf->bkf", h, p["experts"][top_idx])
    return {
      "router_logits": logits,
      "top_values": top_values,
      "gates": gates,
      "one_hot_out": jnp.einsum("be,bef->bf", combine, all_experts),
      "gather_out": jnp.sum(gates[..., None] * chosen, axis=1),
    }

  return Case(fn, p, (X,))


@case("fori_loop")
def _():
  def fn(p, x):
    return {"y": lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ p["w"] + p["b"]), x)}

  return Case(fn, _dense_params(20, 6, 6), (X,))


@case("vmap_per_example")
def _():
  def per_example(p, x):  # x: one feature vector
    h = x @ p["w"] + p["b"]
    return {"linear": h, "softmax": jax.nn.softmax(h)}

  return Case(jax.vmap(per_example, in_axes=(None, 0)), _dense_params(20, 6, 8), (X,))


@case("checkpoint_bias")
def _():
  def fn(p, x):
    y = jax.checkpoint(lambda x, w: x @ w)(x, p["w"]) + p["b"]
    return {"plain": x @ p["w"] + p["b"], "y": y}

  return Case(fn, _dense_params(20, 6, 8), (X,))


@case("jit_bias")
def _():
  def fn(p, x):
    inside = jax.jit(lambda x, w, b: x @ w + b)(x, p["w"], p["b"])
    outside = jax.jit(lambda x, w: x @ w)(x, p["w"]) + p["b"]
    return {"inside": inside, "outside": outside}

  return Case(fn, _dense_params(20, 6, 8), (X,))


@case("scan_bias")
def _():
  def fn(p, xs):
    def step(c, x):
      h = jnp.tanh(x @ p["w"] + p["b"] + c @ p["u"])
      return h, h

    carry, ys = lax.scan(step, jnp.zeros((4, 8), jnp.float32), xs)
    return {"carry": carry, "ys": ys}

  p = {**_dense_params(20, 6, 8), "u": _rand(22, (8, 8), 8**-0.5)}
  return Case(fn, p, (_rand(23, (3, 4, 6)),))


@case("cond_bias")
def _():
  def fn(p, pred, x):
    then = lambda x: x @ p["w"] + p["b"]
    otherwise = lambda x: jnp.tanh(x) @ p["w"] + p["b"]
    return {"y": lax.cond(pred, then, otherwise, x)}

  return Case(fn, _dense_params(20, 6, 8), (jnp.bool_(True), X))


@case("while_bias")
def _():
  def fn(p, x):
    _, h = lax.while_loop(
      lambda s: s[0] < 3, lambda s: (s[0] + 1, jnp.tanh(s[1] @ p["w"] + p["b"])), (0, x)
    )
    return {"y": h}

  return Case(fn, _dense_params(20, 6, 6), (X,))


# -- what torch.autocast("cuda", torch.float16) gives ---------------------------------------

_LINEAR = "F.linear(x, w, b)"
_CONV_BN_TRAIN = "F.batch_norm(F.conv2d(x, w, b), running_mean, running_var, g, b, training=True)"
_CONV_BN_EVAL = "F.batch_norm(F.conv2d(x, w, b), running_mean, running_var, g, b, training=False)"
_MHA = "nn.MultiheadAttention: F.linear q, k, v; F.scaled_dot_product_attention; F.linear out"
_LSTM = "nn.LSTMCell: torch.lstm_cell(x, (h, c), w_ih, w_hh, b_ih, b_hh)"
_GRU = "nn.GRUCell: torch.gru_cell(x, h, w_ih, w_hh, b_ih, b_hh)"
_EMBED = "F.embedding(tokens, weight)"
_LN = "F.layer_norm(F.linear(x, w, b), (d,), g, b)"
_RMS = "F.rms_norm(F.linear(x, w, b), (d,), g)"
_GN = "F.group_norm(F.conv2d(x, w, b), 2, g, b)"
_DROPOUT = "F.dropout(F.linear(x, w, b), 0.5, training=True)"
_CONV1D, _CONV2D = "F.conv1d(x, w, b)", "F.conv2d(x, w, b)"
_CONVT = "F.conv_transpose2d(x, w, b)"
_AVG, _MAX = "F.avg_pool2d(F.conv2d(x, w, b), 2)", "F.max_pool2d(F.conv2d(x, w, b), 2)"
_H16 = {"h": F16, "y": F16}
_CELL = {"h": F16, "c": F16, "y": F16}

#: Each case's torch equivalent, and the dtype of each of its outputs under
#: ``torch.autocast("cuda", torch.float16)`` of a float32 model (the header's list of each op
#: in the comment; "no list": the op runs in its inputs' dtype).
TORCH_CUDA_ZOO: dict[str, tuple[str, dict[str, np.dtype]]] = {
  # lower_precision_fp: linear, conv1d, conv2d, conv_transpose2d (bias inside the op).
  "linen_dense": (_LINEAR, {"y": F16}),
  "nnx_linear": (_LINEAR, {"y": F16}),
  "eqx_linear": (_LINEAR, {"y": F16}),
  "eqx_linear_unbatched": ("F.linear(x_vector, w, b)", {"y": F16}),
  "linen_conv1d": (_CONV1D, {"y": F16}),
  "eqx_conv1d": (_CONV1D, {"y": F16}),
  "linen_conv2d": (_CONV2D, {"y": F16}),
  "nnx_conv2d": (_CONV2D, {"y": F16}),
  "eqx_conv2d": (_CONV2D, {"y": F16}),
  "linen_conv_transpose": (_CONVT, {"y": F16}),
  "nnx_conv_transpose": (_CONVT, {"y": F16}),
  "eqx_conv_transpose": (_CONVT, {"y": F16}),
  # embedding: no list, a float32 weight gives float32.
  "linen_embed": (_EMBED, {"y": F32}),
  "nnx_embed": (_EMBED, {"y": F32}),
  "eqx_embedding": (_EMBED, {"y": F32}),
  # fp32: layer_norm, rms_norm, group_norm (float16 input from the linear/conv).
  "linen_layer_norm": (_LN, {"h": F16, "y": F32}),
  "nnx_layer_norm": (_LN, {"h": F16, "y": F32}),
  "eqx_layer_norm": (_LN, {"h": F16, "y": F32}),
  "linen_rms_norm": (_RMS, {"h": F16, "y": F32}),
  "nnx_rms_norm": (_RMS, {"h": F16, "y": F32}),
  "eqx_rms_norm": (_RMS, {"h": F16, "y": F32}),
  "linen_group_norm": (_GN, {"h": F16, "y": F32}),
  "nnx_group_norm": (_GN, {"h": F16, "y": F32}),
  "eqx_group_norm": (_GN, {"h": F16, "y": F32}),
  # batch_norm: no list; cuDNN takes float16 input with float32 weight and statistics and
  # returns the input's dtype; the running statistics are float32 buffers updated in place.
  "linen_batch_norm_train": (_CONV_BN_TRAIN, {"h": F16, "y": F16, "batch_stats": F32}),
  "nnx_batch_norm_train": (_CONV_BN_TRAIN, {"h": F16, "y": F16, "batch_stats": F32}),
  "eqx_batch_norm_train": (_CONV_BN_TRAIN, {"h": F16, "y": F16, "batch_stats": F32}),
  "linen_batch_norm_eval": (_CONV_BN_EVAL, _H16),
  "nnx_batch_norm_eval": (_CONV_BN_EVAL, _H16),
  "eqx_batch_norm_eval": (_CONV_BN_EVAL, _H16),
  # dropout: no list (select(mask, h / p, 0) in the input's dtype).
  "linen_dropout": (_DROPOUT, _H16),
  "nnx_dropout": (_DROPOUT, _H16),
  "eqx_dropout": (_DROPOUT, _H16),
  # lower_precision_fp: linear and scaled_dot_product_attention.
  "linen_mha": (_MHA, {"y": F16}),
  "nnx_mha": (_MHA, {"y": F16}),
  "eqx_mha": (_MHA, {"y": F16}),
  "jax_dot_product_attention": (
    "F.scaled_dot_product_attention(q, k, v, is_causal=True), q = F.linear(x, wq)",
    {"q": F16, "y": F16},
  ),
  # lower_precision_fp: lstm_cell, gru_cell cast every input, the float32 carry too.
  "linen_lstm_cell": (_LSTM, _CELL),
  "linen_optimized_lstm_cell": (_LSTM, _CELL),
  "nnx_lstm_cell": (_LSTM, _CELL),
  "nnx_optimized_lstm_cell": (_LSTM, _CELL),
  "eqx_lstm_cell": (_LSTM, {"h": F16, "c": F16}),
  "linen_gru_cell": (_GRU, {"h": F16, "y": F16}),
  "nnx_gru_cell": (_GRU, {"h": F16, "y": F16}),
  "eqx_gru_cell": (_GRU, {"h": F16}),
  # relu, gelu (both forms: one fused kernel), silu: no list. softmax: fp32_set_opt_dtype.
  "relu": ("F.relu(F.linear(x, w, b))", _H16),
  "gelu_exact": ("F.gelu(F.linear(x, w, b))", _H16),
  "gelu_approximate": ("F.gelu(F.linear(x, w, b), approximate='tanh')", _H16),
  "silu": ("F.silu(F.linear(x, w, b))", _H16),
  "softmax": ("torch.softmax(F.linear(x, w, b), -1)", {"h": F16, "y": F32}),
  "mean": ("torch.mean(F.linear(x, w, b), -1)", _H16),  # mean: no list
  # avg_pool2d, max_pool2d: no list.
  "avg_pool": (_AVG, _H16),
  "max_pool": (_MAX, _H16),
  "eqx_avg_pool": (_AVG, _H16),
  "eqx_max_pool": (_MAX, _H16),
  # matmul: lower_precision_fp; masked_fill: no list; softmax: fp32_set_opt_dtype.
  "causal_mask_softmax": (
    "p = torch.softmax((q @ k.T).masked_fill(~causal, -inf), -1); p @ v",
    {"scores": F16, "masked": F16, "probs": F32, "y": F16},
  ),
  # where, mul with a bool tensor: no list, a bool or a Python scalar promotes nothing.
  "where_mask": ("torch.where(mask, F.linear(x, w, b), 0.0)", _H16),
  "mul_bool_mask": ("F.linear(x, w, b) * (z > 0)", _H16),
  # index_put (promote; every operand float16), index_reduce, index_fill: no list.
  "at_set": ("h.index_put((i,), u)", _H16),
  "at_add": ("h.index_put((i,), u, accumulate=True)", _H16),
  "at_subtract": ("h.index_put((i,), -u, accumulate=True)", _H16),
  "at_max": ("h.index_reduce(0, i, u, 'amax')", _H16),
  "at_min": ("h.index_reduce(0, i, u, 'amin')", _H16),
  "at_multiply": ("h.index_reduce(0, i, u, 'prod')", _H16),
  "at_set_scalar": ("h.index_fill(1, i, 0.0)", _H16),
  # index_select, new_zeros, scatter_reduce: no list (as torch_scatter / PyG aggregate).
  "segment_sum": ("m.new_zeros(n, d).scatter_reduce(0, r, m, 'sum')", {"messages": F16, "y": F16}),
  "segment_max": ("m.new_zeros(n, d).scatter_reduce(0, r, m, 'amax')", {"messages": F16, "y": F16}),
  "segment_min": ("m.new_zeros(n, d).scatter_reduce(0, r, m, 'amin')", {"messages": F16, "y": F16}),
  "segment_prod": (
    "m.new_zeros(n, d).scatter_reduce(0, r, m, 'prod')",
    {"messages": F16, "y": F16},
  ),
  # cummax; the recurrence's mul and add: no list.
  "associative_scan_cummax": ("torch.cummax(F.linear(x, w, b), 0)", _H16),
  "associative_scan_linear_recurrence": (
    "s_t = a_t * s_(t-1) + b_t, a = torch.sigmoid(x @ wa), b = x @ wb",
    {"a": F16, "y": F16},
  ),
  # matmul, einsum: lower_precision_fp; topk: no list; softmax, sum: fp32_set_opt_dtype;
  # the gates (float32) times the float16 expert outputs: mul promotes.
  "top_k_routing": (
    "torch.topk(h @ router, 2); softmax; einsum(one_hot(i).float()) / einsum(experts[i])",
    {
      "router_logits": F16,
      "top_values": F16,
      "gates": F32,
      "one_hot_out": F16,
      "gather_out": F32,
    },
  ),
  # The loops and regions of plain Python in torch: F.linear (the bias inside) then tanh.
  "fori_loop": ("for _ in range(3): h = torch.tanh(F.linear(h, w, b))", {"y": F16}),
  "while_bias": ("for _ in range(3): h = torch.tanh(F.linear(h, w, b))", {"y": F16}),
  "scan_bias": (
    "for x_t in xs: h = torch.tanh(F.linear(x_t, w, b) + h @ u)",
    {"carry": F16, "ys": F16},
  ),
  "vmap_per_example": ("torch.vmap(F.linear), torch.softmax", {"linear": F16, "softmax": F32}),
  "checkpoint_bias": (
    "torch.utils.checkpoint.checkpoint(F.linear, x, w, b)",
    {"plain": F16, "y": F16},
  ),
  "jit_bias": (_LINEAR, {"inside": F16, "outside": F16}),  # jax.jit: no torch op
  "cond_bias": ("F.linear(x, w, b) if pred else F.linear(torch.tanh(x), w, b)", {"y": F16}),
}


def _expected(name):
  want = dict(TORCH_CUDA_ZOO[name][1])
  if name in DEVIATIONS:
    want.update(DEVIATIONS[name][0])
  return want


# -- running the cases ----------------------------------------------------------------------


#: Cases whose gradient is taken in forward mode: reverse-mode differentiation of
#: ``lax.while_loop`` is JAX's own limit (the guide's Limits), with or without autocast.
# Reverse mode through while_loop is JAX's limit (float32 too).
FORWARD_ONLY = {"while_bias"}
# JAX differentiates no scatter-mul whose indices are not declared unique
# (`.at[i].multiply`, segment_prod), in float32 as in float16.
JAX_CANNOT_DIFFERENTIATE = {"at_multiply", "segment_prod"}


class Results(NamedTuple):
  case: Case
  out16: dict  # under jls.autocast(fn, jnp.float16)
  out32: dict  # fn itself, float32
  grads: Any  # w.r.t. the params, through the autocast function (or the exception raised)


def _weights(out):
  """Fixed random weights, one array per float output leaf (NumPy: nothing to compile)."""
  leaves = [x for x in jax.tree.leaves(out) if jnp.issubdtype(x.dtype, jnp.floating)]
  return [np.random.default_rng(1000 + i).standard_normal(x.shape) for i, x in enumerate(leaves)]


def _project(out, weights):
  """A float32 scalar that depends on every float output element."""
  leaves = [x for x in jax.tree.leaves(out) if jnp.issubdtype(x.dtype, jnp.floating)]
  total = jnp.zeros((), jnp.float32)
  for leaf, w in zip(leaves, weights, strict=True):
    total = total + jnp.sum(leaf.astype(jnp.float32) * jnp.asarray(w, jnp.float32))
  return total


def _fast_compile_options():
  """XLA options that make the small test programs compile several times faster: no
  backend optimisation, no fusion emitters (the jaxpr, hence every dtype, is the same).
  Only those this jaxlib knows, so that a renamed option costs time, not the tests."""
  wanted = {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
    "xla_cpu_use_fusion_emitters": False,
  }
  known = {}
  for key, value in wanted.items():
    try:
      jax.jit(lambda x: x + 1).lower(jnp.float32(1)).compile({key: value})
    except jax.errors.JaxRuntimeError:
      continue
    known[key] = value
  return known


_FAST_COMPILE = _fast_compile_options()


def _run(name):
  """Each case once (see :func:`_compute`); an exception is kept and raised again."""
  result = _compute(name)
  if isinstance(result, Exception):
    raise result
  return result


@functools.cache
def _compute(name):
  """Each case once: outputs, float32 outputs and gradients in one compiled program (one
  compilation per case keeps the file fast). Where that program fails, the forward runs on
  its own, so that each test reports its own failure."""
  try:
    c = _CASES[name]()
    amp = jls.autocast(c.fn, jnp.float16)
    weights = _weights(jax.eval_shape(c.fn, c.params, *c.inputs))
  except Exception as e:  # raised again by each test of the case
    return e

  def loss(params, *inputs):
    out = amp(params, *inputs)
    return _project(out, weights), out

  diff = jax.jacfwd if name in FORWARD_ONLY else jax.grad

  def everything(params, *inputs):
    grads, out16 = diff(loss, has_aux=True)(params, *inputs)
    return out16, c.fn(params, *inputs), grads

  try:
    return Results(c, *jax.jit(everything, compiler_options=_FAST_COMPILE)(c.params, *c.inputs))
  except Exception as grad_error:  # raised again by the gradient test
    try:
      out16 = jax.jit(amp, compiler_options=_FAST_COMPILE)(c.params, *c.inputs)
      out32 = jax.jit(c.fn, compiler_options=_FAST_COMPILE)(c.params, *c.inputs)
    except Exception as e:  # the forward itself fails: raised again by each test
      return e
    return Results(c, out16, out32, grad_error)


def _dtypes(out):
  """{output: its float leaves' dtypes} (an int or bool leaf, such as Equinox's first-step
  flag of a batch norm, or torch's num_batches_tracked, is never cast)."""
  floats = lambda v: [x for x in jax.tree.leaves(v) if jnp.issubdtype(x.dtype, jnp.floating)]
  return {k: sorted({str(x.dtype) for x in floats(v)}) for k, v in out.items()}


def test_every_case_has_a_torch_equivalent_and_every_deviation_is_a_case():
  assert sorted(_CASES) == sorted(TORCH_CUDA_ZOO)
  for name, (differs, reason, _) in DEVIATIONS.items():
    torch_dtypes = TORCH_CUDA_ZOO[name][1]
    assert reason
    assert differs and set(differs) <= set(torch_dtypes), name
    assert all(differs[k] != torch_dtypes[k] for k in differs), name  # a real deviation


def _squash(text):
  return " ".join(text.split())


@pytest.mark.parametrize("name", sorted(DEVIATIONS))
def test_the_guide_states_each_deviation(name):
  assert _squash(DEVIATIONS[name][2]) in _squash(GUIDE.read_text()), name


@pytest.mark.parametrize("name", sorted(TORCH_CUDA_ZOO))
def test_output_dtypes_are_torch_cudas(name):
  assert _dtypes(_run(name).out16) == {k: [str(d)] for k, d in _expected(name).items()}


@pytest.mark.parametrize("name", sorted(TORCH_CUDA_ZOO))
def test_gradients_are_float32_finite_and_not_zero(name):
  r = _run(name)
  if name in JAX_CANNOT_DIFFERENTIATE:
    assert isinstance(r.grads, NotImplementedError), r.grads
    c = r.case
    loss32 = lambda p: sum(jnp.sum(v) for v in jax.tree.leaves(c.fn(p, *c.inputs)))
    with pytest.raises(NotImplementedError, match="scatter_mul gradients"):
      jax.grad(loss32)(c.params)
    return
  if isinstance(r.grads, Exception):
    raise r.grads
  leaves, params = jax.tree.leaves(r.grads), jax.tree.leaves(r.case.params)
  assert len(leaves) == len(params) > 0
  for g, p in zip(leaves, params, strict=True):
    assert g.dtype == p.dtype == F32
    assert g.shape == p.shape
    assert bool(jnp.all(jnp.isfinite(g))), name
    assert bool(jnp.any(g != 0)), name  # every param reaches the outputs


@pytest.mark.parametrize("name", sorted(TORCH_CUDA_ZOO))
def test_values_are_close_to_float32(name):
  _, out16, out32, _ = _run(name)
  assert sorted(out16) == sorted(out32)
  for key in out16:
    for a, b in zip(jax.tree.leaves(out16[key]), jax.tree.leaves(out32[key]), strict=True):
      b = np.asarray(b, np.float32)
      finite = np.isfinite(b)
      scale = float(np.max(np.abs(b[finite]))) if finite.any() else 1.0
      np.testing.assert_allclose(
        np.asarray(a, np.float32), b, rtol=0, atol=TOL * scale, err_msg=f"{name}: {key}"
      )


def _eqns(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in _values.jaxprs_in_params(eqn.params):
      yield from _eqns(sub)


@pytest.mark.parametrize("name", ["fori_loop", "while_bias", "scan_bias"])
def test_inside_a_loop_body_the_biased_matmul_and_tanh_run_in_float16(name):
  # torch's per-step answer holds in the body; only the carry crosses the step boundary in
  # its declared dtype (DEVIATIONS).
  c = _run(name).case
  jaxpr = jax.make_jaxpr(jls.autocast(c.fn, jnp.float16))(c.params, *c.inputs).jaxpr
  loops = [e for e in _eqns(jaxpr) if e.primitive.name in ("scan", "while")]
  assert loops, name
  bodies = [sub for loop in loops for sub in _values.jaxprs_in_params(loop.params)]
  tanhs = [e for body in bodies for e in _eqns(body) if e.primitive.name == "tanh"]
  assert tanhs and all(np.dtype(e.invars[0].aval.dtype) == F16 for e in tanhs), name


# -- torch: the CUDA policy on CPU -------------------------------------------------------------

_LISTS = {
  "AT_FORALL_LOWER_PRECISION_FP": "lower_precision_fp",
  "AT_FORALL_FP32": "fp32",
  "AT_FORALL_FP32_SET_OPT_DTYPE": "fp32_set_opt_dtype",
  "AT_FORALL_PROMOTE": "promote",
}


@functools.cache
def _cuda_lists():
  """{op: list} from the installed torch's ``ATen/autocast_mode.h`` (the CUDA lists)."""
  torch = import_torch()
  header = Path(torch.__file__).parent / "include/ATen/autocast_mode.h"
  lists, current = {}, None
  for line in header.read_text().splitlines():
    m = re.match(r"#define (AT_FORALL_\w+)\(_\)", line)
    if m:
      current = _LISTS.get(m.group(1))
      continue
    if current is None:
      continue
    for op in re.findall(r"_\((\w+)", line):
      assert lists.setdefault(op, current) == current, op
    if not line.rstrip().endswith("\\"):
      current = None
  return lists


def test_the_header_lists_are_the_ones_the_table_cites():
  lists = _cuda_lists()
  for op in ("linear", "conv1d", "conv2d", "conv_transpose2d", "matmul", "einsum", "lstm_cell"):
    assert lists[op] == "lower_precision_fp", op
  assert lists["gru_cell"] == lists["scaled_dot_product_attention"] == "lower_precision_fp"
  for op in ("layer_norm", "rms_norm", "group_norm", "exp", "pow"):
    assert lists[op] == "fp32", op
  for op in ("softmax", "sum", "cumsum", "prod"):
    assert lists[op] == "fp32_set_opt_dtype", op
  assert lists["index_put"] == lists["scatter_add"] == "promote"
  for op in (
    "embedding", "batch_norm", "dropout", "relu", "gelu", "silu", "mean", "max_pool2d",
    "avg_pool2d", "masked_fill", "where", "mul", "add", "tanh", "sigmoid", "topk", "cummax",
    "index_select", "index_reduce", "index_fill", "scatter_reduce", "scatter", "new_zeros",
  ):  # fmt: skip
    assert op not in lists, op


def _cuda(op, fn, *args, **kwargs):
  """``fn(*args, **kwargs)`` as ``torch.autocast("cuda", torch.float16)`` runs ``op``.

  The list is the header's: lower_precision_fp casts every floating tensor argument (inside
  tuples too: lstm_cell's carry) to float16, fp32 to float32, fp32_set_opt_dtype runs a
  float16 input in float32, promote casts to the widest floating dtype; an op in no list
  takes its arguments as they are. Then the real (CPU) kernel runs.
  """
  torch = import_torch()
  kind = _cuda_lists().get(op)

  def floats(a):
    if isinstance(a, torch.Tensor):
      return [a] if a.is_floating_point() else []
    if isinstance(a, (tuple, list)):
      return [t for x in a for t in floats(x)]
    return []

  def cast(a, dtype):
    if isinstance(a, torch.Tensor) and a.is_floating_point():
      return a.to(dtype)
    if isinstance(a, (tuple, list)):
      return type(a)(cast(x, dtype) for x in a)
    return a

  if kind == "promote":
    dtype = torch.float32 if any(t.dtype == torch.float32 for t in floats(args)) else None
  elif kind == "fp32_set_opt_dtype":  # a float16 input runs with dtype=torch.float32
    dtype = torch.float32 if any(t.dtype == torch.float16 for t in floats(args)) else None
  else:
    dtype = {"lower_precision_fp": torch.float16, "fp32": torch.float32}.get(kind)
  if dtype is not None:
    args = cast(args, dtype)
  return fn(*args, **kwargs)


def _plain(op, fn, *args, **kwargs):
  """The op with no cast: for a run under ``torch.autocast("cpu")``."""
  return fn(*args, **kwargs)


_TORCH: dict[str, Callable] = {}


def torch_equivalent(*exprs):
  def register(fn):
    for expr in exprs:
      _TORCH[expr] = fn
    return fn

  return register


def _t(*shape):
  return import_torch().randn(*shape)


@torch_equivalent(_LINEAR)
def _(op, F):
  y = op("linear", F.linear, _t(4, 6), _t(5, 6), _t(5))
  return {"y": y, "inside": y, "outside": y}


@torch_equivalent("F.linear(x_vector, w, b)")
def _(op, F):
  return {"y": op("linear", F.linear, _t(6), _t(5, 6), _t(5))}


@torch_equivalent("torch.utils.checkpoint.checkpoint(F.linear, x, w, b)")
def _(op, F):
  checkpoint = import_torch().utils.checkpoint.checkpoint
  x, w, b = _t(4, 6), _t(8, 6), _t(8)
  y = checkpoint(lambda x: op("linear", F.linear, x, w, b), x, use_reentrant=False)
  return {"plain": op("linear", F.linear, x, w, b), "y": y}


@torch_equivalent("F.linear(x, w, b) if pred else F.linear(torch.tanh(x), w, b)")
def _(op, F):
  return {"y": op("linear", F.linear, _t(4, 6), _t(8, 6), _t(8))}


@torch_equivalent(_CONV1D)
def _(op, F):
  return {"y": op("conv1d", F.conv1d, _t(2, 3, 8), _t(4, 3, 3), _t(4))}


@torch_equivalent(_CONV2D)
def _(op, F):
  return {"y": op("conv2d", F.conv2d, _t(2, 3, 6, 6), _t(4, 3, 3, 3), _t(4))}


@torch_equivalent(_CONVT)
def _(op, F):
  return {"y": op("conv_transpose2d", F.conv_transpose2d, _t(2, 3, 6, 6), _t(3, 4, 3, 3), _t(4))}


@torch_equivalent(_EMBED)
def _(op, F):
  tokens = import_torch().tensor([1, 4, 0, 7])
  return {"y": op("embedding", F.embedding, tokens, _t(11, 8))}


def _linear_h(op, F):
  return op("linear", F.linear, _t(4, 6), _t(8, 6), _t(8))


def _conv_h(op, F):
  return op("conv2d", F.conv2d, _t(2, 3, 6, 6), _t(4, 3, 3, 3), _t(4))


@torch_equivalent(_LN)
def _(op, F):
  h = _linear_h(op, F)
  return {"h": h, "y": op("layer_norm", F.layer_norm, h, (8,), _t(8), _t(8))}


@torch_equivalent(_RMS)
def _(op, F):
  h = _linear_h(op, F)
  return {"h": h, "y": op("rms_norm", F.rms_norm, h, (8,), _t(8))}


@torch_equivalent(_GN)
def _(op, F):
  h = _conv_h(op, F)
  return {"h": h, "y": op("group_norm", F.group_norm, h, 2, _t(4), _t(4))}


def _batch_norm_equivalent(training):
  def equivalent(op, F):
    torch = import_torch()
    h = _conv_h(op, F)
    mean, var = torch.zeros(4), torch.ones(4)
    y = op("batch_norm", F.batch_norm, h, mean, var, _t(4), _t(4), training=training)
    if training:  # the float32 statistics were updated in place
      assert not bool(torch.all(mean == 0))
    return {"h": h, "y": y, "batch_stats": [mean, var]}

  return equivalent


torch_equivalent(_CONV_BN_TRAIN)(_batch_norm_equivalent(True))
torch_equivalent(_CONV_BN_EVAL)(_batch_norm_equivalent(False))


@torch_equivalent(_DROPOUT)
def _(op, F):
  h = _linear_h(op, F)
  return {"h": h, "y": op("dropout", F.dropout, h, 0.5, training=True)}


@torch_equivalent(_MHA)
def _(op, F):
  x = _t(2, 5, 8)
  q, k, v = (
    op("linear", F.linear, x, _t(8, 8), _t(8)).reshape(2, 5, 2, 4).transpose(1, 2) for _ in "qkv"
  )
  o = op("scaled_dot_product_attention", F.scaled_dot_product_attention, q, k, v)
  return {"y": op("linear", F.linear, o.transpose(1, 2).reshape(2, 5, 8), _t(8, 8), _t(8))}


@torch_equivalent("F.scaled_dot_product_attention(q, k, v, is_causal=True), q = F.linear(x, wq)")
def _(op, F):
  x = _t(2, 5, 8)
  q, k, v = (op("linear", F.linear, x, _t(8, 8)).reshape(2, 5, 2, 4).transpose(1, 2) for _ in "qkv")
  y = op("scaled_dot_product_attention", F.scaled_dot_product_attention, q, k, v, is_causal=True)
  return {"q": q, "y": y}


@torch_equivalent(_LSTM)
def _(op, F):
  torch = import_torch()
  h, c = op(
    "lstm_cell",
    torch.lstm_cell,
    _t(4, 6),
    (_t(4, 5), _t(4, 5)),
    _t(20, 6),
    _t(20, 5),
    _t(20),
    _t(20),
  )
  return {"h": h, "c": c, "y": h}


@torch_equivalent(_GRU)
def _(op, F):
  torch = import_torch()
  h = op("gru_cell", torch.gru_cell, _t(4, 6), _t(4, 5), _t(15, 6), _t(15, 5), _t(15), _t(15))
  return {"h": h, "y": h}


def _act(name, fn, **kw):
  def equivalent(op, F):
    h = _linear_h(op, F)
    return {"h": h, "y": op(name, fn(F), h, **kw)}

  return equivalent


torch_equivalent("F.relu(F.linear(x, w, b))")(_act("relu", lambda F: F.relu))
torch_equivalent("F.gelu(F.linear(x, w, b))")(_act("gelu", lambda F: F.gelu))
torch_equivalent("F.gelu(F.linear(x, w, b), approximate='tanh')")(
  _act("gelu", lambda F: F.gelu, approximate="tanh")
)
torch_equivalent("F.silu(F.linear(x, w, b))")(_act("silu", lambda F: F.silu))
torch_equivalent("torch.softmax(F.linear(x, w, b), -1)")(
  _act("softmax", lambda F: import_torch().softmax, dim=-1)
)
torch_equivalent("torch.mean(F.linear(x, w, b), -1)")(
  _act("mean", lambda F: import_torch().mean, dim=-1)
)


def _pool_equivalent(name):
  def equivalent(op, F):
    h = _conv_h(op, F)
    return {"h": h, "y": op(name, getattr(F, name), h, 2)}

  return equivalent


torch_equivalent(_AVG)(_pool_equivalent("avg_pool2d"))
torch_equivalent(_MAX)(_pool_equivalent("max_pool2d"))


@torch_equivalent("p = torch.softmax((q @ k.T).masked_fill(~causal, -inf), -1); p @ v")
def _(op, F):
  torch = import_torch()
  x = _t(5, 8)
  q, k, v = (op("matmul", torch.matmul, x, _t(8, 8)) for _ in "qkv")
  s = op("matmul", torch.matmul, q, k.T)
  causal = torch.tril(torch.ones(5, 5, dtype=torch.bool))
  masked = op("masked_fill", torch.Tensor.masked_fill, s, ~causal, -math.inf)
  probs = op("softmax", torch.softmax, masked, -1)
  return {"scores": s, "masked": masked, "probs": probs, "y": op("matmul", torch.matmul, probs, v)}


@torch_equivalent("torch.where(mask, F.linear(x, w, b), 0.0)")
def _(op, F):
  torch = import_torch()
  h = _linear_h(op, F)
  return {"h": h, "y": op("where", torch.where, _t(4, 8) > 0, h, 0.0)}


@torch_equivalent("F.linear(x, w, b) * (z > 0)")
def _(op, F):
  torch = import_torch()
  h = _linear_h(op, F)
  return {"h": h, "y": op("mul", torch.mul, h, _t(4, 8) > 0)}


def _index_equivalent(op_name, method, *, negate=False, **kw):
  def equivalent(op, F):
    torch = import_torch()
    h = op("matmul", torch.matmul, _t(4, 6), _t(6, 8))
    u = op("matmul", torch.matmul, _t(2, 6), _t(6, 8))
    if negate:
      u = op("neg", torch.neg, u)
    i = torch.tensor([0, 3])
    if op_name == "index_put":
      y = op(op_name, torch.Tensor.index_put, h, (i,), u, **kw)
    else:
      with warnings.catch_warnings():  # "index_reduce() is in beta"
        warnings.filterwarnings("ignore", "index_reduce", UserWarning)
        y = op(op_name, getattr(torch.Tensor, op_name), h, 0, i, u, method)
    return {"h": h, "y": y}

  return equivalent


torch_equivalent("h.index_put((i,), u)")(_index_equivalent("index_put", None))
torch_equivalent("h.index_put((i,), u, accumulate=True)")(
  _index_equivalent("index_put", None, accumulate=True)
)
torch_equivalent("h.index_put((i,), -u, accumulate=True)")(
  _index_equivalent("index_put", None, negate=True, accumulate=True)
)
for _method in ("amax", "amin", "prod"):
  torch_equivalent(f"h.index_reduce(0, i, u, '{_method}')")(
    _index_equivalent("index_reduce", _method)
  )


@torch_equivalent("h.index_fill(1, i, 0.0)")
def _(op, F):
  torch = import_torch()
  h = _linear_h(op, F)
  return {"h": h, "y": op("index_fill", torch.Tensor.index_fill, h, 1, torch.tensor([0]), 0.0)}


def _segment_equivalent(reduce):
  def equivalent(op, F):
    torch = import_torch()
    h = op("matmul", torch.matmul, _t(5, 6), _t(6, 8))
    m = op("index_select", torch.index_select, h, 0, torch.tensor(np.asarray(SENDERS)).long())
    r = torch.tensor(np.asarray(RECEIVERS)).long()[:, None].expand(-1, 8)
    zeros = op("new_zeros", torch.Tensor.new_zeros, m, (5, 8))
    y = op(
      "scatter_reduce", torch.Tensor.scatter_reduce, zeros, 0, r, m, reduce, include_self=False
    )
    return {"messages": m, "y": y}

  return equivalent


for _reduce in ("sum", "amax", "amin", "prod"):
  torch_equivalent(f"m.new_zeros(n, d).scatter_reduce(0, r, m, '{_reduce}')")(
    _segment_equivalent(_reduce)
  )


@torch_equivalent("torch.cummax(F.linear(x, w, b), 0)")
def _(op, F):
  torch = import_torch()
  h = _linear_h(op, F)
  return {"h": h, "y": op("cummax", torch.cummax, h, 0).values}


@torch_equivalent("s_t = a_t * s_(t-1) + b_t, a = torch.sigmoid(x @ wa), b = x @ wb")
def _(op, F):
  torch = import_torch()
  x = _t(4, 6)
  a = op("sigmoid", torch.sigmoid, op("matmul", torch.matmul, x, _t(6, 8)))
  b = op("matmul", torch.matmul, x, _t(6, 8))
  s = [b[0]]
  for t in range(1, 4):
    s.append(op("add", torch.add, op("mul", torch.mul, a[t], s[-1]), b[t]))
  return {"a": a, "y": op("stack", torch.stack, s)}


@torch_equivalent(
  "torch.topk(h @ router, 2); softmax; einsum(one_hot(i).float()) / einsum(experts[i])"
)
def _(op, F):
  torch = import_torch()
  h = op("matmul", torch.matmul, _t(4, 6), _t(6, 8))
  logits = op("matmul", torch.matmul, h, _t(8, 4))
  top = op("topk", torch.topk, logits, 2)
  gates = op("softmax", torch.softmax, top.values, -1)
  one_hot = F.one_hot(top.indices, 4).float()
  combine = op("sum", torch.sum, op("mul", torch.mul, gates[..., None], one_hot), 1)
  experts = _t(4, 8, 8)
  all_experts = op("einsum", torch.einsum, "bd,edf->bef", h, experts)
  chosen = op("einsum", torch.einsum, "bd,bkdf->bkf", h, experts[top.indices])
  return {
    "router_logits": logits,
    "top_values": top.values,
    "gates": gates,
    "one_hot_out": op("einsum", torch.einsum, "be,bef->bf", combine, all_experts),
    "gather_out": op("sum", torch.sum, op("mul", torch.mul, gates[..., None], chosen), 1),
  }


@torch_equivalent("for _ in range(3): h = torch.tanh(F.linear(h, w, b))")
def _(op, F):
  torch = import_torch()
  h, w, b = _t(4, 6), _t(6, 6), _t(6)
  for _ in range(3):
    h = op("tanh", torch.tanh, op("linear", F.linear, h, w, b))
  return {"y": h}


@torch_equivalent("for x_t in xs: h = torch.tanh(F.linear(x_t, w, b) + h @ u)")
def _(op, F):
  torch = import_torch()
  h, w, b, u = torch.zeros(4, 8), _t(8, 6), _t(8), _t(8, 8)
  ys = []
  for x_t in _t(3, 4, 6):
    lin = op("add", torch.add, op("linear", F.linear, x_t, w, b), op("matmul", torch.matmul, h, u))
    h = op("tanh", torch.tanh, lin)
    ys.append(h)
  return {"carry": h, "ys": op("stack", torch.stack, ys)}


@torch_equivalent("torch.vmap(F.linear), torch.softmax")
def _(op, F):
  torch = import_torch()
  w, b = _t(8, 6), _t(8)
  lin = torch.vmap(lambda x: op("linear", F.linear, x, w, b))(_t(4, 6))
  return {"linear": lin, "softmax": op("softmax", torch.softmax, lin, -1)}


def _torch_dtypes(out):
  torch = import_torch()
  to_np = {torch.float16: F16, torch.float32: F32}
  leaves = lambda v: v if isinstance(v, list) else [v]
  return {k: sorted({str(to_np[t.dtype]) for t in leaves(v)}) for k, v in out.items()}


def test_every_torch_expression_has_an_equivalent():
  assert {expr for expr, _ in TORCH_CUDA_ZOO.values()} == set(_TORCH)


@pytest.mark.parametrize("name", sorted(TORCH_CUDA_ZOO))
def test_torch_cuda_policy_gives_the_tabled_dtypes(name):
  torch = import_torch()
  expr, want = TORCH_CUDA_ZOO[name]
  torch.manual_seed(0)
  out = _TORCH[expr](_cuda, torch.nn.functional)
  got = _torch_dtypes(out)
  assert {k: got[k] for k in want} == {k: [str(d)] for k, d in want.items()}


#: The equivalents whose every op is in the same list on CPU as on CUDA (linear, conv1d,
#: conv2d, conv_transpose2d, matmul, einsum, scaled_dot_product_attention are lower
#: precision on both; relu, gelu, silu, dropout, embedding, index ops, scatter_reduce, topk,
#: cummax, masked_fill, where in neither): torch.autocast("cpu") itself must agree.
CPU_AGREES = (
  _LINEAR,
  _CONV1D,
  _CONV2D,
  _CONVT,
  _EMBED,
  _DROPOUT,
  _MHA,
  "F.relu(F.linear(x, w, b))",
  "F.gelu(F.linear(x, w, b))",
  "F.gelu(F.linear(x, w, b), approximate='tanh')",
  "F.silu(F.linear(x, w, b))",
  "torch.where(mask, F.linear(x, w, b), 0.0)",
  "F.linear(x, w, b) * (z > 0)",
  "h.index_reduce(0, i, u, 'amax')",
  "h.index_fill(1, i, 0.0)",
  "m.new_zeros(n, d).scatter_reduce(0, r, m, 'amax')",
  "torch.cummax(F.linear(x, w, b), 0)",
  "F.scaled_dot_product_attention(q, k, v, is_causal=True), q = F.linear(x, wq)",
)


@pytest.mark.parametrize("expr", CPU_AGREES)
def test_the_emulation_is_torch_cpu_autocast_where_the_lists_agree(expr):
  torch = import_torch()
  torch.manual_seed(0)
  emulated = _TORCH[expr](_cuda, torch.nn.functional)
  torch.manual_seed(0)
  with torch.autocast("cpu", dtype=torch.float16):
    real = _TORCH[expr](_plain, torch.nn.functional)
  assert _torch_dtypes(real) == _torch_dtypes(emulated)
  for k in emulated:
    torch.testing.assert_close(real[k], emulated[k], rtol=0, atol=0, msg=k)
