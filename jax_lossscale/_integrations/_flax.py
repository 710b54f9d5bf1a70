"""The implementation of :mod:`jax_lossscale.flax` (whose docstring says how to use it)."""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import Callable
from typing import Sequence

import jax
import jax.numpy as jnp
import optax

try:
  from flax import serialization
  from flax import struct
  from flax.training import train_state
except ImportError as e:  # pragma: no cover - exercised in a venv without flax
  raise ImportError(
    "jax_lossscale.flax needs Flax: install the extra, pip install 'jax-lossscale[flax]'."
  ) from e

from jax_lossscale._integrations._flax_migration import UNPACKING_CHANGED
from jax_lossscale._integrations._flax_migration import checked_scale_state
from jax_lossscale._integrations._flax_migration import is_finite_flag
from jax_lossscale._integrations._flax_migration import refuse_positional
from jax_lossscale._integrations._model_state import select_tree
from jax_lossscale._scaler._fp8 import gradient_leaves
from jax_lossscale._scaler._fp8 import join_variables
from jax_lossscale._scaler._fp8 import map_gradients
from jax_lossscale._scaler._fp8 import split_variables
from jax_lossscale._scaler._loss import loss_and_aux
from jax_lossscale._scaler._loss import scale_loss
from jax_lossscale._scaler._numerics import all_finite
from jax_lossscale._scaler._numerics import compute_dtype
from jax_lossscale._scaler._numerics import is_float
from jax_lossscale._scaler._numerics import promote_floats
from jax_lossscale._scaler._numerics import refuse_complex
from jax_lossscale._scaler._numerics import unscale_and_check
from jax_lossscale._scaler._retry import DEFAULT_MAX_RETRIES
from jax_lossscale._scaler._retry import check_max_retries
from jax_lossscale._scaler._retry import retry_loop
from jax_lossscale._scaler._rule import update_scale
from jax_lossscale._scaler._sharding import across_axis
from jax_lossscale._scaler._sharding import place_like_params
from jax_lossscale._scaler._skip import skip_step
from jax_lossscale._scaler._state import DATA_FIELDS
from jax_lossscale._scaler._state import DynamicScaleState
from jax_lossscale._scaler._state import get_scale_state
from jax_lossscale._scaler._state import scale_states
from jax_lossscale._typing import ArrayLike
from jax_lossscale._typing import AxisName
from jax_lossscale._typing import ScaleLike

__all__ = ("ScaledValueAndGrad", "TrainState", "value_and_grad")


@struct.dataclass
class ScaledValueAndGrad:
  """What :func:`value_and_grad` returns: read it by name.

  A pytree (return it from ``jit``, carry it through ``lax`` loops), but not
  a tuple: unpacking or indexing it raises ``TypeError``. Flax's
  ``DynamicScale.value_and_grad`` returns ``(dynamic_scale, is_fin, aux,
  grads)``; kept after the switch, that unpacking would bind the gradients
  to ``aux`` and fail far from here (``aux[1]``: ``KeyError: 1``), so it is
  refused where it is written, with what to write instead.

  Attributes:
    value: the loss as ``fun`` computed it (not multiplied by the scale).
    aux: ``fun``'s auxiliary output (``None`` without ``has_aux``); never
      scaled. Flax's ``aux`` is ``(loss, aux)``: its ``aux[1]`` is this.
    grads: the true (unscaled) gradients, in ``promote_types(dtype,
      float32)`` of each parameter (float16/bfloat16 gradients come out as
      float32). With ``argnums`` a sequence, a tuple of such pytrees.
    finite: bool scalar: were all gradients finite? If not, the step must be
      skipped (:meth:`TrainState.apply_gradients` does so).

  Examples:
    >>> import jax.numpy as jnp
    >>> import jax_lossscale as jls
    >>> out = jls.flax.value_and_grad(lambda w: jnp.sum(w ** 2), jls.DynamicScaleState.create())(
    ...   jnp.ones(2))
    >>> out.value, out.finite
    (Array(2., dtype=float32), Array(True, dtype=bool))
    >>> dynamic_scale, is_fin, aux, grads = out  # Flax's order
    Traceback (most recent call last):
    TypeError: ScaledValueAndGrad cannot be unpacked: read it by name. ...
  """

  value: jax.Array
  aux: Any
  grads: Any
  finite: jax.Array

  def __iter__(self) -> Any:
    raise refuse_positional("unpacked")

  def __getitem__(self, index: Any) -> Any:
    raise refuse_positional(f"indexed ([{index!r}])")


def value_and_grad(
  fun: Callable[..., Any],
  scale: ScaleLike,
  *,
  argnums: int | Sequence[int] = 0,
  has_aux: bool = False,
  axis_name: AxisName | None = None,
) -> Callable[..., ScaledValueAndGrad]:
  """``jax.value_and_grad`` of the scaled loss, returning unscaled gradients.

  What Flax's ``DynamicScale.value_and_grad`` does, as a function of the
  state: the returned function differentiates ``scale * fun(...)`` (in
  float32 at least, see :func:`jax_lossscale.scale_loss`), then unscales the
  gradients and checks them for inf/NaN in one pass. Unlike Flax's, the
  scaler state is only read, not advanced (:meth:`TrainState.apply_gradients`
  advances it, with :func:`jax_lossscale.update_scale`), and the result is a
  :class:`ScaledValueAndGrad` read by name (``out.value``, ``out.aux``,
  ``out.grads``, ``out.finite``), not Flax's ``(dynamic_scale, is_fin, aux,
  grads)``: unpacking it raises ``TypeError``. Pure ``jnp``: use it inside
  ``jit``.

  Args:
    fun: the loss function; returns a scalar loss, or ``(loss, aux)`` with
      ``has_aux``.
    scale: a :class:`DynamicScaleState`, or any tree holding exactly one (a
      :class:`TrainState`).
    argnums: as in ``jax.value_and_grad``.
    has_aux: as in ``jax.value_and_grad``.
    axis_name: inside ``pmap``/``shard_map``, the axis over which the
      gradients are averaged (``lax.pmean``) before the check, so that every
      device sees the same gradients and takes the same skip decision. The
      returned ``value`` is this device's loss.

  Flax fp8 meta-state (leaves under an ``_overwrite_with_gradient`` key, the
  new scales and amax histories of ``nn.Fp8DirectDotGeneralOp``) is returned
  as the backward pass made it: it is not multiplied by the loss scale, so it
  is not unscaled, and it takes no part in ``finite``. With ``axis_name`` it
  is combined with ``lax.pmax`` (the largest amax wins).

  Returns:
    A function with ``fun``'s signature returning a
    :class:`ScaledValueAndGrad` (``value``, ``aux``, ``grads``, ``finite``).

  Examples:
    >>> import jax.numpy as jnp
    >>> import jax_lossscale as jls
    >>> from jax_lossscale.flax import value_and_grad
    >>> ds = jls.DynamicScaleState.create(init_scale=1024.0)
    >>> loss_fn = lambda w: jnp.sum(w ** 2)
    >>> out = value_and_grad(loss_fn, ds)(jnp.array([1.0, 2.0]))
    >>> out.value, out.grads, out.finite
    (Array(5., dtype=float32), Array([2., 4.], dtype=float32), Array(True, dtype=bool))
  """
  if not callable(fun):
    raise TypeError(f"fun must be callable, got {type(fun).__name__}.")
  dynamic_scale = get_scale_state(scale)

  def scaled_fun(*args, **kwargs):
    loss, aux = loss_and_aux(fun(*args, **kwargs), has_aux)
    return scale_loss(loss, dynamic_scale), (loss, aux)

  grad_fn = jax.value_and_grad(scaled_fun, argnums=argnums, has_aux=True)

  def wrapped(*args, **kwargs) -> ScaledValueAndGrad:
    (_, (loss, aux)), grads = grad_fn(*args, **kwargs)
    refuse_complex(grads)

    def unscale(leaves):
      leaves = across_axis(jax.lax.pmean, leaves, axis_name)
      return unscale_and_check(leaves, dynamic_scale.scale)

    # fp8 meta (new scales and amax histories) is not scaled by the loss scale:
    # never unscaled, never checked; across devices the largest amax (and so
    # the largest fp8 scale) wins, as one global computation would find.
    meta = lambda leaves: across_axis(jax.lax.pmax, leaves, axis_name)
    grads, finite = map_gradients(unscale, grads, meta)
    return ScaledValueAndGrad(value=loss, aux=aux, grads=grads, finite=finite)

  return wrapped


def _apply_updates(params: Any, updates: Any) -> Any:
  """``optax.apply_updates`` with explicit casts (strict dtype promotion safe)."""

  def apply(p, u):
    if p is None or u is None or not is_float(p):
      return p
    p = jnp.asarray(p)
    dt = max(compute_dtype(p.dtype), compute_dtype(jnp.result_type(u)), key=lambda d: d.itemsize)
    return (p.astype(dt) + jnp.asarray(u).astype(dt)).astype(p.dtype)

  return jax.tree_util.tree_map(apply, params, updates, is_leaf=lambda x: x is None)


class TrainState(train_state.TrainState):
  """Flax's ``TrainState`` with a ``dynamic_scale`` field and skipping updates.

  Use a plain Optax optimizer as ``tx`` (the scaler lives in this state, not
  in the optimizer), compute gradients with :meth:`value_and_grad` (or
  :func:`value_and_grad`) and call :meth:`apply_gradients` with their
  ``finite`` flag. A step with non-finite gradients is skipped with
  ``jnp.where`` (no ``lax.cond``, no host sync): ``step``, ``params``,
  ``opt_state`` and every field passed to :meth:`apply_gradients` (the
  model's ``batch_stats``) stay bit-identical, and the scale backs off.

  Scaling switched off (Flax's ``dynamic_scale=None``) is
  ``dynamic_scale=DynamicScaleState.create(init_scale=1.0, dynamic=False)``:
  exact, and non-finite steps are still skipped. ``dynamic_scale=None``
  here means torch's default scaler.

  ``tx`` is initialised (and updated) with float16/bfloat16 params promoted
  to float32, as :func:`jax_lossscale.dynamic_loss_scale` does, so its state
  is float32; params keep their dtypes.

  Attributes:
    dynamic_scale: the :class:`DynamicScaleState`.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import jax_lossscale as jls
    >>> from jax_lossscale.flax import TrainState
    >>> state = TrainState.create(apply_fn=None, params={"w": jnp.ones(2)},
    ...                           tx=optax.sgd(0.5))
    >>> @jax.jit
    ... def train_step(state, x):
    ...   loss_fn = lambda p: jnp.sum((p["w"] * x) ** 2)
    ...   out = state.value_and_grad(loss_fn)(state.params)
    ...   return state.apply_gradients(grads=out.grads, finite=out.finite), out.value
    >>> state, loss = train_step(state, jnp.array([1.0, 1.0]))
    >>> loss, state.params["w"], int(state.step)
    (Array(2., dtype=float32), Array([0., 0.], dtype=float32), 1)
    >>> state, _ = train_step(state, jnp.array([jnp.inf, 1.0]))  # overflow: skipped
    >>> state.params["w"], int(state.step), float(state.dynamic_scale.scale)
    (Array([0., 0.], dtype=float32), 1, 32768.0)
  """

  dynamic_scale: DynamicScaleState = struct.field(pytree_node=True)

  @classmethod
  def create(
    cls,
    *,
    apply_fn: Callable[..., Any],
    params: optax.Params,
    tx: optax.GradientTransformation,
    dynamic_scale: DynamicScaleState | None = None,
    **kwargs: Any,
  ) -> TrainState:
    """A new state with ``step=0`` (int32), ``opt_state`` and the scaler.

    Args:
      apply_fn: usually ``model.apply``.
      params: the parameters.
      tx: a plain Optax optimizer (not wrapped by ``dynamic_loss_scale``).
      dynamic_scale: the scaler state; default
        ``DynamicScaleState.create()`` (torch's defaults).
      **kwargs: further fields of a subclass.

    Raises:
      TypeError: if ``dynamic_scale`` is not a :class:`DynamicScaleState`.
      ValueError: if ``tx`` already carries a loss scaler.
    """
    if dynamic_scale is None:
      dynamic_scale = DynamicScaleState.create()
    if not isinstance(dynamic_scale, DynamicScaleState):
      raise TypeError(
        f"dynamic_scale must be a DynamicScaleState, got {type(dynamic_scale).__name__}."
      )
    params_with_opt, _ = split_variables(params)
    opt_state = place_like_params(tx.init(promote_floats(params_with_opt)), params_with_opt)
    if scale_states(opt_state):
      raise ValueError(
        "tx already holds a loss scaler (dynamic_loss_scale/static_loss_scale); "
        "use it with flax.training.train_state.TrainState, or pass a plain "
        "optimizer here, not both."
      )
    return cls(
      step=place_like_params(jnp.zeros([], jnp.int32), params_with_opt),
      apply_fn=apply_fn,
      params=params,
      tx=tx,
      opt_state=opt_state,
      dynamic_scale=place_like_params(dynamic_scale, params_with_opt),
      **kwargs,
    )

  def value_and_grad(
    self,
    fun: Callable[..., Any],
    *,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    axis_name: AxisName | None = None,
  ) -> Callable[..., ScaledValueAndGrad]:
    """:func:`value_and_grad` with this state's ``dynamic_scale``."""
    return value_and_grad(
      fun, self.dynamic_scale, argnums=argnums, has_aux=has_aux, axis_name=axis_name
    )

  def retry_value_and_grad(
    self,
    fun: Callable[..., Any],
    *,
    max_retries: int = DEFAULT_MAX_RETRIES,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    axis_name: AxisName | None = None,
  ) -> Callable[..., tuple[TrainState, ScaledValueAndGrad]]:
    """:meth:`value_and_grad` that recomputes an overflowing batch instead of losing it.

    On inf/NaN gradients the scale backs off by the torch rule and the same
    batch's gradients are computed again at the new scale, up to
    ``max_retries`` times, in the same jitted step (see
    :func:`jax_lossscale.retry_on_overflow`, whose rule this is: each
    overflowing attempt counts as a skipped step of ``dynamic_scale``). Pass
    the returned gradients to :meth:`apply_gradients` of the returned state,
    which applies them once, or skips the step if the last retry overflowed
    too.

    Args:
      fun: the loss function, pure (pass a dropout key as an argument).
      max_retries: how many recomputations at most, ``>= 0``; 0 is
        :meth:`value_and_grad`, bit for bit.
      argnums: as in :func:`value_and_grad`.
      has_aux: as in :func:`value_and_grad`.
      axis_name: as in :func:`value_and_grad` (the retry decision is then
        the same on every device).

    Returns:
      A function with ``fun``'s signature returning ``(state, out)``: this
      state with ``dynamic_scale`` advanced past the overflowing attempts,
      and the last attempt's :class:`ScaledValueAndGrad`.

    Raises:
      TypeError: ``max_retries`` is not an integer.
      ValueError: ``max_retries`` is negative.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from jax_lossscale.flax import TrainState
      >>> state = TrainState.create(apply_fn=None, params=jnp.ones(2), tx=optax.sgd(0.1))
      >>> loss_fn = lambda w: jnp.sum(w.astype(jnp.float16))  # 65536 overflows its backward
      >>> state, out = state.retry_value_and_grad(loss_fn)(state.params)
      >>> state = state.apply_gradients(grads=out.grads, finite=out.finite)
      >>> state.params, int(state.step), float(state.dynamic_scale.scale)
      (Array([0.9, 0.9], dtype=float32), 1, 32768.0)
    """
    max_retries = check_max_retries(max_retries)
    grad_of = lambda ds: value_and_grad(
      fun, ds, argnums=argnums, has_aux=has_aux, axis_name=axis_name
    )

    def wrapped(*args: Any, **kwargs: Any) -> tuple[TrainState, ScaledValueAndGrad]:
      def attempt(ds: DynamicScaleState) -> tuple[ScaledValueAndGrad, jax.Array]:
        out = grad_of(ds)(*args, **kwargs)
        return out, out.finite

      ds, out, _ = retry_loop(attempt, self.dynamic_scale, max_retries)
      return self.replace(dynamic_scale=ds), out

    return wrapped

  def apply_gradients(
    self,
    *,
    grads: optax.Updates,
    finite: ArrayLike | None = None,
    replace_on_skip: str | Sequence[str] = (),
    **kwargs: Any,
  ) -> TrainState:
    """Applies unscaled gradients unless they are non-finite; updates the scale.

    A skipped step leaves the whole state as it was, except the scaler (which
    backs off and counts the skip): ``step``, ``params``, ``opt_state`` and
    every field passed in ``kwargs`` (``batch_stats``, any other collection
    the forward pass returned beside the gradients) are bit-identical to
    this state's. Each is selected with ``jnp.where`` (no ``lax.cond``, no
    host sync). Without that, one batch holding an inf would leave NaN
    running statistics for good.

    Args:
      grads: the *unscaled* gradients (``value_and_grad(...).grads``).
      finite: bool scalar from :func:`value_and_grad`; if ``None`` it is
        computed here with :func:`jax_lossscale.all_finite`.
      replace_on_skip: names of ``kwargs`` fields replaced even on a skipped
        step, e.g. ``("batch_stats",)`` to keep the statistics of a batch
        whose forward pass was finite but whose backward overflowed. A single
        name may be given as a string. Only for backward overflows: a field
        named here is taken whatever it holds, so a batch with an inf or NaN
        input writes its NaN statistics in for good.
      **kwargs: other fields to replace (e.g. ``batch_stats``). Their new
        values must have the old ones' structure, shapes and dtypes (a
        skipped step puts the old ones back). Static fields (``apply_fn``,
        ``pytree_node=False``) cannot depend on a traced decision: they are
        replaced.

    Returns:
      TrainState: the new state. On a finite step ``step + 1`` and updated
      ``params`` and ``opt_state``, and the ``kwargs`` fields replaced; on a
      skipped step all of those bit-identical (but the ``replace_on_skip``
      fields). In both cases ``dynamic_scale`` advanced by
      :func:`jax_lossscale.update_scale`.

    Raises:
      TypeError: ``grads`` is a boolean scalar (the ``finite`` flag, where
        Flax's order puts its gradients); ``replace_on_skip`` is not a name or a
        sequence of names.
      ValueError: ``finite`` is not a boolean scalar; ``replace_on_skip``
        names a field not passed in ``kwargs``; a field's new value differs
        from the old one in structure, shape or dtype.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from jax_lossscale.flax import TrainState
      >>> from flax import struct
      >>> class BNState(TrainState):
      ...   batch_stats: dict = struct.field(default_factory=dict)
      >>> state = BNState.create(apply_fn=None, params=jnp.ones(2), tx=optax.sgd(0.1),
      ...                        batch_stats={"mean": jnp.zeros(2)})
      >>> nan_stats = {"mean": jnp.array([jnp.nan, 0.5])}  # a batch with an inf pixel
      >>> skipped = state.apply_gradients(grads=jnp.array([jnp.nan, 1.0]),
      ...                                 batch_stats=nan_stats)
      >>> skipped.batch_stats["mean"], int(skipped.step)
      (Array([0., 0.], dtype=float32), 0)
      >>> kept = state.apply_gradients(grads=jnp.array([jnp.inf, 1.0]), batch_stats=nan_stats,
      ...                              replace_on_skip="batch_stats")
      >>> kept.batch_stats["mean"]
      Array([nan, 0.5], dtype=float32)
    """
    if is_finite_flag(grads):
      raise TypeError(
        "grads is a boolean scalar: it looks like the `finite` flag. " + UNPACKING_CHANGED
      )
    replaced_anyway = _field_names("replace_on_skip", replace_on_skip, kwargs)
    if finite is None:
      refuse_complex(grads)
      finite = all_finite(gradient_leaves(grads))
    finite = jnp.asarray(finite)
    if finite.dtype != jnp.bool_ or finite.shape != ():
      raise ValueError(
        f"finite must be a boolean scalar, got dtype={finite.dtype}, shape={finite.shape}."
      )
    grads_with_opt, meta = split_variables(grads)
    params_with_opt = split_variables(self.params)[0] if meta is not None else self.params
    updates, new_opt_state = self.tx.update(
      promote_floats(grads_with_opt), self.opt_state, promote_floats(params_with_opt)
    )
    new_params = join_variables(_apply_updates(params_with_opt, updates), meta)
    new_params, opt_state = skip_step(
      finite, new_params, self.params, new_opt_state, self.opt_state
    )
    static = {f.name for f in dataclasses.fields(self) if not f.metadata.get("pytree_node", True)}
    fields = {
      name: value
      if name in replaced_anyway or name in static or not hasattr(self, name)
      else select_tree(finite, value, getattr(self, name), name, _FIELD_HINT.format(name))
      for name, value in kwargs.items()
    }
    new_state = self.replace(
      step=jnp.where(finite, optax.safe_int32_increment(self.step), self.step),
      params=new_params,
      opt_state=opt_state,
      dynamic_scale=update_scale(self.dynamic_scale, finite),
      **fields,
    )
    # Remembered (not a field: no pytree leaf, gone after a jit boundary) so that
    # replace() can refuse writing this step's stale scale state back.
    object.__setattr__(new_state, "_scale_before_step", self.dynamic_scale)
    return new_state

  def __init_subclass__(cls, **kwargs: Any) -> None:
    super().__init_subclass__(**kwargs)  # flax.struct's: makes cls a dataclass, sets replace
    cls.replace = cls._checked_replace  # type: ignore[method-assign, assignment, unused-ignore]

  def _checked_replace(self, **updates: Any) -> TrainState:
    """A copy with the given fields replaced (Flax's ``replace``), checking ``dynamic_scale``.

    :meth:`apply_gradients` already skips the step and advances the scale, so
    Flax's skip block (``new_state.replace(params=jnp.where(is_fin, ...),
    ..., dynamic_scale=...)``) is to be deleted. Kept, on the state
    :meth:`apply_gradients` returned, it would undo the back-off: writing the
    scale state of before the step back is refused; merging it with
    ``jax.tree.map(functools.partial(jnp.where, is_fin), new, old)`` is made
    harmless (on a skipped step that selects the old state, whose values are
    replaced by the backed-off ones; one ``jnp.where`` per leaf).

    Raises:
      TypeError: ``dynamic_scale`` is not a :class:`DynamicScaleState`.
      ValueError: ``dynamic_scale`` is the scale state that the step which
        made this state started from.
    """
    if "dynamic_scale" in updates:
      updates["dynamic_scale"] = checked_scale_state(
        updates["dynamic_scale"], self.__dict__.get("_scale_before_step"), self.dynamic_scale
      )
    return dataclasses.replace(self, **updates)


# flax.struct sets a plain ``replace`` on each dataclass it makes (this one included).
TrainState.replace = TrainState._checked_replace  # type: ignore[method-assign, assignment, unused-ignore]

#: How to fix a field whose old value cannot be put back on a skipped step.
_FIELD_HINT = (
  " Give the field its initial value in TrainState.create (not None), or name it in "
  "replace_on_skip=({!r},) to replace it whether or not the step is skipped."
)


def _field_names(name: str, value: Any, kwargs: dict[str, Any]) -> frozenset[str]:
  """``value`` (a field name or a sequence of them) as a set, each one a key of ``kwargs``."""
  names = (value,) if isinstance(value, str) else value
  if not isinstance(names, (tuple, list, set, frozenset)) or not all(
    isinstance(n, str) for n in names
  ):
    raise TypeError(f"{name} must be a field name or a sequence of them, got {value!r}.")
  unknown = sorted(set(names) - set(kwargs))
  if unknown:
    raise ValueError(
      f"{name} names {unknown}, which are not passed to apply_gradients (passed: {sorted(kwargs)})."
    )
  return frozenset(names)


def _scale_state_to_dict(state: DynamicScaleState) -> dict[str, Any]:
  """Flax serialization: the array fields (the config is static, as Flax's own static fields)."""
  return {name: getattr(state, name) for name in DATA_FIELDS}


def _scale_state_from_dict(target: DynamicScaleState, state: dict[str, Any]) -> DynamicScaleState:
  """Flax serialization: the target's config, the saved arrays in the target's dtypes."""
  missing = [name for name in DATA_FIELDS if name not in state]
  if missing:
    raise ValueError(f"the saved DynamicScaleState misses the fields {missing}.")
  return target.replace(
    **{
      name: jnp.asarray(state[name], jnp.result_type(getattr(target, name))) for name in DATA_FIELDS
    }
  )


# Flax's msgpack checkpoints (flax.serialization.to_bytes / from_bytes, to_state_dict) of a
# TrainState holding the scale state.
serialization.register_serialization_state(
  DynamicScaleState, _scale_state_to_dict, _scale_state_from_dict, override=True
)
