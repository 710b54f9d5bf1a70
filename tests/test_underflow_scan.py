"""check_underflow inside loops: a scanned model's layers are checked one by one (issue 44).

A small Equinox GPT whose blocks are stacked runs them in a ``lax.scan`` (with and
without ``jax.checkpoint`` around the block, and as a ``fori_loop`` of static trip
count); its unrolled twin runs the same blocks one after the other. The float16 math of
each block is the same in both, so each iteration's taps must give the unrolled block's
counts exactly, and the verdict must name the worst layer wherever it is.
"""

import functools

from conftest import import_optional
from helpers import assert_worst_layer_inside_scan
from helpers import block_counts
from helpers import tap_number
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
  blocks, rest = block_counts(report, L)
  want_blocks, want_rest = block_counts(unrolled, L)
  # qkv, scores, probabilities @ v, proj, fc, out: six taps per block, every block
  assert [len(b) for b in want_blocks] == [6] * L
  assert blocks == want_blocks
  assert rest == want_rest and len(rest) == 1  # the logits
  assert report.not_checked == {}
  # the same parameter leaves (their counts are not compared: a loop's parameter gradients
  # are summed in another order than the unrolled twin's, and on jax 0.11 one float32
  # reference element of a bias gradient is an exact 0 in one and not in the other)
  assert report.looked_at()["params"] == unrolled.looked_at()["params"]
  assert report.total(prefix="activations/") == unrolled.total(prefix="activations/")
  assert report.needs_loss_scaling() == unrolled.needs_loss_scaling()


def test_the_verdict_names_the_worst_layer_inside_the_scan():
  report, unrolled = _report("scan"), _report("unrolled")
  verdict = assert_worst_layer_inside_scan(report, unrolled)
  print(f"\nscanned:  {verdict}\nunrolled: {unrolled.verdict()}")


# -- loops of plain JAX: nested, reversed, checkpointed; users' taps ----------------------


def _rand(key, shape, scale=1.0):
  return scale * jax.random.normal(jax.random.key(key), shape, jnp.float32)


def _step(h, w):
  return jnp.tanh(h @ w) * 4.0


def _nested(ws, h, loop):
  """``ws[i, j]`` applied in order (i outer, j inner): nested scans, or unrolled."""
  if loop == "unrolled":
    for i in range(ws.shape[0]):
      for j in range(ws.shape[1]):
        h = _step(h, ws[i, j])
    return h
  inner = lambda h, wi: (lax.scan(lambda h, w: (_step(h, w), None), h, wi)[0], None)
  if loop == "checkpointed":
    inner = jax.checkpoint(inner)
  return lax.scan(inner, h, ws)[0]


@pytest.mark.parametrize("loop", ["scans", "checkpointed"])
def test_nested_scans_give_one_leaf_per_iteration_pair(loop):
  ws, h = _rand(0, (2, 3, 8, 8), 0.4), _rand(1, (4, 8))
  check = lambda loop: check_underflow(
    jls.autocast(lambda ws, h: 1e-7 * jnp.sum(_nested(ws, h, loop))), ws, h
  )
  report, unrolled = check(loop), check("unrolled")
  acts = report.looked_at()["activations"]
  # scan#0 is the outer scan, scan#1 the inner one; [i] its iteration
  want = [f"activations/scan#0[{i}]/scan#1[{j}]/dot_general#0" for i in range(2) for j in range(3)]
  assert sorted(acts) == sorted(want)
  in_order = sorted(unrolled.looked_at()["activations"], key=tap_number)
  for field in ("nonzero", "lost_unscaled", "lost_scaled"):
    got, ref = getattr(report, field), getattr(unrolled, field)
    assert [int(got[k]) for k in want] == [int(ref[k]) for k in in_order]
  assert 0 < report.total() < 1  # a case that flushes some, not all
  assert report.not_checked == {}


def test_a_reversed_scan_names_its_iterations_by_their_rows():
  ws, h = _rand(0, (3, 8, 8), 0.4), _rand(1, (4, 8))

  def loss(ws, h, reverse):
    if reverse:
      h = lax.scan(lambda h, w: (_step(h, w), None), h, ws, reverse=True)[0]
    else:
      for i in (2, 1, 0):
        h = _step(h, ws[i])
    return 1e-7 * jnp.sum(h)

  report = check_underflow(jls.autocast(lambda ws, h: loss(ws, h, True)), ws, h)
  unrolled = check_underflow(jls.autocast(lambda ws, h: loss(ws, h, False)), ws, h)
  # iteration i is row i of the scanned input: ws[2] runs first
  rows = [f"activations/scan#0[{i}]/dot_general#0" for i in (2, 1, 0)]
  in_order = sorted(unrolled.looked_at()["activations"], key=tap_number)
  assert [int(report.lost_unscaled[k]) for k in rows] == [
    int(unrolled.lost_unscaled[k]) for k in in_order
  ]
  assert len({int(report.lost_unscaled[k]) for k in rows}) > 1  # the rows tell apart


def _scanned_with_user_taps(ws, h, taps):
  """Two matmuls per iteration; the user's stacked tap threaded onto the first."""

  def body(h, inp):
    w, tap = inp
    a = h @ w + tap
    return _step(a, w), None

  return 1e-7 * jnp.sum(lax.scan(body, h, (ws, taps["a"]))[0])


def test_a_users_taps_threaded_through_a_scan_replace_the_automatic_ones():
  ws, h = _rand(0, (3, 8, 8), 0.4), _rand(1, (4, 8))
  taps = {"a": jnp.zeros((3, 4, 8))}
  report = check_underflow(jls.autocast(_scanned_with_user_taps), ws, h, activations=taps)
  acts = report.looked_at()["activations"]
  # the user's leaf (all iterations), and the second matmul's automatic taps: the first
  # matmul is tapped once, by the user
  assert sorted(acts) == ["activations/a"] + [
    f"activations/scan#0[{i}]/dot_general#1" for i in range(3)
  ]
  assert report.not_checked == {}
  # the automatic taps without the user's: the first matmul's rows add up to the user's leaf
  zeros = {"a": jnp.zeros((3, 4, 8))}
  auto = check_underflow(jls.autocast(lambda ws, h: _scanned_with_user_taps(ws, h, zeros)), ws, h)
  first = [f"activations/scan#0[{i}]/dot_general#0" for i in range(3)]
  for field in ("nonzero", "lost_unscaled", "lost_scaled"):
    got, ref = getattr(report, field), getattr(auto, field)
    assert int(got["activations/a"]) == sum(int(ref[k]) for k in first)
  assert 0 < int(report.lost_unscaled["activations/a"]) < int(report.nonzero["activations/a"])


def test_a_users_tap_on_an_op_inside_a_cond_takes_it_off_the_not_checked_count():
  w, x = _rand(0, (8, 8), 0.4), _rand(1, (4, 8))

  def loss(w, x, taps=None):
    t = jnp.zeros((4, 8)) if taps is None else taps["y"]

    def branch(x, t):
      return jnp.tanh(x @ w + t) @ w

    return 1e-7 * jnp.sum(lax.cond(x[0, 0] > -10, branch, branch, x, t))

  untapped = check_underflow(jls.autocast(loss), w, x)
  # each branch's two matmuls (the branches are counted one by one)
  assert {k: [int(v) for v in n] for k, n in untapped.not_checked.items()} == {"cond": [1, 4]}
  report = check_underflow(jls.autocast(loss), w, x, activations={"y": jnp.zeros((4, 8))})
  # the user's tap covers each branch's first matmul
  assert {k: [int(v) for v in n] for k, n in report.not_checked.items()} == {"cond": [1, 2]}
  assert "not checked: the 2 lower-precision op outputs inside 1 cond" in report.verdict()
  assert int(report.nonzero["activations/y"]) == 4 * 8
