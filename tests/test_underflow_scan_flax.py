"""check_underflow inside Flax's scans: each layer checked as its unrolled twin's (issue 44).

``tests/test_underflow_scan.py`` proves it on an Equinox GPT; here the same small GPT is
written twice more, each as its users write it and checked as they call it:

* in Flax NNX, its blocks stacked with ``nnx.vmap`` and run in an ``nnx.scan`` (with and
  without ``nnx.remat`` around the block), checked as ``check_underflow(jls.autocast(loss,
  jnp.float16), state, batch)`` with ``graphdef, state = nnx.split(model)`` and the loss
  merging them; its unrolled twin is the same module and state, its blocks called one
  after the other in a Python loop (block ``i``: row ``i`` of the stacked state);
* in Flax linen, its blocks in an ``nn.scan`` (with and without ``nn.remat``); its
  unrolled twin names ``L`` blocks, each given its row of the scanned model's params.

The float16 math of each block is the same in the scanned model and its twin, so each
iteration's taps must give the unrolled block's counts exactly, nothing may go
unchecked, and the verdict must name the worst layer, inside the scan.
"""

import functools
import re

from conftest import import_optional
from helpers import all_eqns
from helpers import assert_worst_layer_inside_scan
from helpers import block_counts
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_lossscale as jls
from jax_lossscale.diagnostics import check_underflow

nn = import_optional("flax.linen")
nnx = import_optional("flax.nnx")

V, T, D, L, BATCH = 32, 8, 16, 3, 4
SMALL = 2e-5  # the loss's scale: gradients near float16's subnormals
#: Per block: qkv, scores, probabilities @ v, proj, fc, out.
TAPS_PER_BLOCK = 6


def _attention_mlp(h, ln1, qkv, proj, ln2, fc, out):
  """One pre-norm GPT block of batched tokens ``h`` (batch, T, D), given its layers."""
  q, k, v = jnp.split(qkv(ln1(h)), 3, axis=-1)
  scores = jnp.einsum("btd,bsd->bts", q, k) / np.sqrt(D)
  scores = jnp.where(jnp.tril(jnp.ones((T, T), bool)), scores, -1e9)
  h = h + proj(jnp.einsum("bts,bsd->btd", jax.nn.softmax(scores, -1), v))
  return h + out(jax.nn.gelu(fc(ln2(h))))


def _batch():
  x = jax.random.randint(jax.random.key(7), (BATCH, T), 0, V)
  return x, jnp.roll(x, -1, axis=1)


def _xent(logits, y):
  logp = jax.nn.log_softmax(logits, axis=-1)
  return -SMALL * jnp.mean(jnp.take_along_axis(logp, y[..., None], axis=-1))


def _row(stacked, i):
  """Row ``i`` of each stacked array: block ``i``'s weights."""
  return jax.tree.map(lambda a: a[i], stacked)


def _check(loss, params, batch):
  """``check_underflow(jls.autocast(loss, jnp.float16), params, batch)``, jitted; and the
  primitives of ``loss`` (nested ones included), for the tests to check their premise
  (a scan, a remat).

  Compiled at XLA's lowest optimisation level: on the CPU, compiling the three backward
  passes is most of the check's time (half of it at the default level), and the scanned
  model and its twin are compiled alike.
  """
  amp = jls.autocast(loss, jnp.float16)
  prims = {e.primitive.name for e in all_eqns(jax.make_jaxpr(loss)(params, batch).jaxpr)}
  checked = jax.jit(lambda p, b: check_underflow(amp, p, b))
  compiled = checked.lower(params, batch).compile({"xla_backend_optimization_level": 0})
  return compiled(params, batch), prims


# -- Flax NNX: nnx.scan over blocks stacked with nnx.vmap ---------------------------------


class NNXBlock(nnx.Module):
  def __init__(self, rngs):
    self.ln1, self.ln2 = nnx.LayerNorm(D, rngs=rngs), nnx.LayerNorm(D, rngs=rngs)
    self.qkv = nnx.Linear(D, 3 * D, rngs=rngs)
    self.proj = nnx.Linear(D, D, rngs=rngs)
    self.fc = nnx.Linear(D, 4 * D, rngs=rngs)
    self.out = nnx.Linear(4 * D, D, rngs=rngs)

  def __call__(self, h):
    return _attention_mlp(h, self.ln1, self.qkv, self.proj, self.ln2, self.fc, self.out)


class NNXGPT(nnx.Module):
  def __init__(self, rngs):
    self.emb = nnx.Embed(V, D, rngs=rngs)
    self.pos = nnx.Param(0.1 * jax.random.normal(rngs.params(), (T, D)))

    @nnx.split_rngs(splits=L)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def stacked(rngs):
      return NNXBlock(rngs)

    self.blocks = stacked(rngs)  # each array has a leading axis of L
    self.head = nnx.Linear(D, V, use_bias=False, rngs=rngs)

  def __call__(self, x, loop, remat):
    h = self.emb(x) + self.pos[...]
    block = nnx.remat(NNXBlock.__call__) if remat else NNXBlock.__call__
    if loop == "scan":

      @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
      def blocks(h, layer):
        return block(layer, h)

      h = blocks(h, self.blocks)
    else:  # the twin: block i is row i of the stacked state
      graphdef, state = nnx.split(self.blocks)
      for i in range(L):
        h = block(nnx.merge(graphdef, _row(state, i)), h)
    return self.head(h)


@functools.cache
def _nnx_report(loop, remat):
  graphdef, state = nnx.split(NNXGPT(nnx.Rngs(0)))

  def loss(state, batch):
    x, y = batch
    return _xent(nnx.merge(graphdef, state)(x, loop, remat), y)

  return _check(loss, state, _batch())


# -- Flax linen: nn.scan ------------------------------------------------------------------


class LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, h, _):
    layers = (nn.LayerNorm(), nn.Dense(3 * D, name="qkv"), nn.Dense(D, name="proj"))
    layers += (nn.LayerNorm(), nn.Dense(4 * D, name="fc"), nn.Dense(D, name="out"))
    return _attention_mlp(h, *layers), None


class LinenGPT(nn.Module):
  loop: str = "scan"
  remat: bool = False

  @nn.compact
  def __call__(self, x):
    h = nn.Embed(V, D)(x) + self.param("pos", nn.initializers.normal(0.1), (T, D))
    block = nn.remat(LinenBlock) if self.remat else LinenBlock
    if self.loop == "scan":
      blocks = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True}, length=L)
      h, _ = blocks(name="blocks")(h, None)
    else:
      for i in range(L):
        h, _ = block(name=f"block_{i}")(h, None)
    return nn.Dense(V, use_bias=False, name="head")(h)


@functools.cache
def _linen_report(loop, remat):
  x, y = _batch()
  variables = LinenGPT().init(jax.random.key(0), x)
  if loop != "scan":  # the twin's block i: row i of the scanned params
    params = dict(variables["params"])
    stacked = params.pop("blocks")
    for i in range(L):
      params[f"block_{i}"] = _row(stacked, i)
    variables = {"params": params}
  model = LinenGPT(loop, remat)

  def loss(variables, batch):
    x, y = batch
    return _xent(model.apply(variables, x), y)

  return _check(loss, variables, (x, y))


REPORTS = {"nnx": _nnx_report, "linen": _linen_report}


def _params(report):
  """The parameter leaves, the twin's ``block_<i>`` named as the scanned ``blocks``."""
  return sorted({re.sub(r"block_\d+", "blocks", k) for k in report.looked_at()["params"]})


@pytest.mark.parametrize("remat", [False, True], ids=["scan", "scan+remat"])
@pytest.mark.parametrize("flax", ["nnx", "linen"])
def test_each_iteration_is_checked_as_its_unrolled_block(flax, remat):
  (report, prims), (unrolled, twin_prims) = (
    REPORTS[flax]("scan", remat),
    REPORTS[flax]("unrolled", False),
  )
  assert "scan" in prims and "scan" not in twin_prims
  assert ("remat2" in prims or "checkpoint" in prims) == remat
  blocks, rest = block_counts(report, L)
  want_blocks, want_rest = block_counts(unrolled, L)
  assert [len(b) for b in want_blocks] == [TAPS_PER_BLOCK] * L
  assert blocks == want_blocks
  assert rest == want_rest and len(rest) == 1  # the logits
  # every tap of the scanned model is an iteration's: none is stacked or left unchecked
  acts = report.looked_at()["activations"]
  assert sum("scan#0[" in k for k in acts) == TAPS_PER_BLOCK * L
  assert report.not_checked == {} and unrolled.not_checked == {}
  # the same parameter leaves (their counts are not compared: a loop's parameter gradients
  # are summed in another order than the twin's)
  assert _params(report) == _params(unrolled)
  assert report.total(prefix="activations/") == unrolled.total(prefix="activations/")
  assert report.needs_loss_scaling() == unrolled.needs_loss_scaling()


@pytest.mark.parametrize("flax", ["nnx", "linen"])
def test_the_verdict_names_the_worst_layer_inside_the_scan(flax):
  (report, _), (unrolled, _) = REPORTS[flax]("scan", False), REPORTS[flax]("unrolled", False)
  verdict = assert_worst_layer_inside_scan(report, unrolled)
  print(f"\n{flax} scanned:  {verdict}\n{flax} unrolled: {unrolled.verdict()}")
