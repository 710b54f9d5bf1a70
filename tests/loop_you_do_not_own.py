"""A tiny NNX language model and a trainer written the way tunix 0.1.7's ``PeftTrainer`` is.

Shared by ``tests/test_loop_you_do_not_own.py`` (the stand-in, always run) and the tunix
test in the same file (run when ``google-tunix`` is installed).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

V, D, T, B = 32, 32, 16, 8  # vocabulary, width, sequence length, batch


class RMSNorm(nnx.Module):
  """RMS normalisation computed in float32, returned in the compute dtype (strict-promotion
  clean, unlike ``nnx.LayerNorm`` with float16 compute and float32 params)."""

  def __init__(self, d, dtype):
    self.scale = nnx.Param(jnp.ones(d, jnp.float32))
    self.dtype = dtype

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
    return (y * self.scale[...]).astype(self.dtype)


@dataclasses.dataclass(frozen=True)
class TinyConfig:
  """What tunix's ``RLCluster`` reads from ``model.config`` to size the sampler's KV cache."""

  num_layers: int = 1
  num_kv_heads: int = 2
  head_dim: int = D // 2
  dtype: Any = jnp.float16


class TinyLM(nnx.Module):
  """One pre-norm transformer block, randomly initialised, float32 params.

  Called as tunix calls a model: ``model(tokens, positions, cache, attention_mask)`` gives
  ``(logits, cache)``. ``dtype`` is the compute dtype (float16 or float32). Like tunix's
  models it has a ``config``, ``init_cache`` and ``get_attention_mask``; with a cache
  (``init_cache``), the keys and values of ``tokens`` are written at the cache's
  ``end_index`` and attention runs over the cache (``attention_mask``: ``(B, L, cache
  size)``).
  """

  def __init__(self, rngs: nnx.Rngs, dtype=jnp.float16):
    kw = dict(dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
    self.config = TinyConfig(dtype=dtype)
    self.embed = nnx.Embed(V, D, **kw)
    self.pos = nnx.Embed(T, D, **kw)
    self.ln1 = RMSNorm(D, dtype)
    self.qkv = nnx.Linear(D, 3 * D, **kw)
    self.out = nnx.Linear(D, D, **kw)
    self.ln2 = RMSNorm(D, dtype)
    self.up = nnx.Linear(D, 4 * D, **kw)
    self.down = nnx.Linear(4 * D, D, **kw)
    self.head = nnx.Linear(D, V, **kw)

  def __call__(self, tokens, positions, cache, attention_mask):
    x = self.embed(tokens) + self.pos(positions)
    attended, cache = self._attention(self.ln1(x), cache, attention_mask)
    x = x + self.out(attended)
    x = x + self.down(nnx.gelu(self.up(self.ln2(x))))
    return self.head(x), cache

  def init_cache(self, batch_size, cache_size, dtype):
    c = self.config
    shape = (batch_size, cache_size, c.num_kv_heads, c.head_dim)
    return dict(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), end_index=jnp.int32(0))

  def get_attention_mask(self, tokens, inputs_mask):
    """Causal, and no attention to padding: ``(B, L, L)``."""
    causal = jnp.tril(jnp.ones((tokens.shape[1],) * 2, bool))
    return causal[None] & inputs_mask[:, None, :].astype(bool)

  def _attention(self, x, cache, mask):
    """Two-head causal self-attention in the compute dtype (plain einsums: XLA:CPU has no
    float16 dot with a float32 accumulator, which ``nnx.MultiHeadAttention`` asks for)."""
    q, k, v = jnp.split(self.qkv(x).reshape(*x.shape[:2], 3, 2, D // 2), 3, axis=2)
    q, k, v = (a[:, :, 0] for a in (q, k, v))  # (B, T, heads, D / heads)
    if cache is not None:
      at = (0, cache["end_index"], 0, 0)
      k = jax.lax.dynamic_update_slice(cache["k"], k.astype(cache["k"].dtype), at)
      v = jax.lax.dynamic_update_slice(cache["v"], v.astype(cache["v"].dtype), at)
      cache = dict(k=k, v=v, end_index=cache["end_index"] + x.shape[1])
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.asarray(D // 2, q.dtype))
    logits = jnp.where(mask[:, None], logits, jnp.asarray(-1e4, logits.dtype))
    weights = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(q.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(x.shape), cache


def batches(n: int, seed: int = 0) -> list[dict[str, jax.Array]]:
  """``n`` batches of arithmetic sequences mod ``V`` (learnable), as tunix's model inputs."""
  rng = np.random.default_rng(seed)
  causal = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
  positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  out = []
  for _ in range(n):
    start = rng.integers(0, V, size=(B, 1))
    stride = rng.integers(1, 4, size=(B, 1))
    tokens = (start + stride * np.arange(T)) % V
    out.append(
      dict(
        input_tokens=jnp.asarray(tokens, jnp.int32),
        input_mask=jnp.ones((B, T), jnp.float32),
        positions=positions,
        attention_mask=causal,
      )
    )
  return out


def default_loss_fn(model, input_tokens, input_mask, positions, attention_mask):
  """tunix's ``_default_loss_fn`` (peft_trainer.py), with the logits cast to float32."""
  logits, _ = model(input_tokens, positions, None, attention_mask)
  logits = logits[:, :-1, :].astype(jnp.float32)
  target_tokens = input_tokens[:, 1:]
  target_mask = input_mask[:, 1:]
  one_hot = jax.nn.one_hot(target_tokens, logits.shape[-1])
  one_hot = one_hot * target_mask.astype(one_hot.dtype)[..., None]
  norm_factor = 1 / (jnp.sum(target_mask) + 1e-8)
  return -jnp.sum(jax.nn.log_softmax(logits) * one_hot) * norm_factor


class StandInTrainer:
  """tunix 0.1.7's ``PeftTrainer``, the parts that build the optimizer and run a step.

  As in tunix: the trainer wraps the optimizer in ``optax.MultiSteps`` for gradient
  accumulation and builds ``nnx.Optimizer(model, optimizer, wrt=nnx.Param)`` itself; the
  loss comes through ``with_loss_fn`` and sees the model and the batch only; the step is
  ``nnx.value_and_grad(loss_fn, argnums=0)``, ``optax.global_norm(grads)``,
  ``optimizer.update(model, grads)``, under ``nnx.jit(..., donate_argnames=("optimizer",))``
  bound with ``nnx.cached_partial``. ``traces`` counts the compilations of the step.
  """

  def __init__(self, model, optimizer, gradient_accumulation_steps=None):
    self.model = model
    if gradient_accumulation_steps is not None:
      optimizer = optax.MultiSteps(optimizer, gradient_accumulation_steps)
    self.optimizer = nnx.Optimizer(self.model, optimizer, wrt=nnx.Param)
    self.loss_fn = default_loss_fn
    self._has_aux = False
    self._jitted = None
    self.traces = 0

  def with_loss_fn(self, loss_fn, has_aux=False):
    self._jitted = None
    self.loss_fn = loss_fn
    self._has_aux = has_aux
    return self

  def _train_step(self, model, optimizer, inputs):
    self.traces += 1
    grad_fn = nnx.value_and_grad(self.loss_fn, argnums=0, has_aux=self._has_aux)
    out, grads = grad_fn(model, **inputs)
    grad_norm = optax.tree.norm(grads)  # tunix: optax.global_norm, deprecated alias
    optimizer.update(model, grads)
    if self._has_aux:
      loss, aux = out
      return loss, aux, grad_norm
    return out, None, grad_norm

  def shard_optimizer(self, mesh):
    """tunix's ``_shard_optimizer``: the optimizer state placed on the mesh before the first
    step ("if not, the _train_step will be compiled 2 times"): here, what is on one device
    (``nnx.Optimizer``'s own ``step`` counter) is replicated."""
    state = nnx.state(self.optimizer, nnx.optimizer.OptState)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    on_mesh = lambda x: isinstance(x.sharding, jax.sharding.NamedSharding)
    nnx.update(
      self.optimizer,
      jax.tree_util.tree_map(lambda x: x if on_mesh(x) else jax.device_put(x, replicated), state),
    )

  def train_step(self, inputs):
    if self._jitted is None:
      step = nnx.jit(self.create_train_step_fn(), donate_argnames=("optimizer",))
      self._jitted = nnx.cached_partial(step, self.model, self.optimizer)
    return self._jitted(inputs)

  def create_train_step_fn(self):
    return self._train_step

  # -- tunix's metrics: the loop of ``PeftTrainer.train``, its hooks and its logger ----------

  metrics_prefix = ""
  training_hooks = None
  train_steps = 0

  def with_training_hooks(self, training_hooks):
    self.training_hooks = training_hooks

  @property
  def metrics_logger(self):
    if not hasattr(self, "_logger"):
      self._logger = StandInMetricsLogger()
    return self._logger

  def train(self, inputs):
    """tunix's loop: each step dispatched, its loss buffered and written (with a call of
    ``on_train_step_end``) once the next step is dispatched, the last one at ``close``,
    after ``on_train_end``. The hooks' ``on_train_step_start`` runs under
    :func:`no_device_reads` here: a hook that read a device value there would make the host
    wait for the step in flight."""
    hooks, pending = self.training_hooks, None
    if hooks:
      hooks.on_train_start(self)
    for batch in inputs:
      if hooks:
        with no_device_reads():
          hooks.on_train_step_start(self)
      loss, _, _ = self.train_step(batch)
      self.train_steps += 1
      if pending is not None:
        self._write(*pending)
      pending = (self.train_steps, loss)
    jax.block_until_ready(loss)  # tunix's throttler.wait_for_all
    if hooks:
      hooks.on_train_end(self)
    if pending is not None:  # close
      self._write(*pending)

  def _write(self, step, loss):
    self.metrics_logger.log(self.metrics_prefix, "loss", np.asarray(loss), "train", step)
    if self.training_hooks:
      self.training_hooks.on_train_step_end(self, step, np.asarray(loss))


@contextlib.contextmanager
def no_device_reads():
  """Makes reading a ``jax.Array``'s value on the host raise: ``float``, ``int``, ``.item()``,
  ``jax.device_get`` and ``block_until_ready`` (``jax.transfer_guard`` does not see
  device-to-host reads on CPU; ``np.asarray`` goes through the buffer protocol and is not
  caught). Dispatching jitted programs on arrays is still allowed."""
  from jax._src import array  # the class behind jax.Array

  cls = array.ArrayImpl
  names = ("_value", "block_until_ready", "item", "tolist", "__array__")
  saved = {name: cls.__dict__[name] for name in names if name in cls.__dict__}

  def refuse(*_, **__):
    raise AssertionError("a device value was read on the host here")

  for name in saved:
    setattr(cls, name, property(refuse) if name == "_value" else refuse)
  try:
    yield
  finally:
    for name, v in saved.items():
      setattr(cls, name, v)


class StandInMetricsLogger:
  """tunix's ``MetricsLogger``: a history per prefix, mode and name (and, for the tests, the
  order of the writes: ``(name, step)`` each)."""

  def __init__(self):
    self.logged = {}
    self.order = []

  def log(self, metrics_prefix, metric_name, scalar_value, mode, step):
    key = (metrics_prefix, str(mode), metric_name)
    self.logged.setdefault(key, []).append((step, scalar_value))
    self.order.append((metric_name, step))

  def get_metric_history(self, metrics_prefix, metric_name, mode):
    return np.stack([v for _, v in self.logged[(metrics_prefix, str(mode), metric_name)]])


class StandInSampler:
  """tunix 0.1.7's vanilla rollout (``Sampler`` and ``VanillaRollout.update_params``), the
  parts that touch the model.

  As in tunix: the constructor keeps ``nnx.graphdef(model)`` and ``nnx.variables(model)``
  (``RLCluster`` builds it before the trainer, so before any link); the KV cache comes from
  ``model.init_cache`` and the prompt's mask from ``model.get_attention_mask`` when the
  model has them; prefill and a ``lax.while_loop`` of greedy decode steps run the model
  merged from that graphdef under ``jax.jit``, the cache in the loop's carry; the weight
  sync merges the trainer's ``nnx.Param`` state into the sampler's and refuses a new state
  whose structure differs ("New state must have the same structure as the old state").
  """

  def __init__(self, model, cache_size=T):
    if not hasattr(model, "config"):  # RLCluster._init_cluster
      raise ValueError("`self.rollout_actor` must have a config attribute.")
    self.cache_size = cache_size
    self._graphdef = nnx.graphdef(model)
    self._state = nnx.variables(model)
    self._generate = jax.jit(self._generate_fn, static_argnums=2)

  @property
  def transformer(self):
    return nnx.merge(self._graphdef, self._state)

  def update_params(self, params):
    """``VanillaRollout.update_params`` with ``filter_types=(nnx.Param,)``, then
    ``Sampler.transformer_state``'s setter."""
    flat_old, treedef = jax.tree_util.tree_flatten_with_path(self._state)
    new = dict(jax.tree_util.tree_flatten_with_path(params)[0])
    merged = [new.get(path, x) for path, x in flat_old]
    new_model = nnx.merge(self._graphdef, jax.tree_util.tree_unflatten(treedef, merged))
    state = nnx.variables(new_model, nnx.Param)
    if jax.tree_util.tree_structure(self._state) != jax.tree_util.tree_structure(state):
      raise ValueError("New state must have the same structure as the old state.")
    self._state = state

  def _generate_fn(self, state, prompt, steps):
    model = nnx.merge(self._graphdef, state)
    b, length = prompt.shape
    cache = model.init_cache(b, self.cache_size, model.config.dtype)
    mask = model.get_attention_mask(prompt, inputs_mask=jnp.ones(prompt.shape, bool))
    mask = jnp.pad(mask, ((0, 0), (0, 0), (0, self.cache_size - length)))
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), prompt.shape)
    logits, cache = model(prompt, positions, cache, mask)
    tokens = jnp.zeros((b, length + steps), jnp.int32).at[:, :length].set(prompt)
    tokens = tokens.at[:, length].set(jnp.argmax(logits[:, -1], -1).astype(jnp.int32))

    def step(carry):
      i, tokens, cache = carry
      last = jax.lax.dynamic_slice_in_dim(tokens, i, 1, axis=1)
      seen = jnp.arange(self.cache_size) <= i
      mask = jnp.broadcast_to(seen, (b, 1, self.cache_size))
      logits, cache = model(last, jnp.full((b, 1), i, jnp.int32), cache, mask)
      nxt = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)
      return i + 1, jax.lax.dynamic_update_slice_in_dim(tokens, nxt[:, None], i + 1, 1), cache

    cond = lambda carry: carry[0] < length + steps - 1
    return jax.lax.while_loop(cond, step, (jnp.int32(length), tokens, cache))[1]

  def generate(self, prompt, steps):
    """Greedy continuation of ``prompt`` (``(B, L)`` int32) by ``steps`` tokens."""
    return self._generate(self._state, prompt, steps)


def tunix_toy_grpo(init_scale: float, *, colocated: bool = True, num_iterations: int = 1):
  """tunix's ``RLCluster`` and ``GRPOLearner`` on tunix's toy transformer (float32), the actor
  optimised by ``dynamic_loss_scale(sgd)`` at ``init_scale``, 4 steps of 2 prompts: ``(cluster,
  learner, data)``. ``colocated=False`` puts the rollout on a mesh of its own (a second device).
  Call it with standard promotion (tunix is not strict-clean); needs google-tunix and grain."""
  import grain.python as grain
  from tunix.rl import rl_cluster as rl_cluster_lib
  from tunix.rl.grpo import grpo_learner
  from tunix.rl.rollout import base_rollout
  from tunix.tests import test_common

  class Prompts(grain.RandomAccessDataSource):
    data = ["input string", "hello world", "My name", "hello there"] * 4

    def __getitem__(self, i):
      return self.data[i]

    def __len__(self):
      return len(self.data)

  import jax_lossscale as jls

  vocab = test_common.MockVocab()
  config = test_common.ModelConfig(vocab_size=vocab.GetPieceSize())
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
  if not colocated:
    mesh_of_its_own = np.array(jax.devices()[1:2]).reshape(1, 1)
  Role = rl_cluster_lib.Role
  cluster = rl_cluster_lib.RLCluster(
    actor=test_common.ToyTransformer(config=config, rngs=nnx.Rngs(0)),
    reference=test_common.ToyTransformer(config=config, rngs=nnx.Rngs(0)),
    tokenizer=vocab,
    cluster_config=rl_cluster_lib.ClusterConfig(
      role_to_mesh={
        Role.ACTOR: mesh,
        Role.REFERENCE: mesh,
        Role.ROLLOUT: mesh if colocated else jax.sharding.Mesh(mesh_of_its_own, ("fsdp", "tp")),
      },
      rollout_engine="vanilla",
      training_config=rl_cluster_lib.RLTrainingConfig(
        actor_optimizer=jls.dynamic_loss_scale(optax.sgd(1e-2), init_scale=init_scale),
        eval_every_n_steps=100,
        max_steps=4,
      ),
      rollout_config=base_rollout.RolloutConfig(
        max_tokens_to_generate=6, max_prompt_length=32, kv_cache_size=64
      ),
    ),
  )
  learner = grpo_learner.GRPOLearner(
    rl_cluster=cluster,
    reward_fns=[lambda prompts, completions, **_: [float(len(c)) for c in completions]],
    algo_config=grpo_learner.GRPOConfig(num_generations=2, num_iterations=num_iterations),
  )
  data = grain.MapDataset.source(Prompts()).batch(2).map(lambda x: {"prompts": x, "answer": x})
  return cluster, learner, data
