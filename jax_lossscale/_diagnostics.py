"""Diagnostics: per-layer gradient statistics and a one-off float16 underflow check."""

from __future__ import annotations

from collections.abc import Mapping
import math
from typing import Any
from typing import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_lossscale._autocast import autocast_spec
from jax_lossscale._autocast._api import interpret
from jax_lossscale._autocast._interpreter import Taps
from jax_lossscale._numerics import compute_dtype
from jax_lossscale._numerics import is_float
from jax_lossscale._numerics import unscale_and_check
from jax_lossscale._state import scale_of
from jax_lossscale._typing import ArrayLike
from jax_lossscale._typing import DTypeLike
from jax_lossscale._typing import PyTree
from jax_lossscale._typing import ScaleLike

FLOAT16_MAX = np.float32(65504.0)
# Smallest normal float16 (2**-14 ~ 6.1e-5): magnitudes below it are float16
# subnormals (precision lost, 2**-24 ~ 6e-8 and below flush to 0).
FLOAT16_TINY = np.float32(2.0**-14)

_STATS = ("max_abs", "nonfinite", "headroom", "zero", "subnormal")


def _key_name(key: Any) -> str:
  for attr in ("key", "idx", "name"):  # DictKey / FlattenedIndexKey, SequenceKey, GetAttrKey
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def _named_float_leaves(tree: Any) -> list[tuple[str, Any]]:
  """``(name, leaf)`` for each floating-point leaf, in flattening order."""
  out, seen = [], set()
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if leaf is None or not is_float(leaf):
      continue
    name = "/".join(_key_name(k) for k in path) or "leaf"
    if name in seen:
      raise ValueError(f"grads has two leaves named {name!r}; give them distinct keys.")
    seen.add(name)
    out.append((name, leaf))
  return out


def grad_leaf_names(grads: PyTree) -> list[str]:
  """Names of the floating-point leaves of ``grads``, as :func:`grad_diagnostics` keys them.

  A host-side helper: ``grad_leaf_names(grads)[int(d["min_headroom_leaf"])]``
  is the leaf with the least headroom (strings cannot leave ``jit``, so the
  diagnostics return its index). Path entries are joined with ``/``: dict keys,
  sequence indices and attribute names (``"layers_0/attn/kernel"``,
  ``"layers/0/weight"``); a bare array is named ``"leaf"``.

  Args:
    grads: a pytree (of arrays, ``jax.ShapeDtypeStruct`` s or tracers).

  Returns:
    A list of names, one per floating-point leaf, in flattening order.

  Examples:
    >>> import jax.numpy as jnp
    >>> from jax_lossscale.diagnostics import grad_leaf_names
    >>> grad_leaf_names({"dense": {"kernel": jnp.ones(2), "bias": jnp.ones(2)}, "step": 1})
    ['dense/bias', 'dense/kernel']
  """
  return [name for name, _ in _named_float_leaves(grads)]


_INT: dict[int, type[np.signedinteger[Any]]] = {4: np.int32, 8: np.int64}


def _leaf_counts(g: jax.Array) -> tuple[jax.Array, ...]:
  """One pass over a leaf: ``(largest finite |g|, non-finite, zero, small non-zero)``.

  The leaf is read as the integer bits of its magnitudes (in float32, or
  float64 for float64 leaves): for non-negative floats the bit patterns are
  ordered like the values, so every statistic is an integer compare, and the
  four are one variadic ``lax.reduce`` (a single loop over the leaf; separate
  ``jnp.max``/``jnp.sum`` calls each write a leaf-sized intermediate on
  XLA:CPU). The largest magnitude comes back as a float32 scalar.
  """
  dt = compute_dtype(g.dtype)
  it = _INT[dt.itemsize]
  magnitude = jax.lax.bitcast_convert_type(g.astype(dt), it) & np.array(np.iinfo(it).max, it)
  inf_bits = np.array(np.inf, dt).view(it)
  tiny_bits = np.array(FLOAT16_TINY, dt).view(it)
  zero = np.zeros([], it)
  finite = magnitude < inf_bits
  operands = (
    jnp.where(finite, magnitude, zero),
    jnp.logical_not(finite).astype(jnp.int32),
    (magnitude == zero).astype(jnp.int32),
    ((magnitude > zero) & (magnitude < tiny_bits)).astype(jnp.int32),
  )

  def combine(x, y):
    return jnp.maximum(x[0], y[0]), x[1] + y[1], x[2] + y[2], x[3] + y[3]

  count0 = np.zeros([], np.int32)
  largest, nonfinite, zeros, small = jax.lax.reduce(
    operands, (zero, count0, count0, count0), combine, tuple(range(g.ndim))
  )
  largest = jax.lax.bitcast_convert_type(largest, dt).astype(jnp.float32)
  return largest, nonfinite, zeros, small


@jax.tree_util.register_pytree_node_class
class GradDiagnostics(Mapping):
  """What :func:`grad_diagnostics` returns: a mapping of flat keys, stored as vectors.

  ``d["<leaf>/<stat>"]`` is a scalar (``<stat>`` one of ``max_abs``,
  ``nonfinite``, ``headroom``, ``zero``, ``subnormal``), and
  ``d["min_headroom"]``, ``d["min_headroom_leaf"]``, ``d["nonfinite"]`` the
  totals; iteration gives the keys leaf by leaf. As a pytree its leaves are
  the per-statistic vectors (in :func:`grad_leaf_names` order) and the three
  totals, so it can be returned from ``jit``, carried through ``lax.scan``
  (stacked values are indexed on their last axis) and ``jax.device_get``.
  """

  def __init__(self, names: tuple[str, ...], stats: dict[str, Any], totals: dict[str, Any]):
    self._names = tuple(names)
    self._index = {n: i for i, n in enumerate(self._names)}
    self.stats = stats  # stat -> array [..., n_leaves]
    self.totals = totals  # key -> array [...]

  def tree_flatten(self):
    keys_s, keys_t = tuple(self.stats), tuple(self.totals)
    children = tuple(self.stats[k] for k in keys_s) + tuple(self.totals[k] for k in keys_t)
    return children, (self._names, keys_s, keys_t)

  @classmethod
  def tree_unflatten(cls, aux, children):
    names, keys_s, keys_t = aux
    stats = dict(zip(keys_s, children[: len(keys_s)]))
    return cls(names, stats, dict(zip(keys_t, children[len(keys_s) :])))

  @property
  def names(self) -> tuple[str, ...]:
    """The leaf names, as :func:`grad_leaf_names` gives them."""
    return self._names

  def __getitem__(self, key: str) -> Any:
    if key in self.totals:
      return self.totals[key]
    name, _, stat = key.rpartition("/")
    if stat not in self.stats or name not in self._index:
      raise KeyError(key)
    return self.stats[stat][..., self._index[name]]

  def __iter__(self):
    for name in self._names:
      for stat in self.stats:
        yield f"{name}/{stat}"
    yield from self.totals

  def __len__(self) -> int:
    return len(self._names) * len(self.stats) + len(self.totals)

  def __repr__(self) -> str:
    return f"GradDiagnostics({len(self._names)} leaves, {len(self)} keys)"

  def flat(self) -> dict[str, Any]:
    """The flat dict of host values (NumPy scalars or arrays), one transfer per statistic."""
    host = jax.device_get((self.stats, self.totals))
    out = GradDiagnostics(self._names, *host)
    return {k: out[k] for k in out}


def grad_diagnostics(scaled_grads: optax.Updates, scale: ScaleLike) -> GradDiagnostics:
  """Per-leaf statistics of the scaled gradients: where float16 overflows or underflows.

  Call it inside the train step on the gradients of the scaled loss (before
  the optimizer) and return the dict with the step's metrics: every value is
  a JAX scalar, there is no host sync and no Python control flow on values.
  Each leaf is read once (one loop computes all its statistics), and the
  per-leaf arithmetic that follows is done on one vector for all leaves, so
  the cost is about one read of the gradients whatever the leaf count.

  For each floating-point leaf named ``name`` (see :func:`grad_leaf_names`):

  * ``name/max_abs`` (float32): the true (unscaled) largest magnitude of
    the leaf's finite elements, ``max|g| / scale``; 0 for an all-zero leaf.
  * ``name/nonfinite`` (int32): how many elements are inf or NaN.
  * ``name/headroom`` (float32): ``log2(65504 / max|g|)`` over the *scaled*
    finite elements: how many doublings of the scale are left before this
    leaf overflows float16 (0 at exactly 65504, negative when it already
    exceeds it, ``+inf`` for an all-zero leaf). On an overflow step, when
    the leaf holds an inf or NaN, it is ``-inf`` (and ``min_headroom`` too):
    the scaler will skip the step and back off.
  * ``name/zero`` (float32): the share of all elements that are exactly zero
    (``-0.0`` too). Such zeros are mostly structural (ReLU, padding, the
    embedding rows of tokens absent from the batch) and are zero in a
    float32 backward as well: they are not underflow. Use
    :func:`check_underflow` to tell lost gradient from structural zeros.
  * ``name/subnormal`` (float32): of the elements that are *not* exactly
    zero, the share whose scaled magnitude is below float16's smallest
    normal ``2**-14``: float16 subnormals, which keep fewer significant
    bits, and (for float32 gradients) values that a float16 cast would
    flush to zero. 0 for a leaf with no non-zero elements. A layer whose
    ``subnormal`` share stays high at the scale the scaler settles on is one
    whose gradients float16 holds badly.

  And over all leaves:

  * ``min_headroom`` (float32): the least headroom of any leaf (``+inf``
    with no float leaves, ``-inf`` on an overflow step).
  * ``min_headroom_leaf`` (int32): the index into :func:`grad_leaf_names`
    of that leaf, the first one on ties; -1 with no float leaves. It is the
    leaf that limits the loss scale.
  * ``nonfinite`` (int32): the total inf/NaN count over all leaves (0 on a
    step the scaler applies).

  Statistics are computed in float32 (float64 leaves in float64) and
  returned in float32. Counts are int32 (leaves of up to 2**31 elements).

  Args:
    scaled_grads: pytree of gradients of the scaled loss. Integer, boolean
      and ``None`` leaves are ignored.
    scale: the loss scale the gradients carry. Any of: a Python number or a
      scalar array; a :class:`DynamicScaleState`; or the optimizer state of
      :func:`dynamic_loss_scale` (or a train state) holding one, as
      :func:`get_scale_state` finds it. ``grad_diagnostics(grads,
      opt_state)`` and ``grad_diagnostics(grads,
      get_scale_state(opt_state).scale)`` give the same result.

  Returns:
    A :class:`GradDiagnostics`: a read-only mapping from the keys above to
    scalar arrays (``d["dense/kernel/headroom"]``, ``dict(d)``, ``d.items()``
    give the flat dict of scalars for TensorBoard/W&B/CLU writers). It is a
    pytree of one vector per statistic, so returning it from ``jit`` costs
    eight outputs however many leaves there are (a flat dict of 1000
    scalars costs 1000); :meth:`GradDiagnostics.flat` gives host floats.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from jax_lossscale.diagnostics import grad_diagnostics, grad_leaf_names
    >>> g = {"a": jnp.array([4.0, 0.0, 2e-5, 1.0], jnp.float16), "b": jnp.array([16376.0, 1e-7])}
    >>> d = jax.jit(grad_diagnostics)(g, 4.0)
    >>> d["a/max_abs"].item(), d["a/zero"].item(), round(d["a/subnormal"].item(), 4)
    (1.0, 0.25, 0.3333)
    >>> d["b/headroom"].item(), grad_leaf_names(g)[d["min_headroom_leaf"].item()]
    (2.0, 'b')
  """
  scale = scale_of(scale)
  named = _named_float_leaves(scaled_grads)
  names = tuple(name for name, _ in named)
  leaves = [jnp.asarray(g) for _, g in named]
  if not leaves:
    empty_f = jnp.zeros([0], jnp.float32)
    stats = {k: empty_f for k in _STATS}
    stats["nonfinite"] = jnp.zeros([0], jnp.int32)
    totals = {
      "min_headroom": jnp.asarray(np.float32(np.inf)),
      "min_headroom_leaf": jnp.asarray(-1, jnp.int32),
      "nonfinite": jnp.zeros([], jnp.int32),
    }
    return GradDiagnostics(names, stats, totals)
  largest, nonfinite, zeros, small = (jnp.stack(s) for s in zip(*map(_leaf_counts, leaves)))
  size = np.array([max(int(np.prod(g.shape)), 1) for g in leaves], np.float32)
  headroom = jnp.where(nonfinite > 0, np.float32(-np.inf), jnp.log2(FLOAT16_MAX / largest))
  nonzero = size - zeros.astype(jnp.float32)
  stats = {
    "max_abs": largest / scale,
    "nonfinite": nonfinite,
    "headroom": headroom,
    "zero": zeros.astype(jnp.float32) / size,
    "subnormal": small.astype(jnp.float32) / jnp.maximum(nonzero, np.float32(1)),
  }
  totals = {
    "min_headroom": jnp.min(headroom),
    "min_headroom_leaf": jnp.argmin(headroom).astype(jnp.int32),
    "nonfinite": jnp.sum(nonfinite),
  }
  return GradDiagnostics(names, stats, totals)


# Top-level keys whose leaves are activation taps, not parameters: the
# ``activations=`` argument of check_underflow, and Flax linen's collection
# of ``self.perturb`` taps.
ACTIVATION_PREFIXES = ("activations/", "perturbations/")


def _is_activation(name: str) -> bool:
  return name.startswith(ACTIVATION_PREFIXES)


class UnderflowReport(NamedTuple):
  """What :func:`check_underflow` measured; a pytree of arrays (jit-safe).

  All dicts are keyed by leaf name: :func:`grad_leaf_names` of the params,
  and of the activation taps under ``"activations/"`` (or Flax linen's
  ``"perturbations/"`` collection, when the params hold it). Those are the
  *activation* gradients; the rest are *parameter* gradients.

  Attributes:
    nonzero: int32 per leaf, elements of the float32 gradient that are not 0.
    lost_unscaled: int32 per leaf, of those, how many the half-precision
      backward without loss scaling (scale 1) returns as exactly 0.
    lost_scaled: int32 per leaf, the same for the half-precision backward at
      ``scale`` (gradients unscaled in float32 afterwards).
    finite_unscaled: bool, whether the unscaled half-precision gradients are
      finite.
    finite_scaled: bool, whether the scaled half-precision gradients are
      finite.
    scale: float32, the loss scale of the scaled backward.
  """

  nonzero: dict[str, jax.Array]
  lost_unscaled: dict[str, jax.Array]
  lost_scaled: dict[str, jax.Array]
  finite_unscaled: jax.Array
  finite_scaled: jax.Array
  scale: jax.Array

  def fractions(self, scaled: bool = False) -> dict[str, float]:
    """Per leaf, the share of float32-non-zero elements flushed to 0 (host floats)."""
    lost = self.lost_scaled if scaled else self.lost_unscaled
    return {k: int(lost[k]) / max(int(self.nonzero[k]), 1) for k in self.nonzero}

  def total(self, scaled: bool = False, prefix: str = "", keys: Any = None) -> float:
    """The share of lost elements pooled over leaves (not an average of per-leaf shares).

    Over all leaves, those whose name starts with ``prefix``, or the names in
    ``keys``: lost elements summed over those leaves, divided by their
    non-zero elements summed, so a kernel weighs as many elements as it has.
    """
    lost = self.lost_scaled if scaled else self.lost_unscaled
    names = [k for k in self.nonzero if k.startswith(prefix)] if keys is None else list(keys)
    nz = sum(int(self.nonzero[k]) for k in names)
    return sum(int(lost[k]) for k in names) / nz if nz else 0.0

  def looked_at(self) -> dict[str, list[str]]:
    """The leaves checked, as ``{"params": [...], "activations": [...]}``."""
    acts = [k for k in self.nonzero if _is_activation(k)]
    return {"params": [k for k in self.nonzero if not _is_activation(k)], "activations": acts}

  def _needs(self, names: list[str], threshold: float) -> bool:
    unscaled = self.total(keys=names)
    return bool(names) and unscaled >= threshold and self.total(True, keys=names) < unscaled

  def needs_loss_scaling(self, threshold: float = 0.01) -> bool:
    """Whether half precision without scaling loses at least ``threshold`` of the gradient.

    Judged separately for the parameter gradients and for the activation
    gradients (when taps were given): either losing ``threshold`` or more
    (``>=``), with scaling losing less, is a yes.
    """
    groups = self.looked_at()
    return any(self._needs(names, threshold) for names in groups.values())

  def verdict(self, threshold: float = 0.01) -> str:
    """One line: does this model need loss scaling at these params? Says what it looked at."""
    if not bool(self.finite_unscaled):
      return (
        "float16 overflows even without scaling (inf/NaN at scale 1): keep the "
        "overflowing ops in float32; loss scaling cannot help with that."
      )
    fr = self.fractions()
    scale = float(self.scale)
    exp = math.log2(scale) if scale > 0 else float("nan")
    scale_txt = f"2^{exp:.0f}" if math.isfinite(exp) and exp == round(exp) else f"{scale:g}"
    parts = []
    for group, names in self.looked_at().items():
      if not names:
        continue
      worst = max(names, key=fr.get)
      kind = "parameter" if group == "params" else "activation"
      with_scale = (
        f"{self.total(scaled=True, keys=names):.2%} at scale {scale_txt}"
        if bool(self.finite_scaled)
        else f"scale {scale_txt} overflows (the dynamic scaler backs off from it)"
      )
      parts.append(
        f"{self.total(keys=names):.2%} of the non-zero {kind}-gradient elements "
        f"({len(names)} leaves; worst {worst}: {fr[worst]:.2%}); {with_scale}"
      )
    if not parts:
      parts.append("no gradient elements (no float leaves)")
    head = "float16 without loss scaling flushes " + "; and ".join(parts)
    if not self.looked_at()["activations"]:
      head += " (parameter gradients only: pass activations= taps to check activations)"
    if self.needs_loss_scaling(threshold):
      return f"NEEDS loss scaling: {head}."
    return f"does not need loss scaling here (threshold {threshold:.2%}): {head}."

  def table(self) -> str:
    """Per-leaf lines: name, non-zero elements, share lost unscaled / scaled."""
    fu, fs = self.fractions(), self.fractions(scaled=True)
    width = max([len(k) for k in fu] + [4])
    lines = [f"{'leaf':<{width}}  {'nonzero':>10}  {'lost, scale 1':>13}  {'lost, scaled':>12}"]
    for k in fu:
      lines.append(f"{k:<{width}}  {int(self.nonzero[k]):>10}  {fu[k]:>13.3%}  {fs[k]:>12.3%}")
    return "\n".join(lines)


def _autocast_call(spec: Any, batch: Any, tapped: bool) -> Callable[..., Any]:
  """``call(variables, dtype)`` of an autocast ``loss_fn``: its policy, its taps honoured.

  Every output of a lower-precision primitive (outside loops and custom rules) gets a
  zero tap, under ``variables["lowp"]``; the user's taps (``variables["activations"]``)
  and Flax ``"perturbations"`` in the params take the dtype of the activation they are
  added to, as constants do, so their gradients are the activations' own.
  """

  def follows(path: tuple[Any, ...]) -> bool:
    keys = [getattr(k, "idx", getattr(k, "key", None)) for k in path]
    if keys[:2] == [0, 2]:  # loss_fn(params, batch, taps): the taps
      return True
    return keys[:3] == [0, 0, "perturbations"]

  def call(v: Any, dtype: Any) -> Any:
    taps = Taps(list(v["lowp"].values()))
    args = (v["params"], batch, v["activations"]) if tapped else (v["params"], batch)
    reference = np.dtype(dtype) == np.float32  # the function as written
    return interpret(spec, dtype, args, taps=taps, follows=follows, as_written=reference)

  return call


def _lowp_taps(spec: Any, params: Any, batch: Any, taps: Any, dtype: Any) -> dict[str, Any]:
  """Zeros for the outputs of the lower-precision primitives of an autocast ``loss_fn``."""
  counted = Taps()
  args = (params, batch) if taps is None else (params, batch, taps)
  jax.eval_shape(lambda *a: interpret(spec, dtype, a, taps=counted), *args)
  return {
    name: jnp.zeros(s.shape, s.dtype) for name, s in zip(counted.names, counted.shapes, strict=True)
  }


def check_underflow(
  loss_fn: Callable[..., ArrayLike],
  params: optax.Params,
  batch: PyTree,
  *,
  scale: ScaleLike = 2.0**16,
  half_dtype: DTypeLike | None = None,
  activations: PyTree | None = None,
) -> UnderflowReport:
  """A one-off check of one batch: does float16 flush this model's gradients to zero?

  Runs three backward passes at the same ``params`` and ``batch``:
  ``loss_fn(params, batch, half_dtype)`` without scaling and with the loss
  multiplied by ``scale`` (then unscaled in float32, exactly as
  :func:`dynamic_loss_scale` does), and ``loss_fn(params32, batch,
  jnp.float32)``, the reference, with every floating-point param cast to
  float32. Per leaf it counts the reference's non-zero gradient elements and,
  of those, how many each half-precision backward returns as exactly 0: the
  gradient that half precision loses. Zeros the model produces itself (ReLU,
  masking, embedding rows of absent tokens) are zero in the reference too
  and are not counted.

  Activation gradients (logits, attention scores, hidden states) often
  underflow while every parameter gradient survives: parameter gradients sum
  over the batch, per-element activation gradients do not. To check them, in
  any framework (plain JAX, Equinox, Flax), pass ``activations``: a pytree
  of float32 zeros (or ``jax.ShapeDtypeStruct`` s), one per activation to
  tap. ``loss_fn`` is then called as ``loss_fn(params, batch, dtype, taps)``
  and adds each tap to its activation, ``h = h + taps["logits"].astype(h.dtype)``
  (a zero, so the loss does not change); the gradient of a tap is the
  gradient of that activation. Taps are reported under ``"activations/<name>"``.
  Flax linen's ``self.perturb(name, x)`` taps work too: pass the
  ``"perturbations"`` collection inside ``params`` (``{"params": ...,
  "perturbations": ...}``); its leaves count as activations. The verdict
  judges parameter and activation gradients separately and says what it
  looked at.

  **An autocast function needs no dtype parameter.** Pass ``jls.autocast(f)``
  itself (not a ``jax.jit`` of it) as ``loss_fn``, with ``f(params, batch)``
  (with ``activations``: ``f(params, batch, taps)``) written for float32: the
  half backwards run ``f`` under the autocast function's policy in ``half_dtype``
  (its own dtype when ``half_dtype`` is not given), and the reference runs it in
  float32. The activations are seen without taps: every output of a
  lower-precision primitive (each matmul and convolution, so the logits and the
  attention scores; outside loops, conds and custom rules) is reported under
  ``"activations/<scope>/<primitive>#<n>"``. Taps written into ``f``
  (``h + taps["logits"]``, float32 as the model is) and Flax ``"perturbations"``
  take the dtype of the activation they are added to, so they measure its
  float16 gradient.

  It is a pure function of arrays (fine under ``jax.jit``; build the jitted
  function once and reuse it to check several batches or points in
  training). The result's host methods give the per-leaf shares
  (``fractions``, ``table``) and a one-line ``verdict()``.

  Args:
    loss_fn: ``loss_fn(params, batch, dtype) -> scalar loss`` (with
      ``activations``: ``loss_fn(params, batch, dtype, taps)``), running the
      model's half-precision compute (matmuls, activations) in ``dtype``; or
      an :func:`jax_lossscale.autocast` function of ``(params, batch)``.
    params: the parameters (float32 master params, or half params).
    batch: anything ``loss_fn`` takes as its batch.
    scale: the loss scale of the scaled backward (default torch's 2**16;
      pass the scaler's current scale, or the optimizer state, to check a
      point in training).
    half_dtype: ``jnp.float16`` or ``jnp.bfloat16``: the dtype of both
      half-precision backwards (unscaled and scaled). Default: an autocast
      ``loss_fn``'s own dtype (float16 if that is float32), else float16.
    activations: optional pytree of activation taps (zeros of each
      activation's shape; the values are ignored, float32 zeros are used).

  Returns:
    An :class:`UnderflowReport`.

  Raises:
    ValueError: if ``params`` already has a top-level ``"activations"`` key
      and ``activations`` is given too.

  Examples:
    >>> import jax.numpy as jnp
    >>> from jax_lossscale.diagnostics import check_underflow
    >>> def loss_fn(p, batch, dtype):  # a tiny loss: gradients ~1e-9
    ...   return 1e-9 * jnp.sum(batch.astype(dtype) * p["w"].astype(dtype)).astype(jnp.float32)
    >>> report = check_underflow(loss_fn, {"w": jnp.ones(3)}, jnp.array([1.0, 2.0, 3.0]))
    >>> report.fractions(), report.fractions(scaled=True)
    ({'w': 1.0}, {'w': 0.0})
    >>> report.verdict()[:20]
    'NEEDS loss scaling: '

    Activation taps in plain JAX: half of the logits' gradient flushes, the weight's does not
    (each weight-gradient element sums over the batch, and half of its terms survive).

    >>> def tapped(p, batch, dtype, taps):
    ...   x, c = batch
    ...   logits = x.astype(dtype) @ p["w"].astype(dtype) + taps["logits"].astype(dtype)
    ...   return jnp.sum(logits.astype(jnp.float32) * c)
    >>> x, c = jnp.ones((8, 2)), jnp.tile(jnp.array([[1e-9], [1e-3]]), (4, 2))
    >>> r = check_underflow(tapped, {"w": jnp.ones((2, 2))}, (x, c),
    ...                     activations={"logits": jnp.zeros((8, 2))})
    >>> sorted(r.fractions().items())
    [('activations/logits', 0.5), ('w', 0.0)]
    >>> r.needs_loss_scaling()
    True

    An autocast function, no dtype parameter:

    >>> import jax_lossscale as jls
    >>> amp = jls.autocast(lambda p, batch: 1e-9 * jnp.sum(batch @ p["w"]))
    >>> check_underflow(amp, {"w": jnp.ones((3, 2))}, jnp.ones((4, 3))).fractions(scaled=True)
    {'activations/dot_general#0': 0.0, 'w': 0.0}
  """
  scale = scale_of(scale)
  spec = autocast_spec(loss_fn)
  tapped = activations is not None
  if tapped and isinstance(params, Mapping) and "activations" in params:
    raise ValueError(
      "activations: params already has a top-level 'activations' key; pass the "
      "taps either inside params or as activations=, not both."
    )
  taps = (
    jax.tree_util.tree_map(
      lambda a: jnp.zeros(getattr(a, "shape", jnp.shape(a)), jnp.float32), activations
    )
    if tapped
    else None
  )
  if spec is not None:
    if half_dtype is None:
      half_dtype = jnp.float16 if spec.dtype == np.float32 else spec.dtype
    call: Callable[[Any, Any], Any] = _autocast_call(spec, batch, tapped)
    variables: Any = {
      "params": params,
      "activations": taps,
      "lowp": _lowp_taps(spec, params, batch, taps, half_dtype),
    }
  else:
    half_dtype = jnp.float16 if half_dtype is None else half_dtype
    variables = {"params": params, "activations": taps} if tapped else params

    def call(v: Any, dtype: Any) -> Any:
      if tapped:
        return loss_fn(v["params"], batch, dtype, v["activations"])
      return loss_fn(v, batch, dtype)

  def grads(v, dtype, s):
    g = jax.grad(lambda q: jnp.asarray(call(q, dtype)).astype(jnp.float32) * s)(v)
    return unscale_and_check(g, s)

  def to32(x):
    if x is None or not is_float(x):
      return x
    x = jnp.asarray(x)
    return x.astype(jnp.float32) if x.dtype.itemsize < 4 else x

  ref, _ = grads(jax.tree_util.tree_map(to32, variables), jnp.float32, jnp.float32(1))
  g1, finite1 = grads(variables, half_dtype, jnp.float32(1))
  gs, finite_s = grads(variables, half_dtype, scale)

  def named(tree):
    out = _named_float_leaves(tree)
    if not (tapped or spec is not None):
      return out
    # The params' own names, as without taps; the taps under "activations/".
    renamed = []
    for n, x in out:
      if n.startswith("params/"):
        n = n[len("params/") :]
      elif n.startswith("lowp/"):
        n = "activations/" + n[len("lowp/") :]
      renamed.append((n, x))
    return renamed

  ref_leaves = named(ref)
  flat1 = dict(named(g1))
  flats = dict(named(gs))
  nonzero, lost1, losts = {}, {}, {}
  for name, r in ref_leaves:
    nz = r != 0
    nonzero[name] = jnp.sum(nz, dtype=jnp.int32)
    lost1[name] = jnp.sum(nz & (flat1[name] == 0), dtype=jnp.int32)
    losts[name] = jnp.sum(nz & (flats[name] == 0), dtype=jnp.int32)
  return UnderflowReport(nonzero, lost1, losts, finite1, finite_s, scale)
