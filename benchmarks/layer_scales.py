"""A loss scale per layer group: the boundary marker, the state, the rule, the Optax wrapper.

Measured and not shipped (``docs/guides/layer-scales.md`` gives the numbers and the verdict):
this module lives beside its benchmark (``bench_layer_scales.py``), outside the package, and
builds on the package's private pieces. ``tests/test_layer_scales.py`` tests it.

One loss scale is bounded by the largest gradient of the model, so the layers whose gradients
are small still flush to zero in float16. Here the layers are split into groups, numbered in
forward order (group 0 nearest the input, the last group nearest the loss). The loss is
multiplied by the last group's scale; :func:`layer_boundary`, an identity in the forward
pass, multiplies the cotangent that crosses it (from group ``g + 1`` back into group ``g``)
by ``scale[g] / scale[g + 1]``. Every scale is a power of two, so each of those multiplies,
and each unscaling, is exact (unless float16 overflows or flushes, which is the point).

The rule (see :func:`layer_loss_scale`) sets each group's scale from the largest magnitude of
that group's gradient in the previous clean step, rounded down to a power of two, less one
headroom shared by the groups that torch's rule adjusts (one bit less after
``growth_interval`` clean steps, one bit more on an overflow). The
overflow decision stays one decision for the step: any non-finite gradient skips it.
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_lossscale._scaler._find import find_one
from jax_lossscale._scaler._numerics import combine_flags
from jax_lossscale._scaler._numerics import compute_dtype
from jax_lossscale._scaler._numerics import is_float
from jax_lossscale._scaler._numerics import promote_floats
from jax_lossscale._scaler._numerics import refuse_complex
from jax_lossscale._scaler._skip import skip_step
from jax_lossscale._scaler._skip import skipped_updates
from jax_lossscale._scaler._state import DEFAULT_CONFIG
from jax_lossscale._scaler._state import check_growth_interval
from jax_lossscale._scaler._state import check_int
from jax_lossscale._scaler._state import check_positive_finite
from jax_lossscale._scaler._transform import _cast_updates
from jax_lossscale._typing import PyTree

# float16's largest finite value is in [2**15, 2**16): a gradient whose largest magnitude is
# in [2**(k-1), 2**k) is scaled by at most 2**(15 - k), so that it lands in [2**14, 2**15).
_TOP_EXPONENT = 15
_MIN_EXP, _MAX_EXP = -126, 126  # scale exponents whose reciprocal is a normal float32
_MAX_HEADROOM = 64


class LayerScaleState(NamedTuple):
  """Optimizer state of :func:`layer_loss_scale`: one scale per group, arrays only.

  Attributes:
    scales: float32[G], the scale of each group (powers of two); the last one scales the
      loss.
    headroom: int32[], the bits every group's scale keeps below the float16 ceiling of its
      largest gradient (one less after ``growth_interval`` clean steps, one more after an
      overflow).
    growth_tracker: int32[], clean steps since the headroom last changed.
    skipped_steps: int32[], total number of skipped (non-finite) steps.
    consecutive_skips: int32[], skipped steps in a row.
    inner_state: the wrapped transformation's state.
  """

  scales: jax.Array
  headroom: jax.Array
  growth_tracker: jax.Array
  skipped_steps: jax.Array
  consecutive_skips: jax.Array
  inner_state: optax.OptState


def _is_layer_state(x: Any) -> bool:
  return isinstance(x, LayerScaleState)


def get_layer_scale_state(tree: Any) -> LayerScaleState:
  """The :class:`LayerScaleState` in ``tree`` (itself, an optimizer state or a train state).

  Pure structure inspection: fine inside ``jit``.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import layer_scales as _groups
    >>> tx = optax.chain(optax.clip(1.0), _groups.layer_loss_scale(optax.sgd(1.0), [0, 1]))
    >>> _groups.get_layer_scale_state(tx.init([jnp.zeros(2), jnp.zeros(2)])).scales
    Array([65536., 65536.], dtype=float32)

  Raises:
    ValueError: if ``tree`` holds none, or more than one.
  """
  error = lambda found: ValueError(
    f"state must hold exactly one LayerScaleState (made by layer_loss_scale), found "
    f"{len(found)} in {type(tree).__name__}."
  )
  return find_one(tree, _is_layer_state, error)


def _scales_of(state: Any) -> jax.Array:
  """The float32[G] scales of a state, or of a float array of scales given directly."""
  if hasattr(state, "dtype") and hasattr(state, "shape"):
    scales = jnp.asarray(state)
    if not is_float(scales) or scales.ndim != 1:
      raise ValueError(
        f"scales must be a 1-d float array, got dtype {scales.dtype}, shape {scales.shape}."
      )
    return scales.astype(jnp.float32)
  return get_layer_scale_state(state).scales


def _exponent(scale: jax.Array) -> jax.Array:
  """``log2(scale)`` of a power-of-two float32 scale, exactly, as int32."""
  _, e = jnp.frexp(scale)  # scale = 0.5 * 2**e
  return (e - 1).astype(jnp.int32)


def _pow2(exponent: jax.Array) -> jax.Array:
  return jnp.ldexp(jnp.ones_like(exponent, jnp.float32), exponent)


@jax.custom_vjp
def _scale_cotangent(x: Any, factor: jax.Array) -> Any:
  return x


def _scale_cotangent_fwd(x, factor):
  return x, factor


def _scale_cotangent_bwd(factor, ct):
  def scale(c):
    if c is None or not is_float(c) or c.dtype == jax.dtypes.float0:
      return c
    dt = compute_dtype(c.dtype)  # a float32 multiply: a 2**20 factor does not fit float16
    return (c.astype(dt) * factor.astype(dt)).astype(c.dtype)

  return jax.tree_util.tree_map(scale, ct), jnp.zeros_like(factor)


_scale_cotangent.defvjp(_scale_cotangent_fwd, _scale_cotangent_bwd)


def layer_boundary(x: PyTree, state: Any, group: int) -> PyTree:
  """Marks ``x`` as leaving layer group ``group`` for group ``group + 1``.

  The identity in the forward pass. In the backward pass the cotangent of ``x`` (the
  gradient arriving from group ``group + 1``, scaled by that group's scale) is multiplied by
  ``scales[group] / scales[group + 1]``, so that every gradient computed upstream of the
  boundary, down to the next boundary, is scaled by ``scales[group]``. The ratio is a power
  of two and is applied in float32 (or wider), then cast back to the cotangent's dtype:
  exact unless that dtype overflows or flushes.

  The boundaries must cut the graph: every path from group ``group``'s parameters to the
  loss must cross one boundary out of each group it passes (a residual stream gets its
  boundary after the block's addition, not inside the branch).

  Args:
    x: an array or pytree of arrays leaving the group (integer leaves pass through).
    state: the optimizer state of :func:`layer_loss_scale` (or any tree holding its
      :class:`LayerScaleState`), or the float32[G] scales themselves.
    group: the group ``x`` leaves, in ``[0, G - 2]`` (a Python int).

  Returns:
    ``x``, unchanged.

  Raises:
    TypeError: ``group`` is not an int.
    ValueError: ``group`` is outside ``[0, G - 2]``, or ``state`` holds no layer scales.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import layer_scales as _groups
    >>> scales = jnp.array([2.0**20, 2.0**4])   # group 0's scale, group 1's
    >>> f = lambda x: jnp.sum(_groups.layer_boundary(x, scales, 0))
    >>> jax.grad(f)(jnp.ones(2, jnp.float16))   # times 2**16, exactly
    Array([inf, inf], dtype=float16)
    >>> jax.grad(f)(jnp.ones(2, jnp.float32))
    Array([65536., 65536.], dtype=float32)
  """
  scales = jax.lax.stop_gradient(_scales_of(state))
  groups = scales.shape[0]
  if isinstance(group, (bool, np.bool_)) or not isinstance(group, (int, np.integer)):
    raise TypeError(f"group must be an int, got {group!r}.")
  if not 0 <= int(group) <= groups - 2:
    raise ValueError(
      f"group must be in [0, {groups - 2}] (a boundary leaves one of the first "
      f"{groups - 1} of {groups} groups), got {group!r}."
    )
  g = int(group)
  e = _exponent(scales)
  return _scale_cotangent(x, _pow2(e[g] - e[g + 1]))


def scale_loss_by_layers(loss: jax.Array, state: Any) -> jax.Array:
  """The loss multiplied by the last group's scale, in at least float32.

  What :func:`jax_lossscale.scale_loss` is to :func:`jax_lossscale.dynamic_loss_scale`:
  the gradients of the result, with the :func:`layer_boundary` markers in the model, are
  those :func:`layer_loss_scale` expects.

  Args:
    loss: a float scalar (or array) loss.
    state: the optimizer state of :func:`layer_loss_scale` (or a tree holding its
      :class:`LayerScaleState`), or the float32[G] scales.

  Returns:
    ``loss * scales[-1]`` in ``promote_types(loss.dtype, float32)``.

  Examples:
    >>> import jax.numpy as jnp
    >>> import layer_scales as _groups
    >>> _groups.scale_loss_by_layers(jnp.float16(2.0), jnp.array([4.0, 65536.0]))
    Array(131072., dtype=float32)
  """
  scales = _scales_of(state)
  loss = jnp.asarray(loss)
  if not is_float(loss):
    raise ValueError(f"loss must be a floating-point array, got dtype {loss.dtype}.")
  dt = compute_dtype(loss.dtype)
  return loss.astype(dt) * scales[-1].astype(dt)


def _labels(groups: Any, grads: Any) -> list[int]:
  """One group label per leaf of ``grads`` (a ``None`` leaf of ``grads`` is a leaf too)."""
  tree = groups(grads) if callable(groups) else groups
  none = lambda x: x is None
  treedef = jax.tree_util.tree_structure(grads, is_leaf=none)
  try:
    labels = treedef.flatten_up_to(tree)  # type: ignore[attr-defined]  # missing from the stub
  except (ValueError, TypeError) as e:
    raise ValueError(
      "groups must have the structure of the params (one int label per leaf), or be a "
      f"function of the params returning such a tree: {e}"
    ) from None
  out: list[int] = []
  for label in labels:
    if isinstance(label, (bool, np.bool_)) or not isinstance(label, (int, np.integer)):
      raise TypeError(f"groups must hold int labels, got {label!r}.")
    out.append(int(label))
  return out


def _check_labels(labels: list[int], num_groups: int) -> None:
  bad = [x for x in labels if not 0 <= x < num_groups]
  if bad:
    raise ValueError(f"groups labels must be in [0, {num_groups - 1}], got {bad[0]!r}.")


def _check_pow2(name: str, value: Any) -> float:
  value = check_positive_finite(name, value)
  frac, exp = np.frexp(value)
  if frac != 0.5 or not _MIN_EXP <= exp - 1 <= _MAX_EXP:
    raise ValueError(f"{name} must be a power of two in [2**-126, 2**126], got {value!r}.")
  return value


def layer_loss_scale(
  inner: optax.GradientTransformation,
  groups: Any,
  *,
  num_groups: int | None = None,
  init_scale: float = DEFAULT_CONFIG.init_scale,
  min_scale: float = 1.0,
  max_scale: float = 2.0**48,
  init_headroom: int = 1,
  growth_interval: int = DEFAULT_CONFIG.growth_interval,
) -> optax.GradientTransformationExtraArgs:
  """Wraps ``inner`` with a dynamic loss scale per layer group.

  Experimental: the API and the rule may change. Not supported yet: there is no
  ``axis_name``, so inside ``shard_map``/``pmap`` each device would decide its own skip and
  measure its own scales (under plain ``jit``, sharded arrays included, the finiteness check
  and the largest magnitudes are reductions over the global arrays, so the decision is
  global). :func:`jax_lossscale.retry_on_overflow` and
  :class:`jax_lossscale.flax.TrainState` look for one :class:`jax_lossscale.DynamicScaleState` and do not
  work with it (the train state would add its own scale on top). Wrapping it in
  :func:`jax_lossscale.multi_steps` works: the scales only change on the accumulated step.
  It is measured against one scale in ``benchmarks/results/layer-scales.md``.

  Groups are numbered in forward order; the loss is multiplied by the last group's scale
  and :func:`layer_boundary` rescales the cotangent as the backward pass crosses from one
  group into the previous one. ``update`` unscales each gradient by its own group's scale,
  checks all of them for inf/NaN (one decision for the step: any non-finite gradient skips
  the whole step with ``jnp.where``, leaving params and ``inner``'s state bit-identical),
  runs ``inner`` and adjusts the scales. No host sync, no ``lax.cond``.

  The rule: each group's scale is set from the largest magnitude ``amax[g]`` of its
  (unscaled) gradients in the last clean step, rounded down to a power of two, less a
  headroom of ``h`` bits shared by all groups and adjusted by torch's rule. With ``amax[g]``
  in ``[2**(k-1), 2**k)``::

    if the step is clean:
      tracker += 1
      if tracker >= growth_interval: h = max(h - 1, 0); tracker = 0
      scale[g] = 2**(15 - k - h)   # the largest gradient lands in [2**(14-h), 2**(15-h))
    else:                          # the step is skipped
      scale[g] /= 2 for every g; h += 1; tracker = 0

  (scales clipped to ``[min_scale, max_scale]``). A group whose gradients are all zero,
  flushed by float16 or unused, has nothing to measure: its scale doubles at each clean step
  until it sees a non-zero gradient. So no group waits for overflows to find its scale; the
  overflows probe the one headroom, as torch's rule probes one scale (not fewer skips than one
  scale at the same ``growth_interval``: see the measurements). The headroom is
  shared because an overflow cannot be blamed on one group: an inf in group ``g`` poisons
  every cotangent upstream of it.

  Args:
    inner: the transformation to apply to the unscaled gradients.
    groups: the group of each parameter: a pytree of ints with the structure of the params
      (or a function of the params returning one).
    num_groups: the number of groups ``G`` (default: the largest label plus one).
    init_scale: every group's scale at the first step (a power of two).
    min_scale, max_scale: bounds of every scale (powers of two).
    init_headroom: the initial headroom, in bits (>= 0).
    growth_interval: clean steps before the headroom shrinks by one bit (>= 1).

  Returns:
    An :class:`optax.GradientTransformationExtraArgs` whose state is a
    :class:`LayerScaleState`.

  Raises:
    TypeError: naming the argument, for an argument of the wrong type.
    ValueError: naming the argument, for an invalid value (a scale that is not a power of
      two, a label outside ``[0, num_groups)``).

  Examples:
    Two groups: ``w0`` (its gradient ~1e-9) and ``w1``. Each gradient comes out scaled by
    its own group's scale and is unscaled by it; the next scales come from the gradients.

    >>> import jax, jax.numpy as jnp, optax
    >>> import layer_scales as _groups
    >>> params = {"w0": jnp.ones(2), "w1": jnp.ones(2)}
    >>> tx = _groups.layer_loss_scale(optax.sgd(1.0), {"w0": 0, "w1": 1})
    >>> opt_state = tx.init(params)
    >>> def loss_fn(p):
    ...   h = _groups.layer_boundary(1e-9 * jnp.sum(p["w0"]), opt_state, 0)  # leaves group 0
    ...   return h * jnp.sum(p["w1"])
    >>> grads = jax.grad(lambda p: _groups.scale_loss_by_layers(loss_fn(p), opt_state))(params)
    >>> updates, opt_state = tx.update(grads, opt_state, params)
    >>> updates["w1"]                     # -(2e-9): unscaled by group 1's scale
    Array([-2.e-09, -2.e-09], dtype=float32)
    >>> [f"2^{int(e)}" for e in jnp.log2(opt_state.scales)]
    ['2^42', '2^42']
  """
  if not isinstance(inner, optax.GradientTransformation):
    raise TypeError(f"inner must be an optax.GradientTransformation, got {type(inner).__name__}.")
  init_scale = _check_pow2("init_scale", init_scale)
  min_scale = _check_pow2("min_scale", min_scale)
  max_scale = _check_pow2("max_scale", max_scale)
  if not min_scale <= init_scale <= max_scale:
    raise ValueError(
      f"init_scale ({init_scale!r}) must lie in [min_scale, max_scale] = "
      f"[{min_scale!r}, {max_scale!r}]."
    )
  init_headroom = check_int("init_headroom", init_headroom, 0)
  growth_interval = check_growth_interval(growth_interval)
  if num_groups is not None:
    num_groups = check_int("num_groups", num_groups, 1)
  if not callable(groups):  # the labels themselves are checked now
    labels = _labels(groups, groups)
    _check_labels(labels, num_groups if num_groups is not None else max(labels, default=0) + 1)
  inner = optax.with_extra_args_support(inner)
  min_e, max_e = int(np.frexp(min_scale)[1]) - 1, int(np.frexp(max_scale)[1]) - 1

  def count(labels):
    used = [x for x in labels if x is not None]
    return num_groups if num_groups is not None else (max(used) + 1 if used else 1)

  def init_fn(params):
    g = count(_labels(groups, params))
    return LayerScaleState(
      scales=jnp.full([g], np.float32(init_scale), jnp.float32),
      headroom=jnp.asarray(init_headroom, jnp.int32),
      growth_tracker=jnp.zeros([], jnp.int32),
      skipped_steps=jnp.zeros([], jnp.int32),
      consecutive_skips=jnp.zeros([], jnp.int32),
      inner_state=inner.init(promote_floats(params)),
    )

  def update_fn(updates, state, params=None, **extra_args):
    if not _is_layer_state(state):
      raise TypeError(
        f"state must be the LayerScaleState made by this transformation's init, got "
        f"{type(state).__name__}."
      )
    refuse_complex(updates)
    none = lambda x: x is None
    leaves, treedef = jax.tree_util.tree_flatten(updates, is_leaf=none)
    labels = _labels(groups, params if params is not None and callable(groups) else updates)
    g_count = state.scales.shape[0]
    _check_labels(labels, g_count)
    inv = _pow2(-_exponent(state.scales))
    unscaled: list[Any] = []
    flags: list[list[jax.Array]] = [[] for _ in range(g_count)]
    amaxes: list[list[jax.Array]] = [[] for _ in range(g_count)]
    for x, label in zip(leaves, labels):
      if x is None or not is_float(x):
        unscaled.append(x)
        continue
      dt = compute_dtype(jnp.result_type(x))
      u = jnp.asarray(x).astype(dt) * inv[label].astype(dt)
      unscaled.append(u)
      flags[label].append(jnp.all(jnp.isfinite(u)))
      if u.size:
        amaxes[label].append(jnp.max(jnp.abs(u)).astype(jnp.float32))
    flat_flags = [f for group in flags for f in group]
    finite = combine_flags(flat_flags) if flat_flags else jnp.asarray(True)
    zero = jnp.zeros([], jnp.float32)
    amax = jnp.stack([jnp.max(jnp.stack(a)) if a else zero for a in amaxes])
    grads = jax.tree_util.tree_unflatten(treedef, unscaled)

    new_updates, new_inner = inner.update(
      grads, state.inner_state, promote_floats(params), **extra_args
    )
    new_updates = _cast_updates(new_updates, updates, params)
    new_updates, new_inner = skip_step(
      finite, new_updates, skipped_updates(new_updates), new_inner, state.inner_state
    )
    return new_updates, _next_state(state, new_inner, finite, amax)

  def _next_state(state, new_inner, finite, amax):
    one = jnp.ones([], jnp.int32)
    e = _exponent(state.scales)
    # Clean step: each group's scale from its largest gradient, less the headroom.
    tracker = state.growth_tracker + one
    grow = tracker >= growth_interval
    headroom = jnp.where(grow, jnp.maximum(state.headroom - one, 0), state.headroom)
    _, k = jnp.frexp(amax)  # amax in [2**(k-1), 2**k)
    measured = (_TOP_EXPONENT - k - headroom).astype(jnp.int32)
    # A group whose gradients are all zero (flushed, or unused) doubles until it sees one.
    clean_e = jnp.where(amax > 0, measured, e + one)
    # Overflow: every scale halves and the headroom grows by one bit (torch's backoff).
    new_e = jnp.clip(jnp.where(finite, clean_e, e - one), min_e, max_e)
    over_headroom = jnp.minimum(state.headroom + one, _MAX_HEADROOM)
    skipped = optax.safe_int32_increment(state.skipped_steps)
    consecutive = optax.safe_int32_increment(state.consecutive_skips)
    return LayerScaleState(
      scales=_pow2(new_e),
      headroom=jnp.where(finite, headroom, over_headroom),
      growth_tracker=jnp.where(finite & ~grow, tracker, jnp.zeros_like(tracker)),
      skipped_steps=jnp.where(finite, state.skipped_steps, skipped),
      consecutive_skips=jnp.where(finite, jnp.zeros_like(consecutive), consecutive),
      inner_state=new_inner,
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
