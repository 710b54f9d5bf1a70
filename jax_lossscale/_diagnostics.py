"""Diagnostics: per-layer gradient statistics and a one-off float16 underflow check."""

from __future__ import annotations

import math
from typing import Any
from typing import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_lossscale._numerics import compute_dtype
from jax_lossscale._numerics import is_float
from jax_lossscale._numerics import unscale_and_check
from jax_lossscale._typing import ArrayLike
from jax_lossscale._typing import DTypeLike
from jax_lossscale._typing import PyTree
from jax_lossscale._typing import ScaleLike

FLOAT16_MAX = np.float32(65504.0)
# Smallest normal float16 (2**-14 ~ 6.1e-5): magnitudes below it are float16
# subnormals (precision lost, 2**-24 ~ 6e-8 and below flush to 0).
FLOAT16_TINY = np.float32(2.0**-14)

_STATS = ("max_abs", "nonfinite", "headroom", "subnormal_or_zero")


def _scale_of(scale: Any) -> jax.Array:
  """A float32 scale from a number, an array or anything holding a scale state."""
  if isinstance(scale, (int, float)) or hasattr(scale, "dtype"):
    return jnp.asarray(scale, jnp.float32)
  import jax_lossscale  # the public finder, wherever it lives

  return jnp.asarray(jax_lossscale.get_scale_state(scale).scale, jnp.float32)


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


def _leaf_reduction(g: jax.Array, dt) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(max finite |g|, non-finite count, count below 2**-14)`` in one variadic reduce.

  One ``lax.reduce`` over three operands is a single loop over the leaf.
  Three separate ``jnp.max``/``jnp.sum`` calls are not fused on XLA:CPU
  (each writes a leaf-sized intermediate first): measured 37 ms against
  1.5 ms for one 2048x2048 float16 leaf on 2 CPU cores.
  """
  a = jnp.abs(g.astype(dt))
  finite = jnp.isfinite(a)
  zero = np.zeros([], dt)
  operands = (
    jnp.where(finite, a, zero),
    jnp.logical_not(finite).astype(jnp.int32),
    (a < FLOAT16_TINY.astype(dt)).astype(jnp.int32),
  )

  def combine(x, y):
    return jnp.maximum(x[0], y[0]), x[1] + y[1], x[2] + y[2]

  init = (zero, np.zeros([], np.int32), np.zeros([], np.int32))
  return jax.lax.reduce(operands, init, combine, tuple(range(a.ndim)))


def grad_diagnostics(scaled_grads: optax.Updates, scale: ScaleLike) -> dict[str, jax.Array]:
  """Per-leaf statistics of the scaled gradients: where float16 overflows or underflows.

  Call it inside the train step on the gradients of the scaled loss (before
  the optimizer) and return the dict with the step's metrics: every value is
  a JAX scalar, there is no host sync and no Python control flow on values,
  and each leaf is read once (one fused set of reductions per leaf). For each
  floating-point leaf named ``name`` (see :func:`grad_leaf_names`):

  * ``name/max_abs`` (float32): the true (unscaled) largest magnitude of
    the leaf's finite elements, ``max|g| / scale``; 0 for an all-zero leaf.
  * ``name/nonfinite`` (int32): how many elements are inf or NaN.
  * ``name/headroom`` (float32): ``log2(65504 / max|g|)`` over the *scaled*
    finite elements: how many doublings of the scale are left before this
    leaf overflows float16 (0 at exactly 65504, negative when it already
    exceeds it, ``+inf`` for an all-zero leaf, ``-inf`` when the leaf holds an
    inf or NaN).
  * ``name/subnormal_or_zero`` (float32): the share of elements whose scaled
    magnitude is below float16's smallest normal ``2**-14`` (including exact
    zeros, ``-0.0`` too): float16 subnormals, which keep fewer bits, or values
    flushed to zero. Zeros the model produces itself (ReLU, padding) count
    too; :func:`check_underflow` separates those from real underflow.

  And over all leaves: ``min_headroom`` (float32, ``+inf`` with no float
  leaves), ``min_headroom_leaf`` (int32 index into
  :func:`grad_leaf_names`, the first such leaf on ties, -1 with no float
  leaves), and ``nonfinite`` (int32, total inf/NaN count). The leaf with the
  least headroom is the one that limits the loss scale.

  Statistics are computed in float32 (float64 leaves in float64) and
  returned in float32. Counts are int32 (leaves of up to 2**31 elements).

  Args:
    scaled_grads: pytree of gradients of the scaled loss. Integer, boolean
      and ``None`` leaves are ignored.
    scale: the loss scale the gradients carry: a scalar, a
      :class:`DynamicScaleState`, or an optimizer/train state holding one
      (as :func:`get_scale_state` finds it).

  Returns:
    A flat ``dict`` of scalar arrays, ready for TensorBoard/W&B/CLU writers.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from jax_lossscale.diagnostics import grad_diagnostics, grad_leaf_names
    >>> g = {"a": jnp.array([4.0, 0.0], jnp.float16), "b": jnp.array([16376.0, 1e-7])}
    >>> d = jax.jit(grad_diagnostics)(g, 4.0)
    >>> d["a/max_abs"].item(), d["a/subnormal_or_zero"].item(), d["b/headroom"].item()
    (1.0, 0.5, 2.0)
    >>> grad_leaf_names(g)[d["min_headroom_leaf"].item()]
    'b'
  """
  scale = _scale_of(scale)
  out: dict[str, jax.Array] = {}
  headrooms, nonfinite_total = [], jnp.zeros([], jnp.int32)
  for name, g in _named_float_leaves(scaled_grads):
    g = jnp.asarray(g)
    dt = compute_dtype(g.dtype)
    largest, nonfinite, small = _leaf_reduction(g, dt)
    largest = largest.astype(jnp.float32)
    headroom = jnp.where(nonfinite > 0, np.float32(-np.inf), jnp.log2(FLOAT16_MAX / largest))
    size = max(int(np.prod(g.shape)), 1)
    out[f"{name}/max_abs"] = largest / scale
    out[f"{name}/nonfinite"] = nonfinite
    out[f"{name}/headroom"] = headroom
    out[f"{name}/subnormal_or_zero"] = small.astype(jnp.float32) / np.float32(size)
    headrooms.append(headroom)
    nonfinite_total = nonfinite_total + nonfinite
  if headrooms:
    stacked = jnp.stack(headrooms)
    out["min_headroom"] = jnp.min(stacked)
    out["min_headroom_leaf"] = jnp.argmin(stacked).astype(jnp.int32)
  else:
    out["min_headroom"] = jnp.asarray(np.float32(np.inf))
    out["min_headroom_leaf"] = jnp.asarray(-1, jnp.int32)
  out["nonfinite"] = nonfinite_total
  return out


class UnderflowReport(NamedTuple):
  """What :func:`check_underflow` measured; a pytree of arrays (jit-safe).

  All dicts are keyed by leaf name (:func:`grad_leaf_names` of the params).

  Attributes:
    nonzero: int32 per leaf, elements of the float32 gradient that are not 0.
    lost_unscaled: int32 per leaf, of those, how many the float16 backward
      without loss scaling (scale 1) returns as exactly 0.
    lost_scaled: int32 per leaf, the same for the float16 backward at
      ``scale`` (gradients unscaled in float32 afterwards).
    finite_unscaled: bool, whether the unscaled float16 gradients are finite.
    finite_scaled: bool, whether the scaled float16 gradients are finite.
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

  def total(self, scaled: bool = False, prefix: str = "") -> float:
    """The share over all leaves (or over those whose name starts with ``prefix``)."""
    lost = self.lost_scaled if scaled else self.lost_unscaled
    keys = [k for k in self.nonzero if k.startswith(prefix)]
    nz = sum(int(self.nonzero[k]) for k in keys)
    return sum(int(lost[k]) for k in keys) / nz if nz else 0.0

  def needs_loss_scaling(self, threshold: float = 0.01) -> bool:
    """Whether float16 without scaling loses at least ``threshold`` of the gradient."""
    return self.total() >= threshold and self.total(scaled=True) < self.total()

  def verdict(self, threshold: float = 0.01) -> str:
    """One line: does this model need loss scaling at these params?"""
    if not bool(self.finite_unscaled):
      return (
        "float16 overflows even without scaling (inf/NaN at scale 1): keep the "
        "overflowing ops in float32; loss scaling cannot help with that."
      )
    fr = self.fractions()
    worst = max(fr, key=fr.get) if fr else "-"
    scale = float(self.scale)
    exp = math.log2(scale) if scale > 0 else float("nan")
    scale_txt = f"2^{exp:.0f}" if exp == round(exp) else f"{scale:g}"
    with_scale = (
      f"{self.total(scaled=True):.2%} at scale {scale_txt}"
      if bool(self.finite_scaled)
      else f"scale {scale_txt} overflows (the dynamic scaler backs off from it)"
    )
    head = (
      f"float16 without loss scaling flushes {self.total():.2%} of the non-zero "
      f"gradient elements to 0 (worst leaf {worst}: {fr.get(worst, 0.0):.2%}); "
      f"{with_scale}"
    )
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


def check_underflow(
  loss_fn: Callable[[optax.Params, PyTree, DTypeLike], ArrayLike],
  params: optax.Params,
  batch: PyTree,
  *,
  scale: ScaleLike = 2.0**16,
  half_dtype: DTypeLike = jnp.float16,
) -> UnderflowReport:
  """A one-off check of one batch: does float16 flush this model's gradients to zero?

  Runs three backward passes at the same ``params`` and ``batch``:
  ``loss_fn(params, batch, half_dtype)`` without scaling and with the loss
  multiplied by ``scale`` (then unscaled in float32, exactly as
  :func:`dynamic_loss_scale` does), and ``loss_fn(params32, batch,
  jnp.float32)``, the reference, with every floating-point param cast to
  float32. Per leaf it counts the reference's non-zero gradient elements and,
  of those, how many each float16 backward returns as exactly 0: the
  gradient that half precision loses. Zeros the model produces itself (ReLU,
  masking) are zero in the reference too and are not counted.

  It is a pure function of arrays (fine under ``jax.jit``; build the jitted
  function once and reuse it to check several batches or points in
  training). The result's host methods give the per-leaf shares
  (``fractions``, ``table``) and a one-line ``verdict()``.

  To check activation gradients too, add zero "taps" to the params and add
  them (cast to ``dtype``) to the activations inside ``loss_fn``: the
  gradient of a tap is the gradient of that activation.

  Args:
    loss_fn: ``loss_fn(params, batch, dtype) -> scalar loss``, running the
      model's half-precision compute (matmuls, activations) in ``dtype``.
    params: the parameters (float32 master params, or half params).
    batch: anything ``loss_fn`` takes as its batch.
    scale: the loss scale of the scaled backward (default torch's 2**16;
      pass the scaler's current scale, or the optimizer state, to check a
      point in training).
    half_dtype: ``jnp.float16`` (default) or ``jnp.bfloat16``.

  Returns:
    An :class:`UnderflowReport`.

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
  """
  scale = _scale_of(scale)

  def grads(p, dtype, s):
    g = jax.grad(lambda q: jnp.asarray(loss_fn(q, batch, dtype)).astype(jnp.float32) * s)(p)
    return unscale_and_check(g, s)

  def to32(x):
    if x is None or not is_float(x):
      return x
    x = jnp.asarray(x)
    return x.astype(jnp.float32) if x.dtype.itemsize < 4 else x

  ref, _ = grads(jax.tree_util.tree_map(to32, params), jnp.float32, jnp.float32(1))
  g1, finite1 = grads(params, half_dtype, jnp.float32(1))
  gs, finite_s = grads(params, half_dtype, scale)
  ref_leaves = _named_float_leaves(ref)
  flat1 = dict(_named_float_leaves(g1))
  flats = dict(_named_float_leaves(gs))
  nonzero, lost1, losts = {}, {}, {}
  for name, r in ref_leaves:
    nz = r != 0
    nonzero[name] = jnp.sum(nz, dtype=jnp.int32)
    lost1[name] = jnp.sum(nz & (flat1[name] == 0), dtype=jnp.int32)
    losts[name] = jnp.sum(nz & (flats[name] == 0), dtype=jnp.int32)
  return UnderflowReport(nonzero, lost1, losts, finite1, finite_s, scale)
