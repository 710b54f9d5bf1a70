"""In-step gradient statistics: where float16 overflows or underflows, per leaf, every step.

:func:`grad_diagnostics` runs inside the train step on the scaled gradients (no host sync);
:func:`grad_leaf_names` names its leaves on the host. The one-off three-backward check is
:mod:`jax_lossscale._diagnostics._underflow`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_lossscale._scaler._numerics import compute_dtype
from jax_lossscale._scaler._numerics import is_float
from jax_lossscale._scaler._state import scale_of
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


def _is_partial(x: Any) -> bool:
  """An ``equinox.Partial`` (a module of ``func``, ``args``, ``keywords``)."""
  return type(x).__name__ == "Partial" and all(hasattr(x, a) for a in ("func", "args", "keywords"))


def _paths(tree: Any, root: Any = None) -> list[tuple[tuple[str, ...], Any]]:
  """``(path names, leaf)`` in flattening order; an ``equinox.Partial``'s ``func``,
  ``args`` and ``keywords`` are left out of the names (``head/weight``, not
  ``head/func/weight``), unless that would give two leaves one name."""
  out: list[tuple[tuple[str, ...], Any]] = []
  flat = jax.tree_util.tree_flatten_with_path(
    tree, is_leaf=lambda x: x is not root and _is_partial(x)
  )[0]
  for path, leaf in flat:
    names = tuple(_key_name(k) for k in path)
    if not _is_partial(leaf):
      out.append((names, leaf))
      continue
    inner = _paths(leaf, root=leaf)
    short = [(n[1:] if n[:1] in (("func",), ("keywords",), ("args",)) else n) for n, _ in inner]
    if len(set(short)) < len(short):
      short = [n for n, _ in inner]
    out.extend((names + n, x) for n, (_, x) in zip(short, inner, strict=True))
  return out


def _is_float_leaf(leaf: Any) -> bool:
  try:
    return leaf is not None and is_float(leaf)
  except TypeError:  # a non-array leaf (an Equinox module's function)
    return False


def named_float_leaves(tree: Any) -> list[tuple[str, Any]]:
  """``(name, leaf)`` for each floating-point leaf, in flattening order."""
  out, seen = [], set()
  for path, leaf in _paths(tree):
    if not _is_float_leaf(leaf):
      continue
    name = "/".join(path) or "leaf"
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
  ``"layers/0/weight"``); a bare array is named ``"leaf"``. An
  ``equinox.Partial`` adds no ``func/``, ``args/`` or ``keywords/`` to the
  names of what it holds.

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
  return [name for name, _ in named_float_leaves(grads)]


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
  the optimizer) and return what it gives with the step's metrics: a read-only
  mapping (:class:`GradDiagnostics`, a pytree; ``.flat()`` gives a plain dict of
  host values) whose every value is a JAX scalar; there is no host sync and no
  Python control flow on values.
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
  named = named_float_leaves(scaled_grads)
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
