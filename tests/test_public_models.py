"""Three public models that this project did not write, trained under ``autocast`` with the scaler.

Each model comes from a package on PyPI, pinned in the ``test`` extra, and is used as
its authors ship it: nothing here changes its code. Each is trained twice from the same
init on the same batches, under ``jax.jit``:

* float32 with plain ``optax.adam``;
* ``jls.autocast(loss_fn)`` (float16 by torch's CUDA policy) with
  ``jls.dynamic_loss_scale(optax.adam(...))``, the loss scaled by ``jls.scale_loss``.

The checks: the autocast run's params (and model state) stay float32; its loss curve
tracks the float32 one within a measured bound; the loss falls; the skipped steps are
few; the compiled step is compiled once; and the forward really runs in float16.

The third-party code is not written for ``jax_numpy_dtype_promotion="strict"`` (which
``conftest.py`` sets for the suite; ``optax.adam`` is not either), so the models run under
standard promotion (:func:`conftest.standard_promotion`).
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import functools
from typing import Any

from conftest import import_optional
from conftest import standard_promotion
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_lossscale as jls

nn = import_optional("flax.linen")

STEPS = 200


# -- shared helpers ------------------------------------------------------------------------


def digits_batches(n_batches: int, batch: int):
  """scikit-learn's 8x8 digits, scaled to [0, 1], as ``n_batches`` fixed batches (NHWC)."""
  datasets = import_optional("sklearn.datasets")
  d = datasets.load_digits()
  x = (d.images / 16.0).astype(np.float32)[..., None]
  y = d.target.astype(np.int32)
  perm = np.random.default_rng(0).permutation(len(y))[: n_batches * batch]
  xs = jnp.asarray(x[perm].reshape(n_batches, batch, 8, 8, 1))
  ys = jnp.asarray(y[perm].reshape(n_batches, batch))
  return xs, ys


@dataclasses.dataclass
class Run:
  params: Any
  state: Any
  opt_state: Any
  losses: np.ndarray  # the loss at each step, before that step's update
  compiles: int  # entries in the jitted step's cache after the run


def fit(loss_fn: Callable, params, state, batch_at: Callable, lr: float, *, amp: bool) -> Run:
  """``STEPS`` Adam steps of ``loss_fn(params, state, batch) -> (loss, new_state)``.

  ``amp=False``: float32, plain ``optax.adam(lr)``. ``amp=True``: ``jls.autocast(loss_fn)``
  with ``jls.dynamic_loss_scale(optax.adam(lr))``, gradients of the scaled loss.
  """
  tx = jls.dynamic_loss_scale(optax.adam(lr)) if amp else optax.adam(lr)
  f = jls.autocast(loss_fn) if amp else loss_fn
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state, state, batch):
    def objective(p):
      loss, new_state = f(p, state, batch)
      return (jls.scale_loss(loss, opt_state) if amp else loss), (loss, new_state)

    grads, (loss, new_state) = jax.grad(objective, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, new_state, loss

  losses = []
  with standard_promotion():
    for i in range(STEPS):
      params, opt_state, state, loss = step(params, opt_state, state, batch_at(i))
      losses.append(loss)  # no host sync inside the loop
  return Run(params, state, opt_state, np.asarray(jnp.stack(losses)), step._cache_size())


def compare(run32: Run, run16: Run) -> dict[str, float]:
  """How far the autocast run's loss curve is from the float32 one."""
  l32, l16 = run32.losses, run16.losses
  final32, final16 = l32[-10:].mean(), l16[-10:].mean()  # the last 10 steps, less noisy
  return {
    "first": float(l32[0]),
    "final32": float(final32),
    "final16": float(final16),
    "final_rel": float(abs(final16 - final32) / final32),
    "mean_abs": float(np.mean(np.abs(l16 - l32))),
    "skipped": int(jls.metrics(run16.opt_state)["skipped_steps"]),
    "scale": float(jls.metrics(run16.opt_state)["scale"]),
  }


def assert_trained(run32: Run, run16: Run, *, final_rel: float, mean_abs: float, skips: int):
  """The checks common to the three models; prints the measured figures (``pytest -s``)."""
  c = compare(run32, run16)
  print(c)
  for run in (run32, run16):
    assert run.compiles == 1  # one compilation for all the steps
    assert np.all(np.isfinite(run.losses))
  # master params and model state (batch statistics) stay float32 under autocast
  for leaf in jax.tree.leaves((run16.params, run16.state)):
    if jnp.issubdtype(leaf.dtype, jnp.floating):
      assert leaf.dtype == jnp.float32
  assert c["final32"] < 0.5 * c["first"]  # float32 learns
  assert c["final16"] < 0.5 * c["first"]  # autocast learns too
  assert c["mean_abs"] > 0  # the autocast run is not the float32 run
  assert c["final_rel"] < final_rel, c
  assert c["mean_abs"] < mean_abs, c
  assert c["skipped"] <= skips, c
  return c


def all_eqns(jaxpr):
  """Every equation of ``jaxpr`` (a ``Jaxpr``), those of its sub-jaxprs included."""
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from all_eqns(sub)


def out_dtypes(jaxpr, name: str) -> list:
  """The output dtypes of every ``name`` equation in ``jaxpr``, sub-jaxprs included."""
  return [v.aval.dtype for e in all_eqns(jaxpr) if e.primitive.name == name for v in e.outvars]


# -- 1. ResNet with BatchNorm (Flax linen): jax-resnet ----------------------------------------


@functools.cache
def _resnet():
  jax_resnet = import_optional("jax_resnet")
  # jax-resnet's own ResNet builder, a small configuration of it: a ResNet-D stem of width
  # 16, two stages of one basic block (16 and 32 channels), no max-pool (8x8 input).
  model = jax_resnet.ResNet(
    jax_resnet.ResNetBlock,
    stage_sizes=[1, 1],
    hidden_sizes=(16, 32),
    n_classes=10,
    stem_cls=functools.partial(jax_resnet.ResNetDStem, stem_width=16),
    pool_fn=lambda x: x,
  )
  xs, ys = digits_batches(14, 128)
  with standard_promotion():
    variables = jax.jit(model.init)(jax.random.key(0), xs[0])

  def loss_fn(params, batch_stats, batch):
    x, y = batch
    logits, new = model.apply(
      {"params": params, "batch_stats": batch_stats}, x, mutable=["batch_stats"]
    )
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), new["batch_stats"]

  batch_at = lambda i: (xs[i % len(xs)], ys[i % len(ys)])
  return model, variables, loss_fn, batch_at


@pytest.mark.slow
def test_resnet_batchnorm_trains_under_autocast():
  """jax-resnet 0.0.4 (PyPI ``jax-resnet``): ``jax_resnet.ResNet`` with ``ResNetBlock``.

  Source: https://github.com/n2cholas/jax-resnet, commit 0a2c50192f821d393d5c320ae96ed2835b403913
  ("Bump version to 0.0.4"; the wheel's five modules are identical to that commit's).

  A small ResNet (ResNet-D stem, two stages of one basic block, ``nn.BatchNorm`` after each
  of its 9 convolutions, the batch statistics a mutable collection) on scikit-learn's
  8x8 digits, 14 fixed batches of 128.
  """
  _, variables, loss_fn, batch_at = _resnet()
  params, stats = variables["params"], variables["batch_stats"]
  run32 = fit(loss_fn, params, stats, batch_at, 3e-3, amp=False)
  run16 = fit(loss_fn, params, stats, batch_at, 3e-3, amp=True)
  # Measured (jax 0.10.2, CPU): final loss 0.00549 (float32) against 0.00545, relative
  # difference 0.0066; mean |loss - loss32| over the 200 steps 9.4e-4 (first loss 2.43);
  # 0 skipped steps, the scale still 2**16. That is with the BatchNorms in float32, as the
  # current autocast runs them; with flax's own float16 BatchNorm (dtype=float16) in their
  # place, torch's behaviour (float16 output, float32 statistics), 0.0017 and 9.6e-4.
  assert_trained(run32, run16, final_rel=0.05, mean_abs=5e-3, skips=2)

  with standard_promotion():
    closed = jax.make_jaxpr(jls.autocast(loss_fn))(params, stats, batch_at(0))
  convs = out_dtypes(closed.jaxpr, "conv_general_dilated")
  assert len(convs) == 9 and set(convs) == {jnp.dtype(jnp.float16)}, convs


@pytest.mark.slow
def test_resnet_batchnorm_output_is_float16_as_in_torch():
  """jax-resnet 0.0.4, as above: each ``nn.BatchNorm`` returns its float16 input's dtype.

  torch's CUDA autocast lists ``layer_norm`` and ``group_norm`` as float32 ops but not
  ``batch_norm`` (``aten/src/ATen/autocast_mode.h`` of torch 2.13.0): a BatchNorm2d on a
  float16 convolution output returns float16 (its running statistics stay float32). So
  the conv -> BatchNorm -> ReLU chain of a ResNet stays float16 there.
  """
  model, variables, _, batch_at = _resnet()

  def forward(variables, x):
    return model.apply(
      variables, x, mutable=["batch_stats", "intermediates"], capture_intermediates=True
    )

  with standard_promotion():
    logits, state = jls.autocast(forward)(variables, batch_at(0)[0])
  assert logits.dtype == jnp.float16
  for leaf in jax.tree.leaves(state["batch_stats"]):
    assert leaf.dtype == jnp.float32
  flat = jax.tree_util.tree_flatten_with_path(state["intermediates"])[0]
  named = {jax.tree_util.keystr(path): v.dtype for path, v in flat}
  norms = {k: d for k, d in named.items() if "BatchNorm" in k}
  assert len(norms) == 9
  assert all(d == jnp.float16 for d in norms.values()), norms


# -- 2. A BERT encoder with nn.remat over its layers: Hugging Face transformers (Flax) -------


def _bert():
  import_optional("transformers")
  from transformers import BertConfig
  from transformers.models.bert.modeling_flax_bert import FlaxBertForSequenceClassificationModule

  vocab, seq, batch, n_batches = 32, 16, 32, 8
  config = BertConfig(
    vocab_size=vocab,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
    max_position_embeddings=seq,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    num_labels=4,
  )
  # gradient_checkpointing=True: each FlaxBertLayer is wrapped in nn.remat (jax.checkpoint).
  model = FlaxBertForSequenceClassificationModule(config, gradient_checkpointing=True)
  # Synthetic task: the class is the second token mod 4 (attend from [CLS] to position 1).
  tokens = np.random.default_rng(0).integers(1, vocab, (n_batches, batch, seq)).astype(np.int32)
  labels = jnp.asarray(tokens[:, :, 1] % 4)
  tokens = jnp.asarray(tokens)

  def apply(params, ids):
    ones = jnp.ones_like(ids)
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), ids.shape)
    return model.apply({"params": params}, ids, ones, jnp.zeros_like(ids), positions, None).logits

  with standard_promotion():
    params = jax.jit(
      lambda k, ids: model.init(
        k, ids, jnp.ones_like(ids), jnp.zeros_like(ids), jnp.zeros_like(ids), None
      )
    )(jax.random.key(0), tokens[0])["params"]

  def loss_fn(params, state, batch):
    ids, y = batch
    logits = apply(params, ids)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), state

  batch_at = lambda i: (tokens[i % n_batches], labels[i % n_batches])
  return apply, params, loss_fn, batch_at


@pytest.mark.slow
def test_bert_remat_trains_under_autocast():
  """transformers 4.57.6 (PyPI ``transformers``, the last 4.x, which still ships the Flax models):
  ``FlaxBertForSequenceClassificationModule``.

  Source: https://github.com/huggingface/transformers, release tag v4.57.6,
  ``src/transformers/models/bert/modeling_flax_bert.py``.

  A 2-layer BERT (hidden 32, 2 heads) with ``gradient_checkpointing=True``, which wraps
  each layer in ``flax.linen.remat``; a synthetic 4-class sequence task, batches of 32.
  """
  apply, params, loss_fn, batch_at = _bert()
  run32 = fit(loss_fn, params, None, batch_at, 1e-3, amp=False)
  run16 = fit(loss_fn, params, None, batch_at, 1e-3, amp=True)
  # Measured (jax 0.10.2, CPU): final loss 0.011727 (float32) against 0.011725, relative
  # difference 2.0e-4; mean |loss - loss32| over the 200 steps 3.7e-5 (first loss 1.39,
  # largest single-step difference 3.9e-4); 0 skipped steps, the scale still 2**16.
  assert_trained(run32, run16, final_rel=5e-3, mean_abs=5e-4, skips=2)

  with standard_promotion():
    logits = jls.autocast(apply)(params, batch_at(0)[0])
    closed = jax.make_jaxpr(jls.autocast(loss_fn))(params, None, batch_at(0))
  assert logits.dtype == jnp.float16  # the classifier's nn.Dense ran in float16
  remats = [e for e in all_eqns(closed.jaxpr) if e.primitive.name == "remat2"]  # jax.checkpoint
  assert len(remats) == 2, {e.primitive.name for e in all_eqns(closed.jaxpr)}
  # inside each checkpointed layer: q, k, v, the two attention einsums, attention output,
  # the two MLP matmuls, all float16
  for eqn in remats:
    dots = out_dtypes(eqn.params["jaxpr"], "dot_general")
    assert len(dots) == 8 and set(dots) == {jnp.dtype(jnp.float16)}, dots


# -- 3. A graph network with segment ops: jraph --------------------------------------------


def _graph(n_per_class=50, n_classes=4, dim=8):
  """A random stochastic-block graph: node features are noisy class means, self edges added."""
  rng = np.random.default_rng(0)
  n = n_per_class * n_classes
  y = np.repeat(np.arange(n_classes), n_per_class).astype(np.int32)
  means = rng.normal(size=(n_classes, dim))
  x = (0.6 * means[y] + rng.normal(size=(n, dim))).astype(np.float32)
  same = y[:, None] == y[None, :]
  adj = rng.random((n, n)) < np.where(same, 0.08, 0.01)
  adj = np.triu(adj, 1)
  adj = adj | adj.T
  senders, receivers = np.nonzero(adj | np.eye(n, dtype=bool))
  return x, y, senders.astype(np.int32), receivers.astype(np.int32)


def _gnn():
  jraph = import_optional("jraph")
  x, y, senders, receivers = _graph()
  graph = jraph.GraphsTuple(
    nodes=jnp.asarray(x),
    edges=None,
    senders=jnp.asarray(senders),
    receivers=jnp.asarray(receivers),
    n_node=jnp.asarray([len(x)]),
    n_edge=jnp.asarray([len(senders)]),
    globals=None,
  )

  class Net(nn.Module):
    """jraph's GraphConvolution (segment_sum) then its GAT (segment_softmax: segment_max)."""

    @nn.compact
    def __call__(self, graph):
      graph = jraph.GraphConvolution(
        update_node_fn=lambda h: nn.relu(nn.Dense(32)(h)), add_self_edges=False
      )(graph)
      logit = nn.Dense(1)
      graph = jraph.GAT(
        attention_query_fn=nn.Dense(32),
        attention_logit_fn=lambda s, r, _: logit(jnp.concatenate([s, r], axis=-1)),
        node_update_fn=nn.relu,
      )(graph)
      return nn.Dense(4)(graph.nodes)

  net = Net()
  with standard_promotion():
    params = jax.jit(net.init)(jax.random.key(0), graph)["params"]
  labels = jnp.asarray(y)

  def loss_fn(params, state, graph):
    logits = net.apply({"params": params}, graph)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), state

  apply = lambda params, graph: net.apply({"params": params}, graph)
  return apply, params, loss_fn, graph


@pytest.mark.slow
def test_jraph_gnn_trains_under_autocast():
  """jraph 0.0.6.dev0 (PyPI ``jraph``): ``jraph.GraphConvolution`` and ``jraph.GAT``.

  Source: https://github.com/google-deepmind/jraph, tag v0.0.6.dev0, commit
  31cf4117e68e8cd26a3c2628ea03a2074ff6157c (the wheel's modules are identical to it).

  Node classification on a random 4-block graph of 200 nodes (self edges added, as GAT
  expects), full batch. The GCN aggregates with ``jax.ops.segment_sum``; GAT's
  ``segment_softmax`` takes ``jax.ops.segment_max`` of the attention logits.
  """
  apply, params, loss_fn, graph = _gnn()
  run32 = fit(loss_fn, params, None, lambda i: graph, 3e-3, amp=False)
  run16 = fit(loss_fn, params, None, lambda i: graph, 3e-3, amp=True)
  # Not measured on the current autocast, which raises AutocastError at scatter-max.
  # Measured with jraph's segment_max run in float32 (a ``jls.float32`` region patched in
  # for the measurement only): final loss 0.00898 (float32) against 0.00878, relative
  # difference 0.022; mean |loss - loss32| over the 200 steps 5.2e-4 (first loss 1.32);
  # 0 skipped steps, the scale still 2**16.
  assert_trained(run32, run16, final_rel=0.1, mean_abs=3e-3, skips=2)

  with standard_promotion():
    logits = jls.autocast(apply)(params, graph)
    closed = jax.make_jaxpr(jls.autocast(loss_fn))(params, None, graph)
  assert logits.dtype == jnp.float16
  names = {e.primitive.name for e in all_eqns(closed.jaxpr)}
  assert {"scatter-add", "scatter-max"} <= names, names
  dots = out_dtypes(closed.jaxpr, "dot_general")
  assert len(dots) == 4 and set(dots) == {jnp.dtype(jnp.float16)}, dots
