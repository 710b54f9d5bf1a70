"""The benchmark's variants: one small builder per way of writing the train step.

Every variant runs the same full train step (forward + backward + Adam
update) on a model's ``loss_fn``; a builder takes that ``loss_fn`` and returns
a fresh :class:`Variant` (fresh closures, so nothing is cached across builds).
Builders register themselves with :func:`variant`; :data:`REGISTRY` keeps
their order, which is the column order of the report.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any
from typing import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import layer_scales as _groups
import numpy as np
import optax

import jax_lossscale as jls

LEARNING_RATE = 1e-4
WEIGHT_DECAY = 0.1  # AdamW's (the GPT's), as GPT-2 training recipes
INIT_SCALE = 2.0**16
STATIC_SCALE = 2.0**10  # optax.apply_if_finite: a static scale that never overflows here


class Variant(NamedTuple):
  init: Callable[[Any], Any]  # params -> train state (a pytree, donated)
  step: Callable[..., Any]  # (state, x, y) -> (state, loss)
  describe: Callable[[Any], dict[str, Any]]  # final state -> notes


class Spec(NamedTuple):
  name: str
  label: str
  build: Callable[..., Variant]  # (loss_fn, make_tx) -> Variant
  requires: tuple[str, ...]  # "module" or "module:attribute"
  peer: bool  # another library's loss scaling (the report compares against these)
  plain: bool = False  # built on the model's float32 loss (plain_loss_fn), not the hand-cast one


REGISTRY: dict[str, Spec] = {}


def variant(
  name: str,
  label: str,
  *,
  requires: tuple[str, ...] = (),
  peer: bool = False,
  plain: bool = False,
):
  """Registers the decorated ``build(loss_fn) -> Variant`` under ``name``.

  ``plain=True``: the builder gets the model's float32 loss (``plain_loss_fn``) instead.
  """

  def register(build):
    if name in REGISTRY:
      raise ValueError(f"variant {name!r} is registered twice.")
    REGISTRY[name] = Spec(name, label, build, tuple(requires), peer, plain)
    return build

  return register


def missing(name: str) -> str | None:
  """What variant ``name`` needs and is not installed, or ``None``."""
  for req in REGISTRY[name].requires:
    module, _, attr = req.partition(":")
    if importlib.util.find_spec(module) is None:
      return req
    if attr and not hasattr(importlib.import_module(module), attr):
      return req
  return None


def adam() -> optax.GradientTransformation:
  """The optimizer of every model but the GPT: plain Adam."""
  return optax.adam(LEARNING_RATE)


def adamw() -> optax.GradientTransformation:
  """The GPT's optimizer (``bench_models``' ``gpt``, ``bench_large.py``, the GPU plan): AdamW
  (weight decay 0.1, as GPT-2 training recipes)."""
  return optax.adamw(LEARNING_RATE, weight_decay=WEIGHT_DECAY)


def make_variant(
  name: str,
  loss_fn: Callable[..., Any],
  make_tx: Callable[[], Any] | None = None,
  plain_loss_fn: Callable[..., Any] | None = None,
) -> Variant:
  """Variant ``name`` of the step of ``loss_fn``, with ``make_tx()`` (default Adam) inside.

  A ``plain`` variant (autocast) is built on ``plain_loss_fn``, the same model written for
  float32.
  """
  if name not in REGISTRY:
    raise ValueError(f"variant must be one of {list(REGISTRY)}, got {name!r}.")
  spec = REGISTRY[name]
  if spec.plain:
    if plain_loss_fn is None:
      raise ValueError(f"variant {name!r} needs the model's plain_loss_fn (float32 model).")
    loss_fn = plain_loss_fn
  return spec.build(loss_fn, make_tx or adam)


def scaled_loss_fn(loss_fn, scale_state, x, y):
  """``p -> (jax_lossscale.scale_loss(loss), loss)``, for ``jax.grad(..., has_aux=True)``."""

  def scaled(p):
    loss = loss_fn(p, x, y)
    return jls.scale_loss(loss, scale_state), loss

  return scaled


def _scale_notes(scale_state) -> dict[str, Any]:
  return {"scale": float(scale_state.scale), "skipped_steps": int(scale_state.skipped_steps)}


# ----------------------------------------------------------------------------- this library


@variant("baseline", "plain optax.adam")
def baseline(loss_fn, make_tx):
  tx = make_tx()

  def step(state, x, y):
    params, opt_state = state
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  return Variant(lambda p: (p, tx.init(p)), step, lambda s: {})


def scaled_variant(stx, loss_fn) -> Variant:
  """The step of ``loss_fn`` with the scaler ``stx`` (``jls.dynamic_loss_scale`` or
  ``jls.no_loss_scale`` of an optimizer): ``jls.scale_loss``, ``jax.grad``, ``stx.update``."""

  def step(state, x, y):
    params, opt_state = state
    grads, loss = jax.grad(scaled_loss_fn(loss_fn, opt_state, x, y), has_aux=True)(params)
    updates, opt_state = stx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  return Variant(
    lambda p: (p, stx.init(p)), step, lambda s: _scale_notes(jls.get_scale_state(s[1]))
  )


@variant("jax_lossscale", "jax_lossscale.dynamic_loss_scale")
def jax_lossscale(loss_fn, make_tx):
  return scaled_variant(jls.dynamic_loss_scale(make_tx(), init_scale=INIT_SCALE), loss_fn)


@variant("jls_retry", "jax_lossscale.retry_on_overflow (max_retries=3) + dynamic_loss_scale")
def jls_retry(loss_fn, make_tx):
  """The ``jax_lossscale`` step with its gradients from ``retry_on_overflow``.

  Nothing overflows in the benchmark (its scale starts at 2**16 and the models' gradients
  stay below float16's range), so the pair measures what the retry costs when it is not
  used: the loop test after the first attempt, and the loop's second copy of the
  backward pass in the compiled program.
  """
  stx = jls.dynamic_loss_scale(make_tx(), init_scale=INIT_SCALE)

  def step(state, x, y):
    params, opt_state = state
    opt_state, out = jls.retry_on_overflow(loss_fn, opt_state, max_retries=3)(params, x, y)
    updates, opt_state = stx.update(out.grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), out.value

  return Variant(
    lambda p: (p, stx.init(p)), step, lambda s: _scale_notes(jls.get_scale_state(s[1]))
  )


@variant(
  "jls_layer_scales",
  "per-layer-group scaler (private, not shipped), one group: the per-group rule's cost",
)
def jls_layer_scales(loss_fn, make_tx):
  # One group: the benchmark models have no boundaries; the update's cost (a scale per
  # leaf, the statistics, the rule) is the per-group scaler's, whatever the group count.
  stx = _groups.layer_loss_scale(make_tx(), lambda p: jax.tree_util.tree_map(lambda _: 0, p))

  def step(state, x, y):
    params, opt_state = state

    def scaled(p):
      loss = loss_fn(p, x, y)
      return _groups.scale_loss_by_layers(loss, opt_state), loss

    grads, loss = jax.grad(scaled, has_aux=True)(params)
    updates, opt_state = stx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  def describe(state):
    s = _groups.get_layer_scale_state(state[1])
    return {"scale": float(s.scales[-1]), "skipped_steps": int(s.skipped_steps)}

  return Variant(lambda p: (p, stx.init(p)), step, describe)


@variant("jls_trainstate", "jax_lossscale.flax.TrainState", requires=("flax",))
def jls_trainstate(loss_fn, make_tx):
  from jax_lossscale import flax as jls_flax

  tx = make_tx()

  def init(p):
    return jls_flax.TrainState.create(
      apply_fn=None,
      params=p,
      tx=tx,
      dynamic_scale=jls.DynamicScaleState.create(init_scale=INIT_SCALE),
    )

  def step(state, x, y):
    out = state.value_and_grad(loss_fn)(state.params, x, y)
    return state.apply_gradients(grads=out.grads, finite=out.finite), out.value

  return Variant(init, step, lambda s: {"scale": float(s.dynamic_scale.scale)})


@variant(
  "jls_autocast",
  "jax_lossscale.dynamic_loss_scale + jls.autocast (float32 model)",
  requires=("jax_lossscale:autocast",),
  plain=True,
)
def jls_autocast(plain_loss_fn, make_tx):
  """The ``jax_lossscale`` step on ``jls.autocast`` of the float32 model (float16 compute).

  The same step as ``jax_lossscale``, whose model is cast by hand: the pair measures what
  autocast costs in trace (lower) time, step time and temporary memory.
  """
  return jax_lossscale(jls.autocast(plain_loss_fn, jnp.float16), make_tx)


# ----------------------------------------------------------------------------- peers


@variant("flax", "Flax DynamicScale + where", requires=("flax",), peer=True)
def flax_dynamic_scale(loss_fn, make_tx):
  from flax.training import dynamic_scale as flax_ds

  tx = make_tx()

  def init(p):
    ds = flax_ds.DynamicScale(
      scale=jnp.asarray(INIT_SCALE, jnp.float32), fin_steps=jnp.zeros([], jnp.int32)
    )
    return (p, tx.init(p), ds)

  def step(state, x, y):
    params, opt_state, ds = state
    ds, is_fin, loss, grads = ds.value_and_grad(loss_fn)(params, x, y)
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    # As flax/examples/imagenet/train.py.
    select = lambda a, b: jnp.where(is_fin, a, b)
    new_opt_state = jax.tree_util.tree_map(select, new_opt_state, opt_state)
    new_params = jax.tree_util.tree_map(select, new_params, params)
    return (new_params, new_opt_state, ds), loss

  return Variant(init, step, lambda s: {"scale": float(s[2].scale)})


@variant("jmp", "jmp DynamicLossScale + select_tree", requires=("jmp",), peer=True)
def jmp_dynamic_loss_scale(loss_fn, make_tx):
  import jmp

  tx = make_tx()

  # jmp 0.0.4's DynamicLossScale cannot be a `jit(...).lower` argument on
  # current JAX (its __post_init__ calls eval_shape on the ArgInfo
  # placeholders that lower() unflattens), so the train state carries its
  # two arrays and the step rebuilds it, as one would with a checkpoint.
  def init(p):
    ls = jmp.DynamicLossScale(jnp.asarray(INIT_SCALE, jnp.float32))
    return (p, tx.init(p), (ls.loss_scale, ls.counter))

  def step(state, x, y):
    params, opt_state, (scale, counter) = state
    loss_scale = jmp.DynamicLossScale(scale, counter)

    def scaled(p):
      loss = loss_fn(p, x, y)
      return loss_scale.scale(loss), loss

    grads, loss = jax.grad(scaled, has_aux=True)(params)
    grads = loss_scale.unscale(grads)
    grads_finite = jmp.all_finite(grads)
    loss_scale = loss_scale.adjust(grads_finite)
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    params, opt_state = jmp.select_tree(
      grads_finite, (new_params, new_opt_state), (params, opt_state)
    )
    return (params, opt_state, (loss_scale.loss_scale, loss_scale.counter)), loss

  return Variant(init, step, lambda s: {"scale": float(s[2][0])})


@variant("optax_aif", "optax.apply_if_finite (static scale)", peer=True)
def optax_apply_if_finite(loss_fn, make_tx):
  atx = optax.apply_if_finite(make_tx(), max_consecutive_errors=1_000_000)
  inv = np.float32(1.0 / STATIC_SCALE)

  def step(state, x, y):
    params, opt_state = state

    def scaled(p):
      loss = loss_fn(p, x, y)
      return loss * np.float32(STATIC_SCALE), loss

    grads, loss = jax.grad(scaled, has_aux=True)(params)
    grads = jax.tree_util.tree_map(lambda g: g * inv, grads)
    updates, opt_state = atx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  return Variant(
    lambda p: (p, atx.init(p)),
    step,
    lambda s: {"skipped_steps": int(s[1].total_notfinite), "scale": STATIC_SCALE},
  )


# ----------------------------------------------------------------------------- references


@variant("cond_ref", "reference: same scaler, lax.cond skip (not shipped)")
def cond_reference(loss_fn, make_tx):
  tx = make_tx()

  def init(p):
    return (p, tx.init(p), jls.DynamicScaleState.create(init_scale=INIT_SCALE))

  def step(state, x, y):
    params, opt_state, ds = state
    grads, loss = jax.grad(scaled_loss_fn(loss_fn, ds, x, y), has_aux=True)(params)
    grads, finite = jls.unscale_and_check(grads, ds)

    def apply(operands):
      params, opt_state = operands
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    params, opt_state = jax.lax.cond(finite, apply, lambda o: o, (params, opt_state))
    return (params, opt_state, jls.update_scale(ds, finite)), loss

  return Variant(init, step, lambda s: _scale_notes(s[2]))


@variant(
  "jls_diagnostics",
  "jax_lossscale.dynamic_loss_scale + grad_diagnostics",
  requires=("jax_lossscale.diagnostics:grad_diagnostics",),
)
def jls_with_diagnostics(loss_fn, make_tx):
  """The ``jax_lossscale`` step plus the per-layer diagnostics of every step.

  The diagnostics (a flat dict of scalars) are kept in the train state, as a
  logger's buffer would hold the last step's values, so XLA cannot drop them.
  """
  stx = jls.dynamic_loss_scale(make_tx(), init_scale=INIT_SCALE)

  def diagnose(grads, opt_state):
    return jls.diagnostics.grad_diagnostics(grads, jls.get_scale_state(opt_state).scale)

  def init(p):
    opt_state = stx.init(p)
    shapes = jax.eval_shape(diagnose, p, opt_state)
    return (p, opt_state, jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))

  def step(state, x, y):
    params, opt_state, _ = state
    grads, loss = jax.grad(scaled_loss_fn(loss_fn, opt_state, x, y), has_aux=True)(params)
    diagnostics = diagnose(grads, opt_state)
    updates, opt_state = stx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state, diagnostics), loss

  def describe(state):
    notes = _scale_notes(jls.get_scale_state(state[1]))
    notes["diagnostics"] = len(state[2])
    return notes

  return Variant(init, step, describe)


VARIANTS = list(REGISTRY)
PEERS = [name for name, spec in REGISTRY.items() if spec.peer]
VARIANT_LABELS = {name: spec.label for name, spec in REGISTRY.items()}
