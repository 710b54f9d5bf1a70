"""check_underflow inside loops: a scanned model's layers are checked one by one (issue 44).

A small Equinox GPT whose blocks are stacked runs them in a ``lax.scan`` (with and
without ``jax.checkpoint`` around the block, and as a ``fori_loop`` of static trip
count); its unrolled twin runs the same blocks one after the other. The float16 math of
each block is the same in both, so each iteration's taps must give the unrolled block's
counts exactly, and the verdict must name the worst layer wherever it is.
"""

import functools

from conftest import import_optional
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_lossscale as jls
from jax_lossscale.diagnostics import check_underflow

eqx = import_optional("equinox")

V, T, D, L, BATCH = 32, 8, 16, 3, 4
SMALL = 2e-5  # the loss's scale: gradients near float16's subnormals


class Block(eqx.Module):
  ln1: eqx.nn.LayerNorm
  qkv: eqx.nn.Linear
  proj: eqx.nn.Linear
  ln2: eqx.nn.LayerNorm
  fc: eqx.nn.Linear
  out: eqx.nn.Linear

  def __init__(self, key):
    k = jax.random.split(key, 4)
    self.ln1, self.ln2 = eqx.nn.LayerNorm(D), eqx.nn.LayerNorm(D)
    self.qkv = eqx.nn.Linear(D, 3 * D, key=k[0])
    self.proj = eqx.nn.Linear(D, D, key=k[1])
    self.fc = eqx.nn.Linear(D, 4 * D, key=k[2])
    self.out = eqx.nn.Linear(4 * D, D, key=k[3])

  def __call__(self, h):
    q, k, v = jnp.split(jax.vmap(self.qkv)(jax.vmap(self.ln1)(h)), 3, axis=-1)
    scores = jnp.where(jnp.tril(jnp.ones((T, T), bool)), q @ k.T / np.sqrt(D), -1e9)
    h = h + jax.vmap(self.proj)(jax.nn.softmax(scores, -1) @ v)
    return h + jax.vmap(self.out)(jax.nn.gelu(jax.vmap(self.fc)(jax.vmap(self.ln2)(h))))


class GPT(eqx.Module):
  emb: eqx.nn.Embedding
  pos: jax.Array
  blocks: Block  # stacked: each array has a leading axis of L
  head: eqx.nn.Linear

  def __init__(self, key):
    k = jax.random.split(key, 3 + L)
    self.emb = eqx.nn.Embedding(V, D, key=k[0])
    self.pos = 0.1 * jax.random.normal(k[1], (T, D))
    self.blocks = eqx.filter_vmap(Block)(k[3:])
    self.head = eqx.nn.Linear(D, V, use_bias=False, key=k[2])

  def __call__(self, x, loop, remat):
    h = jax.vmap(self.emb)(x) + self.pos
    arrays, static = eqx.partition(self.blocks, eqx.is_array)

    def block(h, layer):
      f = eqx.combine(layer, static)
      return (eqx.filter_checkpoint(f) if remat else f)(h)

    def layer(i):  # a[i]: a slice; at a traced i (a fori_loop's), a dynamic_slice
      if loop in ("fori", "unrolled dynamic"):
        return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), arrays)
      return jax.tree.map(lambda a: a[i], arrays)

    if loop.startswith("unrolled"):
      for i in range(L):
        h = block(h, layer(i))
    elif loop == "scan":
      h, _ = lax.scan(lambda h, p: (block(h, p), None), h, arrays)
    else:  # a fori_loop of static trip count: a scan of the index
      h = lax.fori_loop(0, L, lambda i, h: block(h, layer(i)), h)
    return jax.vmap(self.head)(h)


def _batch():
  x = jax.random.randint(jax.random.key(7), (BATCH, T), 0, V)
  return x, jnp.roll(x, -1, axis=1)


def _loss(loop, remat):
  def loss(model, batch):
    x, y = batch
    logits = jax.vmap(lambda x: model(x, loop, remat))(x)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -SMALL * jnp.mean(jnp.take_along_axis(logp, y[..., None], axis=-1))

  return jls.autocast(loss)


@functools.cache
def _report(loop, remat=False):
  return check_underflow(_loss(loop, remat), GPT(jax.random.key(0)), _batch())


def _number(name):
  return int(name.rsplit("#", 1)[1])


def _layers(report):
  """Per block, its taps' ``(nonzero, lost unscaled, lost scaled)`` in the block's order;
  and the other taps' (the logits')."""
  acts = report.looked_at()["activations"]
  blocks, rest = [[] for _ in range(L)], []
  inside = [k for k in acts if "scan#0[" in k]
  if inside:  # scan#0[i]: iteration i is block i
    for k in sorted(inside, key=_number):
      blocks[int(k.split("scan#0[", 1)[1].split("]", 1)[0])].append(k)
    rest = [k for k in acts if k not in inside]
  else:  # in program order, L blocks of the same length, then the head
    ordered = sorted(acts, key=_number)
    per = (len(ordered) - 1) // L
    blocks = [ordered[i * per : (i + 1) * per] for i in range(L)]
    rest = ordered[L * per :]

  def counts(k):
    return int(report.nonzero[k]), int(report.lost_unscaled[k]), int(report.lost_scaled[k])

  return [[counts(k) for k in b] for b in blocks], [counts(k) for k in rest]


@pytest.mark.parametrize(
  ("loop", "remat", "twin"),
  [
    ("scan", False, "unrolled"),
    ("scan", True, "unrolled"),
    ("unrolled", True, "unrolled"),
    # a fori_loop takes its layer with a dynamic_slice, after which autocast no longer
    # sees a bias's rank (it adds it in float32): its twin indexes the same way
    ("fori", False, "unrolled dynamic"),
  ],
)
def test_each_iteration_is_checked_as_its_unrolled_block(loop, remat, twin):
  unrolled, report = _report(twin), _report(loop, remat)
  blocks, rest = _layers(report)
  want_blocks, want_rest = _layers(unrolled)
  # qkv, scores, probabilities @ v, proj, fc, out: six taps per block, every block
  assert [len(b) for b in want_blocks] == [6] * L
  assert blocks == want_blocks
  assert rest == want_rest and len(rest) == 1  # the logits
  assert report.not_checked == {}
  # the parameter gradients too, leaf by leaf (a fori_loop's layers are slices of its
  # consts: their gradients are summed in the loop's transpose, not the twin's math, and
  # a few elements differ)
  params = report.looked_at()["params"]
  assert params == unrolled.looked_at()["params"]
  for field in ("nonzero",) if loop == "fori" else ("nonzero", "lost_unscaled", "lost_scaled"):
    got, want = getattr(report, field), getattr(unrolled, field)
    assert [int(got[k]) for k in params] == [int(want[k]) for k in params]
  assert report.total(prefix="activations/") == unrolled.total(prefix="activations/")
  assert report.needs_loss_scaling() == unrolled.needs_loss_scaling()


def test_the_verdict_names_the_worst_layer_inside_the_scan():
  report = _report("scan")
  fractions = report.fractions()
  worst = max(report.looked_at()["activations"], key=fractions.get)
  assert worst.startswith("activations/scan#0[")  # a block's op, not the logits
  verdict = report.verdict()
  assert f"worst {worst}: {fractions[worst]:.2%}" in verdict
  assert "not checked" not in verdict
  # the unrolled twin's worst activation is that block's same op
  unrolled = _report("unrolled")
  assert max(unrolled.fractions().values()) == fractions[worst]
  print(f"\nscanned:  {verdict}\nunrolled: {unrolled.verdict()}")
