"""check_underflow on real models under autocast, against a direct measurement (issue 33).

The direct measurement: the model is split at the tapped activation (the logits), the
activation computed under autocast, and the float16 gradient of the rest of the model
with respect to it compared with the float32 gradient of the float32 model's: the share
of the float32 gradient's non-zero elements that float16 returns as 0. The check's
fraction for that activation's automatic tap must be that share, exactly.

* a small GPT, its blocks unrolled and scanned (the scanned form's blocks are tapped once
  per iteration, see ``test_underflow_scan.py``);
* an Equinox MLP applied per token with ``jax.vmap``;
* a Flax linen model whose blocks are an ``nn.scan``.
"""

from conftest import import_optional
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_lossscale as jls
from jax_lossscale.diagnostics import check_underflow

V, T, D, L, BATCH = 32, 8, 16, 2, 4
SMALL = 2e-5  # the loss's scale: the logits' gradients near float16's subnormals


def _rand(key, shape, scale=1.0):
  return scale * jax.random.normal(jax.random.key(key), shape, jnp.float32)


def _xent(logits, y):
  logp = jax.nn.log_softmax(logits, axis=-1)
  return -SMALL * jnp.mean(jnp.take_along_axis(logp, y[..., None], axis=-1))


def _flushed(head, act16, act32):
  """The share of the float32 gradient's non-zero elements float16 returns as 0."""
  g16 = jax.grad(lambda a: jls.autocast(head)(a).astype(jnp.float32))(act16)
  g32 = jax.grad(head)(act32)
  nz = g32 != 0
  return int(jnp.sum(nz & (g16 == 0))) / int(jnp.sum(nz))


# -- a small GPT ------------------------------------------------------------------------


def _gpt_params():
  keys = iter(range(100))
  blocks = [
    {
      "qkv": _rand(next(keys), (D, 3 * D), 0.2),
      "proj": _rand(next(keys), (D, D), 0.2),
      "fc": _rand(next(keys), (D, 4 * D), 0.2),
      "out": _rand(next(keys), (4 * D, D), 0.1),
      "ln": jnp.ones(D),
    }
    for _ in range(L)
  ]
  return {"emb": _rand(100, (V, D)), "pos": _rand(101, (T, D), 0.1), "blocks": blocks}


def _norm(h, g):
  mu = jnp.mean(h, -1, keepdims=True)
  return (h - mu) * lax.rsqrt(jnp.mean(jnp.square(h - mu), -1, keepdims=True) + 1e-5) * g


def _block(h, p):
  q, k, v = jnp.split(_norm(h, p["ln"]) @ p["qkv"], 3, axis=-1)
  scores = jnp.einsum("btd,bsd->bts", q, k) / np.sqrt(D)
  mask = jnp.tril(jnp.ones((T, T), bool))
  scores = jnp.where(mask, scores, -1e9)
  h = h + jax.nn.softmax(scores, -1) @ v @ p["proj"]
  return h + jax.nn.gelu(_norm(h, p["ln"]) @ p["fc"]) @ p["out"]


def _gpt_body(params, x, scanned):
  h = params["emb"][x] + params["pos"]
  if scanned:
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *params["blocks"])
    h, _ = lax.scan(lambda h, p: (_block(h, p), None), h, stacked)
  else:
    for p in params["blocks"]:
      h = _block(h, p)
  return h @ params["emb"].T  # the logits


def _batch():
  x = jax.random.randint(jax.random.key(7), (BATCH, T), 0, V)
  return x, jnp.roll(x, -1, axis=1)


@pytest.mark.parametrize("scanned", [False, True])
def test_gpt_logits_fraction_is_the_direct_measurement(scanned):
  params, (x, y) = _gpt_params(), _batch()

  def loss(params, batch):
    return _xent(_gpt_body(params, batch[0], scanned), batch[1])

  report = check_underflow(jls.autocast(loss), params, (x, y))
  acts = report.looked_at()["activations"]
  # the last lower-precision output: the logits' matmul
  logits_leaf = max(acts, key=lambda k: int(k.rsplit("#", 1)[1]))
  assert int(report.nonzero[logits_leaf]) == BATCH * T * V
  body = lambda p, x: _gpt_body(p, x, scanned)
  direct = _flushed(lambda lg: _xent(lg, y), jls.autocast(body)(params, x), body(params, x))
  assert report.fractions()[logits_leaf] == direct
  assert direct > 0.05  # the case is one that flushes
  # each block's qkv, scores, p @ v, proj, fc, out (inside the scan: once per iteration),
  # and the logits
  assert len(acts) == 6 * L + 1
  assert sum("scan#0[" in k for k in acts) == (6 * L if scanned else 0)
  assert report.not_checked == {}
  print(f"GPT scanned={scanned}: {report.verdict()}  direct logits: {direct:.2%}")


# -- an Equinox MLP, per token ------------------------------------------------------------


def test_equinox_per_token_mlp_fraction_is_the_direct_measurement():
  eqx = import_optional("equinox")
  mlp = eqx.nn.MLP(D, V, 4 * D, 2, activation=jax.nn.gelu, key=jax.random.key(0))
  x = _rand(1, (BATCH, T, D))
  y = jax.random.randint(jax.random.key(2), (BATCH, T), 0, V)

  def loss(m, batch):
    x, y = batch
    return _xent(jax.vmap(jax.vmap(m))(x), y)

  report = check_underflow(jls.autocast(loss), mlp, (x, y))
  acts = report.looked_at()["activations"]
  assert len(acts) == 3  # the three Linear layers' matmuls
  logits_leaf = max(acts, key=lambda k: int(k.rsplit("#", 1)[1]))
  assert int(report.nonzero[logits_leaf]) == BATCH * T * V
  body = lambda m, x: jax.vmap(jax.vmap(m))(x)
  direct = _flushed(lambda lg: _xent(lg, y), jls.autocast(body)(mlp, x), body(mlp, x))
  assert report.fractions()[logits_leaf] == direct
  assert direct > 0.05
  print(f"Equinox MLP: {report.verdict()}  direct logits: {direct:.2%}")


# -- a Flax linen model with nn.scan -----------------------------------------------------


def test_linen_nn_scan_model_fraction_is_the_direct_measurement():
  nn = import_optional("flax.linen")

  class Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
      return h + nn.Dense(D)(jax.nn.gelu(nn.Dense(2 * D)(nn.LayerNorm()(h)))), None

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.Embed(V, D)(x)
      blocks = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=L)
      h, _ = blocks()(h, None)
      return nn.Dense(V, use_bias=False)(h)

  model = Model()
  x, y = _batch()
  variables = model.init(jax.random.key(0), x)

  def loss(v, batch):
    return _xent(model.apply(v, batch[0]), batch[1])

  report = check_underflow(jls.autocast(loss), variables, (x, y))
  acts = [k for k in report.looked_at()["activations"] if "scan#" not in k]
  assert len(acts) == 1  # the head
  # the blocks' two Dense layers, inside the scan: one tap per iteration
  inside = [k for k in report.looked_at()["activations"] if "scan#" in k]
  assert sorted(k.split("/")[1] for k in inside) == sorted([f"scan#0[{i}]" for i in range(L)] * 2)
  assert report.not_checked == {}
  direct = _flushed(
    lambda lg: _xent(lg, y), jls.autocast(model.apply)(variables, x), model.apply(variables, x)
  )
  # Not bit-equal here (0.789 against 0.775 at these sizes): the split head is traced on
  # float16 logits, the whole model's on float32 ones, and flax's Dense and log_softmax
  # then round differently; the two agree to 2 points.
  assert abs(report.fractions()[acts[0]] - direct) < 0.02
  assert direct > 0.05
  print(f"linen nn.scan: {report.verdict()}  direct logits: {direct:.2%}")
