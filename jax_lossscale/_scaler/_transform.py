"""The Optax wrappers: dynamic, static and disabled loss scaling."""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jax_lossscale._scaler._find import find_one
from jax_lossscale._scaler._fp8 import FP8_META
from jax_lossscale._scaler._fp8 import has_fp8_meta
from jax_lossscale._scaler._numerics import is_float
from jax_lossscale._scaler._numerics import promote_floats
from jax_lossscale._scaler._numerics import unscale_and_check
from jax_lossscale._scaler._rule import update_scale
from jax_lossscale._scaler._sharding import all_devices_finite
from jax_lossscale._scaler._sharding import place_like_params
from jax_lossscale._scaler._signals import check_gradient_dtypes
from jax_lossscale._scaler._skip import skip_step
from jax_lossscale._scaler._skip import skipped_updates
from jax_lossscale._scaler._state import CONFIG_FIELDS
from jax_lossscale._scaler._state import DEFAULT_CONFIG
from jax_lossscale._scaler._state import DynamicScaleConfig
from jax_lossscale._scaler._state import DynamicScaleState
from jax_lossscale._scaler._state import check_init_scale
from jax_lossscale._scaler._state import config_from
from jax_lossscale._typing import AxisName


class LossScaleState(NamedTuple):
  """Optimizer state of the loss-scaling wrappers.

  Attributes:
    loss_scale: the :class:`DynamicScaleState` (scale, trackers, counters).
    inner_state: the wrapped transformation's state; float16/bfloat16 leaves
      of ``params`` are promoted to float32 before ``inner.init`` sees them.
  """

  loss_scale: DynamicScaleState
  inner_state: optax.OptState


def _update_dtype(update: Any, grad: Any, param: Any) -> Any:
  """The dtype an update is returned in: the param's if it is wider than the gradient's."""
  dtype = jnp.result_type(grad)
  if param is not None and is_float(param) and is_float(grad):
    if jnp.result_type(param).itemsize > dtype.itemsize:
      dtype = jnp.result_type(param)
  return jnp.asarray(update).astype(dtype)


def _cast_updates(new_updates: Any, grads: Any, params: Any) -> Any:
  """Each update in its gradient's dtype, or in its param's when that is wider."""
  none = lambda x: x is None
  if params is None:
    params = jax.tree_util.tree_map(lambda _: None, grads, is_leaf=none)

  def cast(u, g, p):
    return None if u is None else _update_dtype(u, g, p)

  return jax.tree_util.tree_map(cast, new_updates, grads, params, is_leaf=none)


def _check_state(state: Any, config: DynamicScaleConfig) -> None:
  if not isinstance(state, LossScaleState):
    raise TypeError(
      "state must be the LossScaleState made by this transformation's init, "
      f"got {type(state).__name__}."
    )
  # A dynamic scaler's init_scale only sets the first scale: a state restored
  # mid-run (from a checkpoint, or from torch) may carry another one. A static
  # scaler's init_scale is its scale. Every other field is compared as stored
  # (never re-validated: a state whose min_scale is above this init_scale is a
  # config mismatch, not a bad init_scale).
  held = state.loss_scale.config
  if any(
    getattr(held, name) != getattr(config, name)
    for name in CONFIG_FIELDS
    if name != "init_scale" or not config.dynamic
  ):
    raise ValueError(
      "state was made by a loss scaler with another configuration: the state "
      f"holds {state.loss_scale.config}, this transformation was built with "
      f"{config}. Build the state with this transformation's init (or the "
      "transformation with the state's settings)."
    )


def _loss_scale_transform(
  inner: optax.GradientTransformation,
  config: DynamicScaleConfig,
  axis_name: Any | None,
) -> optax.GradientTransformationExtraArgs:
  if not isinstance(inner, optax.GradientTransformation):
    raise TypeError(f"inner must be an optax.GradientTransformation, got {type(inner).__name__}.")
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    state = LossScaleState(
      loss_scale=DynamicScaleState.from_config(config),
      inner_state=inner.init(promote_floats(params)),
    )
    return place_like_params(state, params)

  def update_fn(updates, state, params=None, **extra_args):
    _check_state(state, config)
    if has_fp8_meta(updates):
      raise ValueError(
        f"updates hold Flax fp8 meta-state (a {FP8_META!r} collection): those leaves "
        "are new fp8 scales and amax histories, not gradients, and must not be unscaled "
        "or applied. Hand the optimizer grads['params'] only, as Flax's "
        "TrainState.apply_gradients does."
      )
    if config.dynamic:
      check_gradient_dtypes(updates)
    grads, finite = unscale_and_check(updates, state.loss_scale.scale)
    finite = all_devices_finite(finite, axis_name)
    new_updates, new_inner = inner.update(
      grads, state.inner_state, promote_floats(params), **extra_args
    )
    new_updates = _cast_updates(new_updates, updates, params)
    new_updates, new_inner = skip_step(
      finite, new_updates, skipped_updates(new_updates), new_inner, state.inner_state
    )
    new_scale = update_scale(state.loss_scale, finite)
    return new_updates, LossScaleState(loss_scale=new_scale, inner_state=new_inner)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def dynamic_loss_scale(
  inner: optax.GradientTransformation,
  *,
  init_scale: float = DEFAULT_CONFIG.init_scale,
  growth_factor: float = DEFAULT_CONFIG.growth_factor,
  backoff_factor: float = DEFAULT_CONFIG.backoff_factor,
  growth_interval: int = DEFAULT_CONFIG.growth_interval,
  min_scale: float = DEFAULT_CONFIG.min_scale,
  max_scale: float = DEFAULT_CONFIG.max_scale,
  hysteresis: int = DEFAULT_CONFIG.hysteresis,
  axis_name: AxisName | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Wraps ``inner`` with ``torch.amp.GradScaler``'s dynamic loss scaling.

  ``update`` receives the gradients of the *scaled* loss (see
  :func:`scale_loss`). It unscales them by multiplying with the float32
  reciprocal of the scale, checks them for inf/NaN in the same pass, runs
  ``inner`` on the true gradients and adjusts the scale. When any gradient is
  non-finite the whole step is skipped with ``jnp.where`` (no ``lax.cond``, no
  host control flow, no host sync): the returned updates are zeros (``-0.0``,
  so ``optax.apply_updates`` leaves params bit-identical) and ``inner``'s state
  is returned unchanged, so its step count and schedules do not advance.

  Float16/bfloat16 leaves are promoted to float32 for ``inner`` (gradients,
  params and therefore ``inner``'s state). Each update comes back in its
  gradient's dtype, or in its param's dtype when ``params`` are given and
  wider (float16 gradients of float32 params give float32 updates, so small
  updates are not rounded away; float16 gradients of float16 params stay
  float16).

  The state must have this transformation's configuration: a state built
  with other settings (another ``growth_interval``, or a static scaler's
  state) is refused with a ``ValueError`` at trace time. Only ``init_scale``
  may differ (it sets the first scale only), so a state restored mid-run,
  e.g. by :func:`from_torch_state_dict`, is accepted.

  Args:
    inner: the transformation to apply to the unscaled gradients.
    init_scale: initial scale (torch: 2**16).
    growth_factor: growth multiplier, > 1 (torch: 2.0).
    backoff_factor: backoff multiplier, in (0, 1) (torch: 0.5).
    growth_interval: clean steps in a row before growing (torch: 2000).
    min_scale: floor of the scale (default: smallest normal float32).
    max_scale: ceiling of the scale (default: largest float32).
    hysteresis: overflows tolerated before backing off (1 = torch).
    axis_name: inside ``pmap``/``shard_map``, the axis over which the
      overflow flag is combined, so that every device skips together. Not
      needed under ``jit`` with sharded arrays.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs`; extra keyword
    arguments of ``update`` are passed through to ``inner``.

  Raises:
    TypeError: naming the argument, for an argument of the wrong type (``inner``
      not a ``GradientTransformation``, a non-number ``init_scale``...).
    ValueError: naming the argument, for invalid configuration.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import jax_lossscale as jls
    >>> params = {"w": jnp.ones(3)}
    >>> tx = jls.dynamic_loss_scale(optax.sgd(0.1))
    >>> opt_state = tx.init(params)
    >>> loss_fn = lambda p: jnp.sum(p["w"] ** 2)
    >>> scaled_loss = lambda p: jls.scale_loss(loss_fn(p), opt_state)
    >>> grads = jax.grad(scaled_loss)(params)        # gradients of the scaled loss
    >>> updates, opt_state = tx.update(grads, opt_state, params)
    >>> optax.apply_updates(params, updates)["w"]    # 1 - 0.1 * 2
    Array([0.8, 0.8, 0.8], dtype=float32)
  """
  config = config_from(locals(), dynamic=True)
  return _loss_scale_transform(inner, config, axis_name)


def static_loss_scale(
  inner: optax.GradientTransformation,
  scale: float,
  *,
  axis_name: AxisName | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Wraps ``inner`` with a fixed loss scale.

  Like :func:`dynamic_loss_scale` but the scale never changes: gradients are
  unscaled by ``scale``, and a step with non-finite gradients is still skipped
  (and counted), never applied. A state made with another ``scale`` (or by a
  dynamic scaler) is refused with a ``ValueError``.

  Args:
    inner: the transformation to apply to the unscaled gradients.
    scale: the fixed loss scale, positive and finite.
    axis_name: see :func:`dynamic_loss_scale`.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs`.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import jax_lossscale as jls
    >>> tx = jls.static_loss_scale(optax.sgd(1.0), 128.0)
    >>> state = tx.init({"w": jnp.zeros(2)})
    >>> updates, state = tx.update({"w": jnp.array([128.0, 256.0])}, state)
    >>> updates["w"], float(jls.get_scale_state(state).scale)
    (Array([-1., -2.], dtype=float32), 128.0)
  """
  config = DynamicScaleConfig(init_scale=check_init_scale(scale, "scale"), dynamic=False)
  return _loss_scale_transform(inner, config, axis_name)


def no_loss_scale(
  inner: optax.GradientTransformation,
  *,
  axis_name: AxisName | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Loss scaling switched off: scale 1, with the same state and API.

  For bfloat16 and float32 training, which need no loss scaling: the same
  training code (``scale_loss``, ``get_scale_state``, metrics) keeps working.
  Multiplying by 1 is exact, so updates equal ``inner``'s bit for bit; steps
  with non-finite gradients are still skipped, as by ``optax.apply_if_finite``
  (but never given up on).

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import jax_lossscale as jls
    >>> tx = jls.no_loss_scale(optax.sgd(1.0))
    >>> state = tx.init({"w": jnp.zeros(2)})
    >>> tx.update({"w": jnp.array([1.0, 2.0])}, state)[0]["w"]
    Array([-1., -2.], dtype=float32)
  """
  return static_loss_scale(inner, 1.0, axis_name=axis_name)


def get_inner_state(opt_state: optax.OptState) -> optax.OptState:
  """The wrapped optimizer's state inside a loss scaler's state.

  For helpers that need the inner optimizer's own state, e.g.
  ``optax.contrib.schedule_free_eval_params(jls.get_inner_state(opt_state),
  params)``. Searches any nesting (``chain``, ``multi_steps``, a train state),
  like :func:`get_scale_state`. Pure structure inspection: fine inside
  ``jit``.

  Args:
    opt_state: a :class:`LossScaleState`, or a pytree containing exactly one.

  Returns:
    Its ``inner_state``.

  Raises:
    ValueError: if there is no :class:`LossScaleState`, or more than one.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import jax_lossscale as jls
    >>> opt_state = jls.dynamic_loss_scale(optax.adam(1e-3)).init({"w": jnp.zeros(2)})
    >>> type(jls.get_inner_state(opt_state)[0]).__name__
    'ScaleByAdamState'
  """
  error = lambda found: ValueError(
    f"opt_state must hold exactly one LossScaleState, found {len(found)} in "
    f"{type(opt_state).__name__}."
  )
  return find_one(opt_state, lambda x: isinstance(x, LossScaleState), error).inner_state
