"""Each shipped registration, and a user's ``autocast_op``, under each transformation.

A registration holds when the op, called inside ``jax.vmap``, ``jax.jit``, ``jax.checkpoint``,
``lax.scan`` or ``jax.grad`` (nested in either order) inside an autocast function, gives
what the plain call gives: the same dtype and the same bits. The op's input is a float16
matmul result (float32 as declared), the case where a ``"promote"`` op under ``vmap``
ran in float32 (issue 33). The guide's layer table is checked under ``vmap`` too.
"""

from pathlib import Path
import re

from conftest import import_optional
from helpers import rand
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_lossscale as jls
from jax_lossscale._autocast import _registrations

F16, F32 = np.dtype(jnp.float16), np.dtype(jnp.float32)
B, D = 4, 8  # batch, features


# -- the cases: (params, per-example function of (params, h), expected dtype) -------------
#
# ``h`` is the per-example row of ``x @ w``: float16 under autocast, float32 as declared.


def _mod(module):
  return import_optional("flax.linen") if module == "linen" else import_optional("flax.nnx")


def _attention():
  def op(p, h):  # one example: (T, N, H) = (2, 1, 4) from the 8 features
    q = h.reshape(2, 1, 4)
    return jax.nn.dot_product_attention(q, q, q).reshape(-1)

  return None, op, F16


def _eqx_cell(name):
  eqx = import_optional("equinox")
  cell = getattr(eqx.nn, name)(D, 3, key=jax.random.key(3))

  def op(m, h):
    carry = (jnp.zeros(3), jnp.zeros(3)) if name == "LSTMCell" else jnp.zeros(3)
    out = m(h, carry)
    return jnp.concatenate(out) if isinstance(out, tuple) else out

  return cell, op, F16


def _eqx_batchnorm():
  eqx = import_optional("equinox")
  bn, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(
    D, axis_name="batch", inference=True, mode="batch"
  )
  bn = eqx.tree_at(lambda m: m.bias, bn, rand(4, (D,)))

  def op(m, h):
    return m[0](h, m[1])[0]

  return (bn, state), op, F16


def _nnx_cell(name):
  nnx = import_optional("flax.nnx")
  # nnx's SimpleCell computes in float32 unless told (dtype=float32 by default, where the
  # other cells follow their inputs); inside the op, the module's own dtype stands.
  kwargs = {"dtype": None} if name == "SimpleCell" else {}
  cell = getattr(nnx, name)(D, 3, rngs=nnx.Rngs(0), **kwargs)
  graphdef, state = nnx.split(cell)

  def op(s, h):
    m = nnx.merge(graphdef, s)
    carry = m.initialize_carry((D,), nnx.Rngs(1)) if name != "SimpleCell" else jnp.zeros(3)
    carry, out = m(carry, h)
    return out

  return state, op, F16


def _nnx_batchnorm():
  nnx = import_optional("flax.nnx")
  bn = nnx.BatchNorm(D, use_running_average=True, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(bn)
  return state, lambda s, h: nnx.merge(graphdef, s)(h), F16


def _linen_cell(name):
  nn = import_optional("flax.linen")
  cell = getattr(nn, name)(3)
  carry = cell.initialize_carry(jax.random.key(0), (D,))
  variables = cell.init(jax.random.key(1), carry, jnp.ones(D))

  def op(v, h):
    return cell.apply(v, cell.initialize_carry(jax.random.key(0), (D,)), h)[1]

  return variables, op, F16


def _linen_batchnorm():
  nn = import_optional("flax.linen")
  bn = nn.BatchNorm(use_running_average=True)
  variables = bn.init(jax.random.key(0), jnp.ones((2, D)))
  return variables, lambda v, h: bn.apply(v, h), F16


def _user(rule):
  op = jls.autocast_op(lambda a: jnp.tanh(a) * a + jnp.exp(a) / 4.0, rule=rule)
  expected = {"lower": F16, "promote": F16, "float32": F32, "float32_compute": F16}[rule]
  return None, lambda p, h: op(h), expected


CASES = {
  "jax.nn.gelu": lambda: (None, lambda p, h: jax.nn.gelu(h), F16),
  "flax.linen.gelu": lambda: (None, lambda p, h: _mod("linen").gelu(h), F16),
  "flax.nnx.gelu": lambda: (None, lambda p, h: _mod("nnx").gelu(h), F16),
  "jax.nn.dot_product_attention": _attention,
  "equinox.nn.LSTMCell": lambda: _eqx_cell("LSTMCell"),
  "equinox.nn.GRUCell": lambda: _eqx_cell("GRUCell"),
  "equinox.nn.BatchNorm": _eqx_batchnorm,
  "flax.nnx.LSTMCell": lambda: _nnx_cell("LSTMCell"),
  "flax.nnx.OptimizedLSTMCell": lambda: _nnx_cell("OptimizedLSTMCell"),
  "flax.nnx.GRUCell": lambda: _nnx_cell("GRUCell"),
  "flax.nnx.SimpleCell": lambda: _nnx_cell("SimpleCell"),
  "flax.nnx.BatchNorm": _nnx_batchnorm,
  "flax.linen.LSTMCell": lambda: _linen_cell("LSTMCell"),
  "flax.linen.OptimizedLSTMCell": lambda: _linen_cell("OptimizedLSTMCell"),
  "flax.linen.GRUCell": lambda: _linen_cell("GRUCell"),
  "flax.linen.MGUCell": lambda: _linen_cell("MGUCell"),
  "flax.linen.SimpleCell": lambda: _linen_cell("SimpleCell"),
  "flax.linen.BatchNorm": _linen_batchnorm,
  "autocast_op lower": lambda: _user("lower"),
  "autocast_op promote": lambda: _user("promote"),
  "autocast_op float32": lambda: _user("float32"),
  "autocast_op float32_compute": lambda: _user("float32_compute"),
}

#: Each registration of ``_registrations.registrations()`` has a case.
_REGISTERED = {
  f"{m}.{a.removesuffix('.__call__')}" for m, a, *_ in jls._autocast._registrations.registrations()
}


def test_every_registration_has_a_case():
  assert _REGISTERED <= set(CASES)


# -- the transformations: each maps f(p, h) per example to g(p, hs) over the batch ----------


def _loop(f):  # the reference: the plain call on each example
  return lambda p, hs: jnp.stack([f(p, hs[i]) for i in range(hs.shape[0])])


def _vmap(f):
  return lambda p, hs: jax.vmap(lambda h: f(p, h), axis_name="batch")(hs)


def _jit(f):  # the params closed over (an Equinox module holds non-arrays)
  return lambda p, h: jax.jit(lambda h: f(p, h))(h)


def _remat(f):
  return lambda p, h: jax.checkpoint(lambda h: f(p, h))(h)


def _scan(f):
  return lambda p, hs: lax.scan(lambda c, h: (c, f(p, h)), 0, hs)[1]


def _scan_vmap(f):  # a scan over chunks of the batch, vmap inside
  def g(p, hs):
    chunks = hs.reshape(2, -1, *hs.shape[1:])
    ys = lax.scan(lambda c, h: (c, _vmap(f)(p, h)), 0, chunks)[1]
    return ys.reshape(-1, *ys.shape[2:])

  return g


def _grad(f):  # the op's output as the aux of a gradient taken inside the autocast function
  def g(p, h):
    def loss(h):
      y = f(p, h)
      return jnp.sum(y.astype(jnp.float32) ** 2), y

    return jax.grad(loss, has_aux=True)(h)[1]

  return g


TRANSFORMS = {
  "vmap": lambda f: _vmap(f),
  "jit": lambda f: _loop(_jit(f)),
  "remat": lambda f: _loop(_remat(f)),
  "scan": _scan,
  "grad": lambda f: _loop(_grad(f)),
  "jit(vmap)": lambda f: _jit(_vmap(f)),
  "vmap(jit)": lambda f: _vmap(_jit(f)),
  "remat(vmap)": lambda f: _remat(_vmap(f)),
  "vmap(remat)": lambda f: _vmap(_remat(f)),
  "scan(vmap)": _scan_vmap,
  "grad(vmap)": lambda f: _grad(_vmap(f)),
  "vmap(grad)": lambda f: _vmap(_grad(f)),
  "grad(scan)": lambda f: _grad(_scan(f)),
  "vmap(vmap)": lambda f: lambda p, hs: _vmap(_vmap(f))(p, hs.reshape(2, -1, D)).reshape(B, -1),
}

#: The cases run under every transformation; the others (the same wrappers, another
#: module) under vmap, grad(vmap), jit(vmap) and scan.
_FULL = {
  "jax.nn.gelu",
  "jax.nn.dot_product_attention",
  "equinox.nn.LSTMCell",
  "equinox.nn.BatchNorm",
  "flax.nnx.LSTMCell",
  "flax.nnx.BatchNorm",
  "flax.linen.LSTMCell",
  "flax.linen.BatchNorm",
  "autocast_op lower",
  "autocast_op promote",
  "autocast_op float32",
  "autocast_op float32_compute",
}
_SHORT = ("vmap", "grad(vmap)", "jit(vmap)", "scan")

#: The cases that need the batch axis (a batch norm's ``axis_name``): under vmap only.
_VMAP_ONLY = {"equinox.nn.BatchNorm"}


def _model(transform, f):
  g = transform(f)
  return lambda p, w, x: g(p, x @ w)


@pytest.mark.parametrize("name", sorted(CASES))
def test_registration_holds_under_each_transformation(name):
  params, f, expected = CASES[name]()
  x, w = rand(0, (B, D)), rand(1, (D, D), 0.5)
  base = _vmap if name in _VMAP_ONLY else _loop
  names = [
    t
    for t in (TRANSFORMS if name in _FULL else _SHORT)
    if name not in _VMAP_ONLY or ("vmap" in t and t not in ("scan(vmap)", "vmap(vmap)"))
  ]
  models = [_model(base, f), *(_model(TRANSFORMS[t], f) for t in names)]
  # one autocast function computes them all (one compilation)
  ref, *outs = jls.autocast(lambda p, w, x: [m(p, w, x) for m in models])(params, w, x)
  assert ref.dtype == expected, name
  for tname, out in zip(names, outs, strict=True):
    assert out.dtype == expected, (name, tname, out.dtype)
    if expected == F32:
      # A float32 result is compared to a few ulps: XLA:CPU on jax 0.12 rounds float32
      # tanh and exp differently in a batched program than in a per-row one (2 ulps here),
      # with autocast or without it. Its dtype above is the registration's check.
      np.testing.assert_array_max_ulp(np.asarray(out), np.asarray(ref), maxulp=4)
    elif "scan" in tname:
      # A float16 chain in a scan body is fused apart from the per-row reference, and an
      # XLA:CPU with native float16 arithmetic (AVX512-FP16) rounds some of its steps in
      # float16 there and not in the other: plain JAX without autocast gives the scan and
      # the loop of `tanh(a) * a + exp(a) / 4` 1 ulp apart on such a CPU. The dtype above
      # is the registration's check; every other transformation stays bit for bit.
      np.testing.assert_array_max_ulp(np.asarray(out), np.asarray(ref), maxulp=1)
    else:
      np.testing.assert_array_equal(np.asarray(out), np.asarray(ref), err_msg=f"{name} {tname}")


def test_gelu_under_vmap_is_the_plain_calls_float16_bits():
  # issue 33: the vmapped gelu ran in float32 (its batched marker ran on its declared
  # float32 inputs); it is the plain call's float16, bit for bit.
  x, w = rand(0, (4, 8)), rand(1, (8, 8))
  plain = jls.autocast(lambda x, w: jax.nn.gelu(x @ w))(x, w)
  mapped = jls.autocast(lambda x, w: jax.vmap(jax.nn.gelu)(x @ w))(x, w)
  assert plain.dtype == mapped.dtype == F16
  np.testing.assert_array_equal(np.asarray(mapped), np.asarray(plain))


def test_gelu_under_grad_inside_autocast_runs():
  # The partially evaluated marker (primal and residual outputs, the primal's inputs) was
  # taken for the op itself: a zip of its outputs failed.
  x = jnp.linspace(-2.0, 2.0, 12).reshape(3, 4)
  w = rand(1, (4, 4))
  grad = jls.autocast(jax.grad(lambda x: jnp.sum(jax.nn.gelu(x @ w))))(x)
  ref = jax.grad(jls.autocast(lambda x: jnp.sum(jax.nn.gelu(x @ w))))(x)
  np.testing.assert_allclose(grad.astype(jnp.float32), ref, rtol=2e-3, atol=2e-3)


def test_a_transposed_linear_op_is_not_taken_for_the_op():
  # A linear op's transpose takes and returns arrays of the op's own shapes: it is told
  # from the op by its jaxpr, not by its shapes.
  a = rand(2, (4, 4)).astype(jnp.float16)
  op = jls.autocast_op(lambda x: x @ a)
  c = rand(3, (3, 4))

  def loss(x):
    return jnp.sum(op(x).astype(jnp.float32) * c)

  x = rand(4, (3, 4))
  inside = jls.autocast(jax.grad(loss))(x)
  np.testing.assert_allclose(inside, c @ a.T.astype(jnp.float32), rtol=1e-2, atol=1e-2)


def test_an_equinox_mlp_written_per_token_runs_its_gelu_in_float16():
  eqx = import_optional("equinox")
  mlp = eqx.nn.MLP(8, 8, 16, 2, activation=jax.nn.gelu, key=jax.random.key(0))
  lin = eqx.nn.Linear(8, 4, key=jax.random.key(1))
  x = rand(2, (3, 5, 8))

  def model(m, x):  # per token: vmap over the batch and the tokens
    mlp, lin = m
    return jax.vmap(jax.vmap(lambda t: lin(mlp(t))))(x)

  def dtypes_of(fn, name):
    jaxpr = jax.make_jaxpr(lambda x: jls.autocast(fn)((mlp, lin), x))(x)
    return [
      (tuple(str(v.aval.dtype) for v in e.invars), tuple(str(v.aval.dtype) for v in e.outvars))
      for e in _all_eqns(jaxpr.jaxpr)
      if e.primitive.name == name
    ]

  out = jls.autocast(model)((mlp, lin), x)
  assert out.dtype == F16
  # every tanh of the gelus runs in float16, as the plain call's; none in float32
  tanhs = dtypes_of(model, "tanh")
  assert tanhs and all(d == (("float16",), ("float16",)) for d in tanhs), tanhs
  # and the same bits as the MLP applied to the whole batch at once
  batched = jls.autocast(lambda m, x: jax.vmap(m[1])(jax.vmap(m[0])(x.reshape(-1, 8))))
  np.testing.assert_array_equal(np.asarray(out).reshape(-1, 4), np.asarray(batched((mlp, lin), x)))


def _all_eqns(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn
    subs = getattr(jax.extend.core, "jaxprs_in_params", None) or jax._src.core.jaxprs_in_params
    for sub in subs(eqn.params):
      yield from _all_eqns(sub)


# -- the guide's layer table, each row written per example under vmap -------------------


def _layer_rows():
  eqx = import_optional("equinox")
  key = iter(range(50, 100))
  lin = eqx.nn.Linear(D, D, key=jax.random.key(next(key)))
  cell = eqx.nn.GRUCell(D, D, key=jax.random.key(next(key)))
  bn, bn_state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(D, axis_name="batch", mode="batch")
  emb, wv = rand(next(key), (11, D)), rand(next(key), (D, D))
  mask = jnp.asarray([True, False] * (D // 2))

  def ln(h):
    mu = jnp.mean(h, -1, keepdims=True)
    return (h - mu) * lax.rsqrt(jnp.mean(jnp.square(h - mu), -1, keepdims=True) + 1e-5)

  def scores(h):
    q = h.reshape(2, D // 2)
    return q @ q.T / np.sqrt(D // 2)

  # each row: a function of one example's h (float16, a matmul's output) and its token id
  return {
    "embedding": lambda h, i: emb[i],
    "LayerNorm, RMSNorm, GroupNorm": lambda h, i: ln(h),
    "BatchNorm (train and eval)": lambda h, i: bn(h, bn_state)[0],
    "Linear, Dense, Conv, ConvTranspose (bias inside)": lambda h, i: lin(h),
    "attention scores `q @ k.T / sqrt(d)`": lambda h, i: scores(h),
    "causal mask on the scores": lambda h, i: jnp.where(
      jnp.tril(jnp.ones((2, 2), bool)), scores(h), -1e4
    ),
    "softmax": lambda h, i: jax.nn.softmax(h),
    "attention `p @ v`, MultiHeadAttention, `dot_product_attention`": lambda h, i: (
      jax.nn.dot_product_attention(
        h.reshape(2, 1, D // 2), h.reshape(2, 1, D // 2), h.reshape(2, 1, D // 2)
      )
    ),
    "residual `x + linear(h)`": lambda h, i: emb[i] + lin(h),
    "dropout": lambda h, i: jnp.where(mask, h / 0.5, 0.0),
    "ReLU, SiLU, GELU (erf)": lambda h, i: jax.nn.gelu(
      jax.nn.silu(jax.nn.relu(h)), approximate=False
    ),
    "GELU (tanh approximation)": lambda h, i: jax.nn.gelu(h),
    "LSTM, GRU cells (one step)": lambda h, i: cell(h, jnp.zeros(D)),
    "average and max pooling": lambda h, i: _pool(h),
    "scatters, `segment_sum` of float16 messages": lambda h, i: jax.ops.segment_sum(
      h, jnp.arange(D) % 3, 3
    ),
    "cross-entropy": lambda h, i: -jax.nn.log_softmax(h @ wv)[i % D],
  }


def _pool(h):  # as flax's avg_pool and max_pool: reduce_window sums and maxima
  avg = lax.reduce_window(h, 0.0, lax.add, (2,), (2,), "VALID") * 0.5
  return avg + lax.reduce_window(h, -jnp.inf, lax.max, (2,), (2,), "VALID")


def test_the_guides_layer_table_holds_under_vmap():
  text = (Path(__file__).resolve().parents[2] / "docs/guides/autocast.md").read_text()
  body = text.split("<!-- layers-table:start -->\n")[1].split("<!-- layers-table:end -->")[0]
  rows = [
    [c.strip() for c in line.strip().strip("|").split("|")]
    for line in body.strip().splitlines()[2:]
  ]
  want = {row[0]: re.match(r"(float16|float32)", row[3]).group(1) for row in rows}
  fns = _layer_rows()
  assert set(want) == set(fns)
  x, w = rand(0, (B, D)), rand(1, (D, D), 0.5)
  ids = jnp.arange(B)

  def model(w, x, ids):
    h = x @ w
    return {name: jax.vmap(f, axis_name="batch")(h, ids) for name, f in fns.items()}

  got = jls.autocast(model)(w, x, ids)
  assert {k: str(v.dtype) for k, v in got.items()} == want


# -- the batch norms' call arguments and statistics --------------------------------------
#
# A registered batch norm is one op of the call as written: its keyword arguments reach
# the module, its output is the float32 module's output on the float16 activation, cast
# to float16, and the statistics a training call writes come back, bit for bit.


def _half_activation(x, w):  # what autocast computes for `x @ w`, as float32
  return (x.astype(F16) @ w.astype(F16)).astype(F32)


@pytest.mark.parametrize("train", [True, False])
def test_a_linen_batch_norm_takes_its_call_keywords_and_writes_its_statistics(train):
  nn = import_optional("flax.linen")

  class Net(nn.Module):
    @nn.compact
    def __call__(self, h, train):
      return nn.BatchNorm(momentum=0.5)(h, use_running_average=not train)

  net = Net()
  x, w = rand(0, (B, D)), rand(1, (D, D), 0.5)
  variables = net.init(jax.random.key(0), x, train=False)
  mutable = ["batch_stats"] if train else False
  out = jls.autocast(lambda v, x, w: net.apply(v, x @ w, train=train, mutable=mutable))(
    variables, x, w
  )
  ref = jax.jit(lambda v, h: net.apply(v, h, train=train, mutable=mutable))(
    variables, _half_activation(x, w)
  )
  if train:
    (out, updates), (ref, ref_updates) = out, ref
    stats = jax.tree.leaves(updates)
    assert len(stats) == 2 and all(s.dtype == F32 for s in stats)
    jax.tree.map(np.testing.assert_array_equal, updates, ref_updates)
    assert not np.array_equal(updates["batch_stats"]["BatchNorm_0"]["mean"], np.zeros(D))
  assert out.dtype == F16
  np.testing.assert_array_equal(np.asarray(out), np.asarray(ref.astype(F16)))


def test_a_linen_models_init_under_autocast_gives_the_models_variables():
  # While `init` runs, the registered cells and batch norms are the modules as written
  # (their variables are being created): the variables are init's, keywords included.
  nn = import_optional("flax.linen")

  class Net(nn.Module):
    @nn.compact
    def __call__(self, h, train):
      carry = (jnp.zeros((h.shape[0], 3)),) * 2
      _, y = nn.LSTMCell(3)(carry, h)
      return nn.BatchNorm()(y, use_running_average=not train)

  net = Net()
  x = rand(0, (B, D))
  ref = net.init(jax.random.key(0), x, train=False)
  got = jls.autocast(net.init)(jax.random.key(0), x, train=False)
  assert jax.tree.structure(got) == jax.tree.structure(ref)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
    assert a.dtype == b.dtype == F32
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_batch_norm_inside_a_users_op_runs_as_written_with_its_keywords():
  # Inside an autocast_op, autocast is off: a registered module there is the module as
  # written, called with the keywords given (here, the running averages).
  nn = import_optional("flax.linen")
  nnx = import_optional("flax.nnx")
  x, w = rand(0, (B, D)), rand(1, (D, D), 0.5)
  h = _half_activation(x, w)

  linen_bn = nn.BatchNorm(momentum=0.5)
  variables = linen_bn.init(jax.random.key(0), x, use_running_average=True)
  variables = jax.tree.map(lambda v: v + 0.25, variables)  # running stats that are not 0, 1
  linen_op = jls.autocast_op(
    lambda v, h: linen_bn.apply(v, h, use_running_average=True), rule="float32_compute", primary=1
  )
  out = jls.autocast(lambda v, x, w: linen_op(v, x @ w))(variables, x, w)
  ref = jax.jit(lambda v, h: linen_bn.apply(v, h, use_running_average=True))(variables, h)
  assert out.dtype == F16
  np.testing.assert_array_equal(np.asarray(out), np.asarray(ref.astype(F16)))

  nnx_bn = nnx.BatchNorm(D, use_running_average=False, rngs=nnx.Rngs(0))
  nnx_op = jls.autocast_op(lambda h: nnx_bn(h, use_running_average=True), rule="float32_compute")
  out = jls.autocast(lambda x, w: nnx_op(x @ w))(x, w)
  ref = jax.jit(lambda h: nnx_bn(h, use_running_average=True))(h)
  assert out.dtype == F16
  np.testing.assert_array_equal(np.asarray(out), np.asarray(ref.astype(F16)))
  # the op read the running averages: no statistics were written
  np.testing.assert_array_equal(np.asarray(nnx_bn.mean[...]), np.zeros(D, F32))


def test_an_nnx_batch_norm_takes_its_call_keywords_and_writes_its_statistics():
  nnx = import_optional("flax.nnx")
  x, w = rand(0, (B, D)), rand(1, (D, D), 0.5)
  h = _half_activation(x, w)

  def make():
    return nnx.BatchNorm(D, use_running_average=False, momentum=0.5, rngs=nnx.Rngs(0))

  for kwargs in ({}, {"use_running_average": True}):
    graphdef, state = nnx.split(make())

    def f(state, x, w, kwargs=kwargs, graphdef=graphdef):
      m = nnx.merge(graphdef, state)
      return m(x @ w, **kwargs), nnx.state(m)

    out, new_state = jls.autocast(f)(state, x, w)
    ref_module = make()
    ref = ref_module(h, **kwargs)
    assert out.dtype == F16, kwargs
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref.astype(F16)), err_msg=str(kwargs))
    # training wrote the statistics of the float16 activation; evaluation left them alone
    for name in ("mean", "var"):
      got, want = np.asarray(new_state[name][...]), np.asarray(ref_module.__dict__[name][...])
      assert got.dtype == F32
      np.testing.assert_array_equal(got, want, err_msg=f"{name} {kwargs}")
    assert np.array_equal(np.asarray(new_state["mean"][...]), np.zeros(D)) == bool(kwargs)


# A nested autocast (an autocast function called inside another's trace) shares the
# outer one's registrations: it installs none of its own, and leaving it removes none.


def test_a_nested_autocast_leaves_the_registrations_installed_and_then_restores_them():
  gelu = jax.nn.gelu
  x, w, v = rand(0, (4, 8)), rand(1, (8, 8)), rand(2, (3,))

  def outer(x, w, v):
    inner = jls.autocast(lambda u: u * 2.0)(v)  # a nested autocast, ended here
    return inner, jax.nn.gelu(x @ w)  # still the registration: one float16 op

  _, got = jls.autocast(outer)(x, w, v)
  want = jls.autocast(lambda x, w: jax.nn.gelu(x @ w))(x, w)
  assert got.dtype == want.dtype == F16
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert jax.nn.gelu is gelu  # the function as written, once autocast is done


def test_a_registration_whose_module_or_attribute_is_absent_is_skipped(monkeypatch):
  # A registration is installed only on a module already imported that has the
  # attribute: one of a module never imported, of a function the module lacks or of a
  # class it lacks is skipped, and the others are installed as before.
  def never(original):
    raise AssertionError(f"installed on {original!r}")

  absent = (
    _registrations.Registration("jls_module_never_imported", "gelu", never, "`gelu`"),
    _registrations.Registration("jax.nn", "jls_no_such_function", never, "none"),
    _registrations.Registration("jax.nn", "JlsNoSuchClass.__call__", never, "none"),
  )
  monkeypatch.setattr(_registrations, "_REGISTRATIONS", (*absent, *_registrations._REGISTRATIONS))
  gelu = jax.nn.gelu
  x, w = rand(0, (4, 8)), rand(1, (8, 8))
  got = jls.autocast(lambda x, w: jax.nn.gelu(x @ w))(x, w)
  assert got.dtype == F16  # gelu's registration ("promote") is installed: one float16 op
  h = x.astype(jnp.float16) @ w.astype(jnp.float16)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.nn.gelu(h)))
  assert jax.nn.gelu is gelu
  assert not hasattr(jax.nn, "jls_no_such_function")
