"""Loss scaling in a loop the user does not own: ``link_loss_scale`` (and ``install_loss_scale``).

The loop is ``StandInTrainer`` (tunix 0.1.7's ``PeftTrainer`` step, see
``loop_you_do_not_own.py``), never edited; the user passes ``dynamic_loss_scale(tx)`` as
the optimizer and links the model to it, which installs the scaling in the model in place.
``StandInSampler`` is tunix's vanilla rollout, built before the link: it keeps sampling
and takes the trainer's weights. Checked here: float16
training tracks float32; gradients equal those of ``scale_loss`` bit for bit; a skipped step
leaves params, optimizer state and the scale's counters as the torch rule says; the step
compiles once; the scale gets no gradient; gradient accumulation, checkpoints and sharded
params; the errors; a GRPO-shaped RL update retried at a lower scale instead of skipped
(``retry_value_and_grad``). ``test_tunix_peft_trainer_in_float16`` runs tunix itself when
``google-tunix`` is installed (it is not a test dependency: about 50 packages, 0.7 GB).
"""

import collections
import contextlib
import inspect

from flax import nnx
from helpers import ROOT
from helpers import python_blocks
from helpers import standard_promotion
import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from loop_you_do_not_own import StandInSampler
from loop_you_do_not_own import StandInTrainer
from loop_you_do_not_own import T
from loop_you_do_not_own import TinyLM
from loop_you_do_not_own import V
from loop_you_do_not_own import batches
from loop_you_do_not_own import default_loss_fn
from loop_you_do_not_own import tunix_toy_grpo
import numpy as np
import optax
import pytest

import jax_lossscale as jls
from jax_lossscale.flax import LossScaledModel
from jax_lossscale.flax import install_loss_scale
from jax_lossscale.flax import link_loss_scale


def _bytes(tree):
  return [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(nnx.as_pure(tree))]


def _params(model):
  return nnx.state(model, nnx.Param)


def _scale_state(optimizer):
  """A copy of the scaler state (the step donates the optimizer's buffers)."""
  return jax.tree_util.tree_map(jnp.copy, jls.get_scale_state(nnx.as_pure(optimizer.opt_state)))


def _trainer(tx, dtype=jnp.float16, output_dtype=None, **kwargs):
  trainer = StandInTrainer(TinyLM(nnx.Rngs(0), dtype=dtype), tx, **kwargs)
  link_loss_scale(trainer.model, trainer.optimizer, output_dtype=output_dtype)
  return trainer


def test_float16_training_tracks_float32():
  """20 Adam steps of the same loop: float16 with dynamic scaling against float32.

  The float16 run skips its overflowing steps; the float32 reference is fed the batches the
  float16 run applied, so the two losses are compared on the same batch after the same
  updates.
  """
  data = batches(20)
  with standard_promotion():  # optax.adam is not strict-clean
    tx = jls.dynamic_loss_scale(optax.adam(3e-3), init_scale=2.0**20, growth_interval=5)
    trainer = _trainer(tx)
    losses, skipped = [], []
    for b in data:
      losses.append(float(trainer.train_step(b)[0]))
      skipped.append(
        bool(jls.metrics(nnx.as_pure(trainer.optimizer.opt_state))["last_step_skipped"])
      )
    ref = StandInTrainer(TinyLM(nnx.Rngs(0), dtype=jnp.float32), optax.adam(3e-3))
    ref_losses = [float(ref.train_step(b)[0]) for b, s in zip(data, skipped) if not s]
  state = _scale_state(trainer.optimizer)
  # 2**20 and 2**19 overflow float16's backward pass; 2**18 does not, and grows every 5.
  assert skipped[:3] == [True, True, False] and sum(skipped) == int(state.skipped_steps)
  assert trainer.traces == 1
  applied = [loss for loss, s in zip(losses, skipped) if not s]
  np.testing.assert_allclose(applied, ref_losses, rtol=0.01)
  assert losses[-1] < 0.8 * losses[0]


class _MLP(nnx.Module):
  def __init__(self, dtype):
    self.l1 = nnx.Linear(8, 16, dtype=dtype, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    self.l2 = nnx.Linear(16, 4, dtype=dtype, param_dtype=jnp.float32, rngs=nnx.Rngs(1))

  def __call__(self, x):
    return self.l2(nnx.gelu(self.l1(x)))


@pytest.mark.parametrize(
  "dtype,output_dtype",
  [(jnp.float32, None), (jnp.float16, jnp.float32)],
  ids=["float32", "float16-output-float32"],
)
def test_same_gradients_as_scale_loss(dtype, output_dtype):
  """Scaling the output's cotangent by 2**k is scaling the loss by 2**k when the loss's own
  backward pass runs in float32: bit for bit op by op (eager), and to rounding in the
  jitted float16 loop on the transformer (XLA fuses the two programs differently)."""
  x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 8)), jnp.float32)
  y = jnp.asarray(np.random.default_rng(1).integers(0, 4, size=8), jnp.int32)
  wrapped = _MLP(dtype)
  model = nnx.clone(wrapped)  # the same params, not linked
  optimizer = nnx.Optimizer(
    wrapped, jls.dynamic_loss_scale(optax.sgd(0.1), init_scale=2.0**10), wrt=nnx.Param
  )
  link_loss_scale(wrapped, optimizer, output_dtype=output_dtype)

  def loss_fn(m):
    logits = m(x.astype(dtype))
    logits = logits if output_dtype is None else logits.astype(output_dtype)
    return -jnp.mean(
      jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32)), y[:, None], 1)
    )

  with jax.disable_jit():
    _, grads = nnx.value_and_grad(lambda m: jls.scale_loss(loss_fn(m), optimizer.opt_state))(model)
    _, wrapped_grads = nnx.value_and_grad(loss_fn)(wrapped)
  assert _bytes(grads) == _bytes(wrapped_grads)
  if dtype == jnp.float32:
    return  # the jitted loop: once, in float16

  tx = jls.dynamic_loss_scale(optax.sgd(0.1, momentum=0.9), init_scale=2.0**10)
  trainer = _trainer(tx, dtype=dtype, output_dtype=output_dtype)
  ref = TinyLM(nnx.Rngs(0), dtype=dtype)
  ref_opt = nnx.Optimizer(ref, tx, wrt=nnx.Param)

  @nnx.jit
  def hand_written(model, optimizer, batch):
    def loss_fn(model):
      def as_in_wrapper(*args):
        logits, cache = model(*args)
        return (logits if output_dtype is None else logits.astype(output_dtype)), cache

      loss = default_loss_fn(as_in_wrapper, **batch)
      return jls.scale_loss(loss, optimizer.opt_state), loss

    (_, loss), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    return loss

  for b in batches(2):
    loss, _, _ = trainer.train_step(b)
    np.testing.assert_allclose(loss, hand_written(ref, ref_opt, b), rtol=1e-6)
  got, want = _params(trainer.model), _params(ref)
  for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)


def test_skipped_step_is_the_torch_rule_bit_for_bit():
  tx = jls.dynamic_loss_scale(optax.sgd(0.1, momentum=0.9), init_scale=2.0**21, growth_interval=3)
  trainer = _trainer(tx)
  data = batches(5)
  params, inner = _bytes(_params(trainer.model)), _bytes(trainer.optimizer.opt_state.inner_state)
  before = _scale_state(trainer.optimizer)
  loss, _, grad_norm = trainer.train_step(data[0])  # 2**21 overflows float16
  assert np.isfinite(float(loss)) and not np.isfinite(float(grad_norm))
  after = _scale_state(trainer.optimizer)
  expected = jls.update_scale(before, jnp.asarray(False))
  assert [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(after)] == [
    np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(expected)
  ]
  assert float(after.scale) == 2.0**20 and int(after.skipped_steps) == 1
  assert int(after.growth_tracker) == 0 and int(after.consecutive_skips) == 1
  assert _bytes(_params(trainer.model)) == params  # params and momentum untouched
  assert _bytes(trainer.optimizer.opt_state.inner_state) == inner
  # The model reads the optimizer's variable: one object, the new scale.
  assert trainer.model.loss_scale is jls.get_scale_state(trainer.optimizer.opt_state).scale
  assert float(trainer.model.loss_scale[...]) == 2.0**20
  # Skip until finite, then a clean step changes the params; no recompilation throughout.
  for b in data[1:]:
    trainer.train_step(b)
  m = jls.metrics(nnx.as_pure(trainer.optimizer.opt_state))
  assert not bool(m["last_step_skipped"]) and _bytes(_params(trainer.model)) != params
  assert trainer.traces == 1


def test_the_scale_gets_no_gradient_and_is_no_param():
  model = TinyLM(nnx.Rngs(0))
  tx = jls.dynamic_loss_scale(optax.sgd(0.1, momentum=0.9))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  variable = link_loss_scale(model, optimizer)
  assert isinstance(variable, nnx.optimizer.OptState) and not isinstance(variable, nnx.Param)
  grads = nnx.jit(nnx.grad(default_loss_fn))(model, **batches(1)[0])
  assert "loss_scale" not in grads and "loss_scale" in nnx.state(model)
  assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(_params(model))
  # The optimizer's param-shaped state has no entry for it either.
  assert "loss_scale" not in nnx.as_pure(optimizer.opt_state.inner_state[0].trace)


def test_forward_is_unchanged_and_output_dtype_is_exact():
  inner = TinyLM(nnx.Rngs(0))
  b = batches(1)[0]
  args = (b["input_tokens"], b["positions"], None, b["attention_mask"])
  for output_dtype in (None, jnp.float32):
    model = nnx.clone(inner)
    optimizer = nnx.Optimizer(model, jls.dynamic_loss_scale(optax.sgd(0.1)), wrt=nnx.Param)
    link_loss_scale(model, optimizer, output_dtype=output_dtype)
    logits, cache = model(*args)
    want = inner(*args)[0]
    assert cache is None and logits.dtype == (output_dtype or jnp.float16)
    assert np.asarray(logits.astype(jnp.float16)).tobytes() == np.asarray(want).tobytes()


def test_gradient_accumulation_with_multi_steps():
  """``multi_steps`` around the scaler: one scale for the micro-batches, the whole step
  skipped when one overflowed, the same bits as the hand-written ``scale_loss`` loop."""
  tx = jls.multi_steps(
    jls.dynamic_loss_scale(optax.sgd(0.1), init_scale=2.0**19, growth_interval=2), 2
  )
  trainer = _trainer(tx)
  model = TinyLM(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def hand_written(model, optimizer, batch):
    def loss_fn(model):
      loss = default_loss_fn(model, **batch)
      return jls.scale_loss(loss, optimizer.opt_state), loss

    grads = nnx.grad(loss_fn, has_aux=True)(model)[0]
    optimizer.update(model, grads)

  data = batches(8)
  scales = []
  with standard_promotion():  # optax.MultiSteps mixes int32 and floats
    for b in data:
      trainer.train_step(b)
      hand_written(model, optimizer, b)
      scales.append(float(_scale_state(trainer.optimizer).scale))
  # The scale moves on the real steps only (every second micro-batch): 2**19 overflows.
  assert scales[0] == 2.0**19 and scales[1] == 2.0**18
  assert all(scales[i] == scales[i - 1] for i in range(2, 8, 2))
  state = _scale_state(trainer.optimizer)
  assert int(state.skipped_steps) >= 1 and int(state.growth_tracker) + int(state.skipped_steps) < 4
  got, want = _params(trainer.model), _params(model)
  for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    # Two programs fused differently, in float16: equal to float16 rounding.
    np.testing.assert_allclose(g, w, rtol=1e-2, atol=1e-5)
  assert _bytes(_scale_state(trainer.optimizer)) == _bytes(_scale_state(optimizer))
  assert trainer.traces == 1


def test_stock_multisteps_is_refused():
  """tunix's own accumulation (a stock ``optax.MultiSteps``) keeps NaN after an overflow, so
  every later step would be skipped: the link refuses it and names the replacement."""
  model = TinyLM(nnx.Rngs(0))
  trainer = StandInTrainer(
    model, jls.dynamic_loss_scale(optax.sgd(0.1)), gradient_accumulation_steps=2
  )
  with pytest.raises(ValueError, match=r"gradient_accumulation_steps.*jls\.multi_steps\("):
    link_loss_scale(trainer.model, trainer.optimizer)
  assert type(model) is TinyLM and "loss_scale" not in nnx.state(model)  # left as it was


def test_checkpoint_restored_before_the_link_continues_bit_for_bit(tmp_path):
  """As tunix restores: a fresh trainer, the checkpoint put into model and optimizer with
  ``nnx.update`` before the link; training goes on as if never interrupted."""
  ocp = pytest.importorskip("orbax.checkpoint")
  tx = jls.dynamic_loss_scale(optax.sgd(0.1, momentum=0.9), init_scale=2.0**19, growth_interval=2)
  data = batches(6)
  trainer = StandInTrainer(install_loss_scale(TinyLM(nnx.Rngs(0))), tx)
  link_loss_scale(trainer.model, trainer.optimizer)
  for b in data[:3]:
    trainer.train_step(b)
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(
      tmp_path / "ckpt",
      {
        "model": nnx.to_pure_dict(nnx.state(trainer.model)),
        "opt": nnx.to_pure_dict(nnx.state(trainer.optimizer, nnx.optimizer.OptState)),
      },
    )
  for b in data[3:]:
    trainer.train_step(b)

  model = install_loss_scale(TinyLM(nnx.Rngs(1)))  # other initial params: all are restored
  resumed = StandInTrainer(model, tx)
  with ocp.StandardCheckpointer() as ckpt:
    restored = ckpt.restore(tmp_path / "ckpt")
  model_state, opt_state = (
    nnx.state(resumed.model),
    nnx.state(resumed.optimizer, nnx.optimizer.OptState),
  )
  nnx.replace_by_pure_dict(model_state, restored["model"])
  nnx.replace_by_pure_dict(opt_state, restored["opt"])
  nnx.update(resumed.model, model_state)
  nnx.update(resumed.optimizer, opt_state)
  link_loss_scale(resumed.model, resumed.optimizer)
  assert float(resumed.model.loss_scale[...]) == float(_scale_state(resumed.optimizer).scale)
  for b in data[3:]:
    resumed.train_step(b)
  assert _bytes(_params(resumed.model)) == _bytes(_params(trainer.model))
  assert _bytes(resumed.optimizer.opt_state) == _bytes(trainer.optimizer.opt_state)


class _FSDPModel(nnx.Module):
  """FSDP as in ``test_sharding.py``: params stored split over ``d``, gathered where used."""

  def __init__(self, mesh):
    rng = np.random.default_rng(0)
    put = lambda x, spec: jax.device_put(jnp.asarray(x, jnp.float32), NamedSharding(mesh, spec))
    self.w = nnx.Param(put(rng.normal(size=(16, 4)) / 4, P("d", None)))
    self.v = nnx.Param(put(rng.uniform(0.5, 1.5, size=16), P("d")))
    self.b = nnx.Param(put(np.zeros(4), P()))
    self.mesh = mesh

  def __call__(self, x):
    full = lambda p: jax.sharding.reshard(p[...], NamedSharding(self.mesh, P()))
    h = (x * full(self.v)).astype(jnp.float16) @ full(self.w).astype(jnp.float16)
    return jnp.tanh(h + full(self.b).astype(jnp.float16))


def _spec(a):
  """The PartitionSpec of ``a`` without trailing ``None`` (``()``: replicated)."""
  spec = list(a.sharding.spec)
  while spec and spec[-1] is None:
    spec.pop()
  return tuple(spec)


def _fsdp_loss(model, x):
  return jnp.mean(model(x).astype(jnp.float32) ** 2)


def _run_fsdp(axis_type):
  mesh = jax.make_mesh((8,), ("d",), axis_types=(axis_type,))
  with jax.set_mesh(mesh) if axis_type == AxisType.Explicit else contextlib.nullcontext():
    model = _FSDPModel(mesh)  # sharded before the trainer builds the optimizer
    tx = jls.dynamic_loss_scale(optax.sgd(0.1, momentum=0.9), init_scale=2.0**16)
    trainer = StandInTrainer(model, tx).with_loss_fn(_fsdp_loss)
    link_loss_scale(trainer.model, trainer.optimizer)
    trainer.shard_optimizer(mesh)
    specs = [_spec(x) for x in jax.tree_util.tree_leaves(_params(model))]
    rng = np.random.default_rng(1)
    for step in range(4):
      x = rng.normal(size=(32, 16)).astype(np.float32)
      x[21, 5] = np.inf if step == 0 else x[21, 5]  # one row of one device's shard
      trainer.train_step({"x": jax.device_put(jnp.asarray(x), NamedSharding(mesh, P()))})
    after = jax.tree_util.tree_leaves(_params(model))
    momentum = jax.tree_util.tree_leaves(nnx.as_pure(trainer.optimizer.opt_state.inner_state))
  return trainer, specs, after, momentum


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (conftest)")
def test_sharded_params_keep_their_sharding():
  """Explicit and Auto axes: params and momentum keep the FSDP sharding through a skipped
  step (an inf in the first batch) and clean ones, and the step compiles once."""
  runs = [_run_fsdp(t) for t in (AxisType.Explicit, AxisType.Auto)]
  for trainer, specs, after, momentum in runs:
    assert specs == [(), ("d",), ("d",)]  # b, v, w
    assert [_spec(x) for x in after] == specs
    assert [_spec(x) for x in momentum] == specs
    state = _scale_state(trainer.optimizer)
    assert int(state.skipped_steps) == 1 and float(state.scale) == 2.0**15
    assert trainer.traces == 1
  (_, _, a, am), (_, _, b, bm) = runs
  for x, y in zip(a + am, b + bm):  # float16 matmuls, partitioned differently: to rounding
    np.testing.assert_allclose(x, y, rtol=1e-2, atol=1e-4)


def test_errors():
  model = TinyLM(nnx.Rngs(0))
  b = batches(1)[0]
  with pytest.raises(TypeError, match=r"model must be an nnx\.Module"):
    install_loss_scale(lambda x: x)
  with pytest.raises(ValueError, match="output_dtype"):
    install_loss_scale(TinyLM(nnx.Rngs(0)), output_dtype=jnp.int32)
  with pytest.raises(TypeError, match="model must be callable, got a _NoCall"):
    install_loss_scale(_NoCall())
  plain = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  with pytest.raises(ValueError, match="optimizer must hold exactly one loss scaler, found 0"):
    link_loss_scale(model, plain)
  scaled = nnx.Optimizer(model, jls.dynamic_loss_scale(optax.sgd(0.1)), wrt=nnx.Param)
  with pytest.raises(TypeError, match=r"optimizer must be an nnx\.Optimizer"):
    link_loss_scale(model, scaled.opt_state)
  assert type(model) is TinyLM  # every refusal leaves the model as it was
  installed = install_loss_scale(TinyLM(nnx.Rngs(0)), output_dtype=jnp.float32)
  with pytest.raises(ValueError, match="already has loss scaling installed"):
    install_loss_scale(installed)
  with pytest.raises(ValueError, match="pass output_dtype there"):
    link_loss_scale(installed, scaled, output_dtype=jnp.float32)
  clash = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
  clash.loss_scale = nnx.Param(jnp.ones(()))
  with pytest.raises(ValueError, match="already has an attribute loss_scale"):
    link_loss_scale(
      clash, nnx.Optimizer(clash, jls.dynamic_loss_scale(optax.sgd(0.1)), wrt=nnx.Param)
    )
  assert type(clash) is nnx.Linear
  # Installed, not linked: the forward pass runs, differentiating it raises.
  loss = default_loss_fn(installed, **b)
  assert np.isfinite(float(loss))
  with pytest.raises(RuntimeError, match="link_loss_scale"):
    nnx.jit(nnx.grad(default_loss_fn))(installed, **b)


def test_link_and_output_dtype_errors_name_the_argument():
  model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, jls.dynamic_loss_scale(optax.sgd(0.1)), wrt=nnx.Param)
  with pytest.raises(TypeError) as e:
    link_loss_scale(lambda x: x, optimizer)
  assert str(e.value) == "model must be an nnx.Module, got function."
  with pytest.raises(TypeError) as e:
    link_loss_scale(model, optimizer, output_dtype="not a dtype")
  assert str(e.value) == "output_dtype must be a floating dtype or None, got 'not a dtype'."
  # An optimizer whose state holds the scale as a bare array (not an nnx.Variable).
  optimizer.opt_state = nnx.as_pure(optimizer.opt_state)
  with pytest.raises(
    TypeError, match=r"optimizer\.opt_state holds its scale as a \w+, not an nnx\.Variable"
  ):
    link_loss_scale(model, optimizer)
  assert type(model) is nnx.Linear


class _TwoOutputs(nnx.Module):
  """A float16 output and an integer one (an argmax), with a keyword-only argument."""

  def __init__(self):
    self.w = nnx.Param(jnp.full(2, 3.0, jnp.float16))

  def __call__(self, x, *, offset):
    y = self.w[...] * x + offset
    return y, jnp.argmax(y).astype(jnp.int32)


def test_installed_call_passes_keyword_arguments():
  model = _TwoOutputs()
  optimizer = nnx.Optimizer(
    model, jls.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0), wrt=nnx.Param
  )
  link_loss_scale(model, optimizer, output_dtype=jnp.float32)
  y, i = model(jnp.array([1.0, 2.0], jnp.float16), offset=jnp.float16(1.0))
  assert y.dtype == jnp.float32 and i.dtype == jnp.int32
  np.testing.assert_array_equal(y, np.array([4.0, 7.0], np.float32))
  assert int(i) == 1
  assert list(inspect.signature(model.__call__).parameters) == ["x", "offset"]


def test_the_model_stays_whole():
  """The link installs the scaling in the model itself: the same object, its class (a
  subclass of the same name), its attributes and methods as code that inspects it sees them
  (tunix's RLCluster reads ``config``, its Sampler ``init_cache``, ``get_attention_mask`` and
  ``__call__``'s signature, DPOTrainer ``hasattr(model, "get_attention_mask")``), its params
  at the same paths as the bare model's."""
  model = TinyLM(nnx.Rngs(0))
  bare = nnx.clone(model)
  config = model.config
  trainer = StandInTrainer(model, jls.dynamic_loss_scale(optax.sgd(0.1)))
  link_loss_scale(trainer.model, trainer.optimizer)
  assert trainer.model is model and isinstance(model, TinyLM) and isinstance(model, LossScaledModel)
  assert type(model).__name__ == "TinyLM" and type(bare) is TinyLM
  assert model.config is config
  for name in ("config", "init_cache", "get_attention_mask", "embed", "head"):
    assert hasattr(model, name) and hasattr(bare, name)
  assert inspect.signature(model.__call__) == inspect.signature(bare.__call__)
  cache = model.init_cache(2, T, jnp.float16)
  assert jax.tree_util.tree_structure(cache) == jax.tree_util.tree_structure(
    bare.init_cache(2, T, jnp.float16)
  )
  # Params at the bare model's paths: state flows both ways with nnx.update.
  assert jax.tree_util.tree_structure(_params(model)) == jax.tree_util.tree_structure(_params(bare))
  nnx.update(bare, _params(model))
  nnx.update(model, _params(bare))
  StandInSampler(model)  # RLCluster's check: `rollout_actor must have a config attribute`


def test_output_dtype_casts_the_logits_only():
  """``output_dtype`` casts the first output (the logits); the KV cache returned beside them
  keeps its float16 keys and values and its int32 index, so a decode loop that carries the
  cache runs (a sampler built after the link, here)."""
  model = TinyLM(nnx.Rngs(0))
  bare = nnx.clone(model)
  optimizer = nnx.Optimizer(model, jls.dynamic_loss_scale(optax.sgd(0.1)), wrt=nnx.Param)
  link_loss_scale(model, optimizer, output_dtype=jnp.float32)
  prompt = batches(1)[0]["input_tokens"][:2, :6]
  cache = model.init_cache(2, T, jnp.float16)
  mask = jnp.pad(
    model.get_attention_mask(prompt, jnp.ones(prompt.shape, bool)), ((0, 0), (0, 0), (0, T - 6))
  )
  positions = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), prompt.shape)
  logits, new_cache = model(prompt, positions, cache, mask)
  want_logits, want_cache = bare(prompt, positions, cache, mask)
  assert logits.dtype == jnp.float32 and want_logits.dtype == jnp.float16
  assert new_cache["k"].dtype == new_cache["v"].dtype == jnp.float16
  assert new_cache["end_index"].dtype == jnp.int32 and int(new_cache["end_index"]) == 6
  assert _bytes(new_cache) == _bytes(want_cache)
  assert np.asarray(logits.astype(jnp.float16)).tobytes() == np.asarray(want_logits).tobytes()
  got = StandInSampler(model).generate(prompt, 6)
  np.testing.assert_array_equal(got, StandInSampler(bare).generate(prompt, 6))
  with pytest.raises(TypeError, match="output_dtype casts the logits"):
    cast = install_loss_scale(_DictOut(), output_dtype=jnp.float32)
    cast(jnp.ones(2, jnp.float16))


_Out = collections.namedtuple("_Out", ["logits", "ids"])


class _Returns(nnx.Module):
  """A model whose output is ``make(x)``: an array, a tuple, a list or a namedtuple."""

  def __init__(self, make):
    self.make = make

  def __call__(self, x):
    return self.make(x)


def _ids(x):
  return jnp.arange(x.size, dtype=jnp.int32)


@pytest.mark.parametrize(
  "make, want",
  [
    (lambda x: x, lambda x: x.astype(jnp.float32)),
    (_ids, _ids),
    (lambda x: (x, _ids(x)), lambda x: (x.astype(jnp.float32), _ids(x))),
    (lambda x: [x, _ids(x)], lambda x: [x.astype(jnp.float32), _ids(x)]),
    (lambda x: _Out(x, _ids(x)), lambda x: _Out(x.astype(jnp.float32), _ids(x))),
    (lambda x: (_ids(x), x), lambda x: (_ids(x), x)),
  ],
  ids=["array", "int-array", "tuple", "list", "namedtuple", "int-first"],
)
def test_output_dtype_casts_a_floating_first_output_of_any_shape_of_output(make, want):
  """The logits are the output itself, or the first element of a tuple, list or namedtuple
  output (rebuilt as the same type); an integer one is left as it is, like every other
  element."""
  x = jnp.array([0.5, -1.0, 65504.0], jnp.float16)
  got = install_loss_scale(_Returns(make), output_dtype=jnp.float32)(x)
  expected = want(x)
  assert type(got) is type(expected)
  assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(expected)
  for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(expected)):
    assert g.dtype == w.dtype
    np.testing.assert_array_equal(g, w)


def test_one_class_per_model_class_and_output_dtype():
  """Two models of one class linked with one ``output_dtype`` share one class, so graphs
  and ``jit`` caches see the same class; another ``output_dtype`` is another class."""
  a = install_loss_scale(nnx.Linear(2, 1, rngs=nnx.Rngs(0)))
  b = install_loss_scale(nnx.Linear(2, 1, rngs=nnx.Rngs(1)))
  c = install_loss_scale(nnx.Linear(2, 1, rngs=nnx.Rngs(2)), output_dtype=jnp.float32)
  assert type(a) is type(b) and type(a) is not type(c)
  assert nnx.graphdef(a) == nnx.graphdef(b)


class _NoCall(nnx.Module):
  pass


class _DictOut(nnx.Module):
  def __call__(self, x):
    return {"logits": x}


@pytest.mark.parametrize("colocated", [True, False], ids=["colocated", "own-copy"])
@pytest.mark.parametrize("output_dtype", [None, jnp.float32], ids=["model-dtype", "float32"])
def test_sampler_built_before_the_link_samples_and_syncs(colocated, output_dtype):
  """tunix's RL order: RLCluster builds the sampler from the bare model (the same object
  when colocated, a copy on another mesh), then the trainer; the user links after. The
  sampler's graph, taken before the link, samples; the trainer's ``nnx.Param`` state syncs
  into it without a structure error, and it then samples what the trained model samples."""
  model = TinyLM(nnx.Rngs(0))
  sampler = StandInSampler(model if colocated else nnx.clone(model))
  tx = jls.dynamic_loss_scale(optax.sgd(0.5), init_scale=2.0**10)
  trainer = StandInTrainer(model, tx)
  link_loss_scale(trainer.model, trainer.optimizer, output_dtype=output_dtype)
  prompt = batches(1, seed=3)[0]["input_tokens"][:, :8]
  before = sampler.generate(prompt, 6)
  for b in batches(3):
    trainer.train_step(b)
  assert int(_scale_state(trainer.optimizer).skipped_steps) == 0  # three applied updates
  sampler.update_params(nnx.state(trainer.model, nnx.Param))
  assert _bytes(nnx.state(sampler.transformer, nnx.Param)) == _bytes(_params(trainer.model))
  trained = nnx.merge(nnx.graphdef(TinyLM(nnx.Rngs(0))), _params(trainer.model))
  after = sampler.generate(prompt, 6)
  np.testing.assert_array_equal(after, StandInSampler(trained).generate(prompt, 6))
  assert not np.array_equal(after, before)  # the sync moved the sampler's weights


def test_retry_value_and_grad_with_aux():
  model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
  bare = nnx.clone(model)
  optimizer = nnx.Optimizer(
    model, jls.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0), wrt=nnx.Param
  )
  link_loss_scale(model, optimizer)
  x = jnp.ones((1, 2))
  loss_fn = lambda m, x: (jnp.sum(m(x)), 2 * x)
  out = jls.flax.retry_value_and_grad(loss_fn, has_aux=True)(model, optimizer, x)
  assert float(out.value) == float(jnp.sum(bare(x)))
  np.testing.assert_array_equal(out.aux, np.full((1, 2), 2.0, np.float32))
  # The gradients of the loss scaled by 8, for optimizer.update to unscale.
  np.testing.assert_array_equal(out.grads["bias"][...], np.array([8.0], np.float32))
  np.testing.assert_array_equal(out.grads["kernel"][...], np.full((2, 1), 8.0))
  assert int(out.retries) == 0


class _Pair(nnx.Module):
  def __init__(self, a, b):
    self.a = a
    self.b = b


def test_retry_value_and_grad_refuses_a_model_with_one_part_left_unlinked():
  linked = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(linked, jls.dynamic_loss_scale(optax.sgd(0.1)), wrt=nnx.Param)
  link_loss_scale(linked, optimizer)
  model = _Pair(linked, install_loss_scale(nnx.Linear(2, 1, rngs=nnx.Rngs(1))))
  step = jls.flax.retry_value_and_grad(lambda m, x: jnp.sum(m.a(x)))
  with pytest.raises(ValueError, match="LossScaledModel linked to optimizer"):
    step(model, optimizer, jnp.ones((1, 2)))


# -- RL: a GRPO-shaped update on sampled tokens, retried instead of skipped ----------------

G = 4  # samples per prompt


def _rollout(model, key, prompts):
  """``G`` samples per prompt: at each position a token drawn from the policy's next-token
  distribution; reward 1 per token that continues the arithmetic sequence."""
  tokens = jnp.repeat(prompts["input_tokens"], G, axis=0)
  positions = jnp.repeat(prompts["positions"], G, axis=0)
  mask = jnp.repeat(prompts["attention_mask"], G, axis=0)
  logits, _ = model(tokens, positions, None, mask)
  logits = logits[:, :-1].astype(jnp.float32)
  sampled = jax.random.categorical(key, logits)
  logp = jnp.take_along_axis(jax.nn.log_softmax(logits), sampled[..., None], -1)[..., 0]
  reward = jnp.mean((sampled == tokens[:, 1:]).astype(jnp.float32), axis=1).reshape(-1, G)
  advantage = (reward - reward.mean(1, keepdims=True)) / (reward.std(1, keepdims=True) + 1e-4)
  return dict(
    input_tokens=tokens,
    positions=positions,
    attention_mask=mask,
    sampled=sampled,
    old_logp=logp,
    advantage=advantage.reshape(-1),
  )


def grpo_loss(model, input_tokens, positions, attention_mask, sampled, old_logp, advantage):
  """PPO's clipped objective on the sampled tokens, group-normalised advantages (GRPO)."""
  logits, _ = model(input_tokens, positions, None, attention_mask)
  logits = logits[:, :-1].astype(jnp.float32)
  logp = jnp.take_along_axis(jax.nn.log_softmax(logits), sampled[..., None], -1)[..., 0]
  ratio = jnp.exp(logp - old_logp)
  a = advantage[:, None]
  return -jnp.mean(jnp.minimum(ratio * a, jnp.clip(ratio, 0.8, 1.2) * a))


def _policy(init_scale):
  model = TinyLM(nnx.Rngs(0))
  tx = jls.dynamic_loss_scale(optax.sgd(0.5), init_scale=init_scale)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  link_loss_scale(model, optimizer)
  return model, optimizer


@pytest.mark.parametrize("max_retries", [0, 8])
def test_grpo_update_retried_instead_of_skipped(max_retries):
  """2**24 overflows float16's backward pass: with ``max_retries=0`` the rollout is thrown
  away (the step is skipped); with retries it is recomputed at 2**24 / 2**r and applied,
  the counters as if the batch had been fed r + 1 times, and the update is the one a scaler
  starting at that scale makes."""
  model, optimizer = _policy(2.0**24)
  rollout = nnx.jit(_rollout)(model, jax.random.key(0), batches(1)[0])
  step_fn = jls.flax.retry_value_and_grad(grpo_loss, max_retries=max_retries)

  @nnx.jit
  def rl_step(model, optimizer, rollout):
    out = step_fn(model, optimizer, **rollout)
    optimizer.update(model, out.grads)
    return out.value, out.retries

  before = _bytes(_params(model))
  loss, retries = rl_step(model, optimizer, rollout)
  state = _scale_state(optimizer)
  assert np.isfinite(float(loss))
  if max_retries == 0:
    assert int(retries) == 0 and _bytes(_params(model)) == before
    assert float(state.scale) == 2.0**23 and int(state.skipped_steps) == 1
    return
  r = int(retries)
  assert 0 < r < max_retries and float(state.scale) == 2.0**24 / 2**r
  assert int(state.skipped_steps) == r and int(state.consecutive_skips) == 0
  assert int(state.growth_tracker) == 1  # the applied attempt is a clean step
  assert float(model.loss_scale[...]) == float(state.scale)
  # The same update as a scaler that started at the scale the retries arrived at.
  ref, ref_opt = _policy(2.0**24 / 2**r)

  @nnx.jit
  def plain_step(model, optimizer, rollout):
    grads = nnx.grad(grpo_loss)(model, **rollout)
    optimizer.update(model, grads)

  plain_step(ref, ref_opt, rollout)
  assert not bool(jls.metrics(nnx.as_pure(ref_opt.opt_state))["last_step_skipped"])
  got, want = jax.tree_util.tree_leaves(_params(model)), jax.tree_util.tree_leaves(_params(ref))
  for g, w in zip(got, want):  # float16 gradients of two programs (one in a while_loop)
    np.testing.assert_allclose(g, w, rtol=1e-3, atol=5e-5)
  assert _bytes(_params(model)) != before


# -- tunix itself (google-tunix is not a test dependency: run where it is installed) -------


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # tunix 0.1.7 on JAX 0.10's deprecations
def test_tunix_peft_trainer_in_float16():
  """The guide's tunix block runs as written on tunix's ``PeftTrainer`` (unedited); then the
  same float16 fine-tune, its skips recorded, against tunix's float32 run fed the batches the
  float16 run applied: the losses agree on every applied step."""
  pytest.importorskip("tunix", reason="google-tunix is not installed")
  from tunix.sft import peft_trainer

  page = ROOT / "docs" / "guides" / "loop-you-do-not-own.md"
  blocks = [code for _, code in python_blocks(page.read_text())]
  ns = {"__name__": "guide"}
  with standard_promotion():  # tunix's code and optax.adam are not strict-clean
    exec(blocks[1], ns)  # the model and the data
    assert "PeftTrainer" in blocks[2]
    exec(blocks[2], ns)  # the tunix block
    losses = np.asarray(ns["losses"])
    m = jls.metrics(nnx.as_pure(ns["trainer"].optimizer.opt_state))
    assert len(losses) == 30 and losses[-1] < 0.8 * losses[0] and np.all(np.isfinite(losses))
    logged = ns["logged"]  # jls.flax.log_loss_scale: the scaler's state after the last step
    assert logged("skipped_steps")[-1] == int(m["skipped_steps"]) and len(logged("retries")) == 30
    assert logged("loss_scale")[-1] == float(m["scale"])

    data = ns["make_batches"](30)
    inputs = lambda x: ns["model_inputs"](x.input_tokens)
    as_input = lambda t: peft_trainer.TrainingInput(input_tokens=t, input_mask=jnp.ones(t.shape))
    config = peft_trainer.TrainingConfig(eval_every_n_steps=1000, max_steps=30)
    tx = jls.dynamic_loss_scale(optax.adam(3e-3))
    trainer = peft_trainer.PeftTrainer(ns["TinyLM"](nnx.Rngs(0)), tx, config)
    link_loss_scale(trainer.model, trainer.optimizer, output_dtype=jnp.float32)
    trainer.with_gen_model_input_fn(inputs)
    counts = []

    def recorded():
      for t in data:
        yield as_input(t)
        counts.append(int(jls.get_scale_state(trainer.optimizer.opt_state).skipped_steps[...]))

    trainer.train(recorded())
    f16 = trainer.metrics_logger.get_metric_history("", "loss", "train")
    skipped = np.diff([0] + counts[:30]).astype(bool)
    np.testing.assert_array_equal(f16, losses)  # the guide's run, reproduced

    ref = peft_trainer.PeftTrainer(
      ns["TinyLM"](nnx.Rngs(0), dtype=jnp.float32), optax.adam(3e-3), config
    )
    ref.with_gen_model_input_fn(inputs)
    ref.train([as_input(t) for t, s in zip(data, skipped) if not s])
    f32 = ref.metrics_logger.get_metric_history("", "loss", "train")
  applied = f16[~skipped]
  print(
    f"\ntunix float16: {len(f16)} steps, skipped {skipped.sum()} at {np.flatnonzero(skipped).tolist()}, "
    f"final scale {float(m['scale']):g}; loss {f16[0]:.4f} -> {f16[-1]:.4f}; float32 on the "
    f"applied batches {f32[0]:.4f} -> {f32[-1]:.4f}; max |diff| {np.max(np.abs(applied - f32)):.2e}, "
    f"max rel {np.max(np.abs(applied - f32) / f32):.2e}"
  )
  np.testing.assert_allclose(applied, f32, rtol=1e-2)


def test_retry_value_and_grad_errors():
  with pytest.raises(TypeError, match="loss_fn must be callable"):
    jls.flax.retry_value_and_grad(None)
  with pytest.raises(ValueError, match="max_retries"):
    jls.flax.retry_value_and_grad(grpo_loss, max_retries=-1)
  step = jls.flax.retry_value_and_grad(default_loss_fn)
  model = TinyLM(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, jls.dynamic_loss_scale(optax.sgd(0.1)), wrt=nnx.Param)
  with pytest.raises(ValueError, match="linked to optimizer"):
    step(model, optimizer, **batches(1)[0])  # not linked
  accumulating = nnx.Optimizer(
    model, jls.multi_steps(jls.dynamic_loss_scale(optax.sgd(0.1)), 2), wrt=nnx.Param
  )
  link_loss_scale(model, accumulating)
  with pytest.raises(ValueError, match="gradient accumulator"):
    step(model, accumulating, **batches(1)[0])


class _DigitTokenizer:
  """Token ids written as space-separated integers (what tunix's TokenizerAdapter accepts
  from a tokenizer with ``encode``, ``decode``, ``bos_id``, ``eos_id`` and ``pad_id``)."""

  def encode(self, text, **_):
    return [int(t) for t in text.split()]

  def decode(self, ids, **_):
    return " ".join(str(int(i)) for i in ids)

  def bos_id(self):
    return 1

  def eos_id(self):
    return V  # never sampled: every sequence runs to max_tokens_to_generate

  def pad_id(self):
    return 0


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # tunix 0.1.7 on JAX 0.10's deprecations
@pytest.mark.parametrize("output_dtype", [None, jnp.float32], ids=["model-dtype", "float32"])
def test_tunix_vanilla_rollout_built_before_the_link(output_dtype):
  """tunix's own ``VanillaRollout`` (its ``Sampler``), built from the bare model as
  ``RLCluster`` builds it, before the trainer and the link: it samples, takes the trained
  ``nnx.Param`` state through ``update_params`` (tunix's weight sync), and samples again."""
  pytest.importorskip("tunix", reason="google-tunix is not installed")
  from tunix.rl.rollout import base_rollout
  from tunix.rl.rollout import vanilla_rollout

  model = TinyLM(nnx.Rngs(0))
  c = model.config
  cache = base_rollout.CacheConfig(
    cache_size=T, num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim
  )
  with standard_promotion():  # tunix's sampler is not strict-clean
    # On its own mesh, as RLCluster places the rollout model (tunix's reshard needs one).
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    copy = nnx.clone(model)
    nnx.update(copy, jax.device_put(nnx.state(copy), NamedSharding(mesh, P())))
    rollout = vanilla_rollout.VanillaRollout(copy, _DigitTokenizer(), cache)
    trainer = StandInTrainer(model, jls.dynamic_loss_scale(optax.sgd(0.5), init_scale=2.0**10))
    link_loss_scale(trainer.model, trainer.optimizer, output_dtype=output_dtype)
    config = base_rollout.RolloutConfig(
      max_tokens_to_generate=6, max_prompt_length=8, temperature=1e-6, top_p=None, seed=None
    )
    prompts = ["2 5 8 11 14 17", "3 4 5 6 7 8"]
    before = rollout.generate(prompts, config)
    for b in batches(3):
      trainer.train_step(b)
    rollout.update_params(nnx.state(trainer.model, nnx.Param), (nnx.Param,))
    after = rollout.generate(prompts, config)
  assert _bytes(nnx.state(rollout.model(), nnx.Param)) == _bytes(_params(trainer.model))
  assert [len(t) for t in before.tokens] == [len(t) for t in after.tokens] == [6, 6]
  assert not all(np.array_equal(a, b) for a, b in zip(before.tokens, after.tokens))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # tunix 0.1.7 on JAX 0.10's deprecations
@pytest.mark.parametrize("num_iterations", [1, 2])
@pytest.mark.parametrize("colocated", [True, False], ids=["colocated", "rollout-mesh"])
def test_tunix_grpo_learner_with_the_link(colocated, num_iterations):
  """tunix's ``RLCluster`` and ``GRPOLearner`` on tunix's toy transformer, linked after the
  learner is built: the sampler (on the actor's mesh or its own, synced at every global
  step), the reference model, the old log-probs of ``num_iterations=2`` and the actor's
  train step all run, and every step is applied through the shared scale."""
  pytest.importorskip("tunix", reason="google-tunix is not installed")
  pytest.importorskip("grain.python")
  # tunix's code is not strict-clean, and runs in its own threads: the global setting.
  promotion = jax.config.jax_numpy_dtype_promotion
  jax.config.update("jax_numpy_dtype_promotion", "standard")
  try:
    cluster, learner, data = tunix_toy_grpo(
      2.0**10, colocated=colocated, num_iterations=num_iterations
    )
    trainer = cluster.actor_trainer
    before = _bytes(_params(trainer.model))
    link_loss_scale(trainer.model, trainer.optimizer, output_dtype=jnp.float32)
    assert learner.should_sync_weights is not colocated
    learner.train(data)
  finally:
    jax.config.update("jax_numpy_dtype_promotion", promotion)
  state = _scale_state(trainer.optimizer)
  assert int(trainer.optimizer.step[...]) == 4 and int(state.skipped_steps) == 0
  assert float(state.scale) == 2.0**10 and int(state.growth_tracker) == 4
  assert trainer.model.loss_scale is jls.get_scale_state(trainer.optimizer.opt_state).scale
  assert all(a != b for a, b in zip(_bytes(_params(trainer.model)), before))
