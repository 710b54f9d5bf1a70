"""The one-off check: does float16 flush this model's gradients to zero?

:func:`check_underflow` runs three backward passes of one batch (half precision unscaled and
scaled, and a float32 reference) and counts, per leaf, the gradient elements half precision
loses; :class:`UnderflowReport` holds the counts and gives the verdict.
"""

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

from jax_lossscale._autocast import AUTOCAST_MARK
from jax_lossscale._autocast import autocast_spec
from jax_lossscale._autocast import interpret
from jax_lossscale._autocast import is_array
from jax_lossscale._autocast import jaxprs_in_params
from jax_lossscale._diagnostics._stats import named_float_leaves
from jax_lossscale._diagnostics._taps import Taps
from jax_lossscale._diagnostics._taps import per_iteration
from jax_lossscale._scaler._numerics import is_float
from jax_lossscale._scaler._numerics import unscale_and_check
from jax_lossscale._scaler._state import scale_of
from jax_lossscale._typing import ArrayLike
from jax_lossscale._typing import DTypeLike
from jax_lossscale._typing import PyTree
from jax_lossscale._typing import ScaleLike

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
    not_checked: what the automatic taps of an autocast ``loss_fn`` did not look
      at: per kind of region (``"cond"``, ``"custom_vjp_call"``, ``"custom_jvp_call"``,
      ``"shard_map"``), int32 ``[regions, lower-precision outputs]`` (each branch's
      outputs counted), less the outputs a user's tap is added to; for a
      ``loss_fn`` that is no autocast function and got no taps, ``"loss_fn"``:
      ``[1, its half-precision matmul and convolution outputs]``, none of whose
      gradients was checked. Empty otherwise (a ``scan``'s outputs are checked,
      one leaf per iteration).
  """

  nonzero: dict[str, jax.Array]
  lost_unscaled: dict[str, jax.Array]
  lost_scaled: dict[str, jax.Array]
  finite_unscaled: jax.Array
  finite_scaled: jax.Array
  scale: jax.Array
  not_checked: dict[str, jax.Array] = {}  # noqa: RUF012 (a NamedTuple's default, never mutated)

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
    (``>=``), with scaling losing less, is a yes. A no judges only what was
    looked at: where ``not_checked`` holds ``"loss_fn"``, the half-precision
    activations' gradients were not measured, and :meth:`verdict` says it
    cannot tell.
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
    regions = {k: n for k, n in self.not_checked.items() if k != UNTAPPED}
    if regions:
      inside = ", ".join(f"{int(n[0])} {kind}" for kind, n in sorted(regions.items()))
      outputs = sum(int(n[1]) for n in regions.values())
      head += (
        f"; not checked: the {outputs} lower-precision op outputs inside {inside} "
        "(pass activations= taps, added to them, to check them)"
      )
    untapped = int(self.not_checked[UNTAPPED][1]) if UNTAPPED in self.not_checked else 0
    if untapped:
      head += (
        f"; not checked: the gradients of loss_fn's {untapped} half-precision matmul and "
        "convolution outputs (activations= taps, or jls.autocast of the float32 model, "
        "check them)"
      )
    if self.needs_loss_scaling(threshold):
      return f"NEEDS loss scaling: {head}."
    if untapped:
      # Activation gradients flush long before parameter gradients do (those sum over
      # the batch): a "no" from the parameters alone is no answer for a half model.
      return f"cannot tell from the parameter gradients alone (threshold {threshold:.2%}): {head}."
    return f"does not need loss scaling here (threshold {threshold:.2%}): {head}."

  def table(self) -> str:
    """Per-leaf lines: name, non-zero elements, share lost unscaled / scaled."""
    fu, fs = self.fractions(), self.fractions(scaled=True)
    width = max([len(k) for k in fu] + [4])
    lines = [f"{'leaf':<{width}}  {'nonzero':>10}  {'lost, scale 1':>13}  {'lost, scaled':>12}"]
    for k in fu:
      lines.append(f"{k:<{width}}  {int(self.nonzero[k]):>10}  {fu[k]:>13.3%}  {fs[k]:>12.3%}")
    return "\n".join(lines)


def _autocast_call(
  spec: Any, batch: Any, tapped: bool, loops: Mapping[str, Any]
) -> Callable[..., Any]:
  """``call(variables, dtype)`` of an autocast ``loss_fn``: its policy, its taps honoured.

  Every output of a lower-precision primitive (outside loops and custom rules) gets a
  zero tap, under ``variables["lowp"]`` (one row per iteration inside a ``scan``, the
  scans of each in ``loops``); the user's taps (``variables["activations"]``)
  and Flax ``"perturbations"`` in the params take the dtype of the activation they are
  added to, as constants do, so their gradients are the activations' own.
  """

  def follows(path: tuple[Any, ...]) -> bool:
    keys = [getattr(k, "idx", getattr(k, "key", None)) for k in path]
    if keys[:2] == [0, 2]:  # loss_fn(params, batch, taps): the taps
      return True
    return keys[:3] == [0, 0, "perturbations"]

  def call(v: Any, dtype: Any) -> Any:
    taps = Taps(v["lowp"], loops)
    args = (v["params"], batch, v["activations"]) if tapped else (v["params"], batch)
    reference = np.dtype(dtype) == np.float32  # the function as written
    return interpret(spec, dtype, args, taps=taps, follows=follows, as_written=reference)

  return call


def _lowp_taps(
  spec: Any, params: Any, batch: Any, taps: Any, dtype: Any
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
  """Zeros for the outputs of the lower-precision primitives of an autocast ``loss_fn``
  (those a user's tap is added to left out: they are tapped once; those inside scans
  stacked, one row per iteration), what was not tapped: ``primitive -> [regions,
  outputs]`` as int32, and the scans each stacked tap is in (:attr:`Taps.loops`)."""
  counted = Taps()

  def follows(path: tuple[Any, ...]) -> bool:
    keys = [getattr(k, "idx", getattr(k, "key", None)) for k in path]
    return keys[:2] == [0, 2] or keys[:3] == [0, 0, "perturbations"]

  args = (params, batch) if taps is None else (params, batch, taps)
  jax.eval_shape(lambda *a: interpret(spec, dtype, a, taps=counted, follows=follows), *args)
  zeros = {
    name: jnp.zeros(s.shape, s.dtype)
    for name, s in zip(counted.names, counted.shapes, strict=True)
    if name not in counted.duplicates
  }
  untapped = {prim: jnp.asarray(n, jnp.int32) for prim, n in counted.untapped.items() if n[1]}
  loops = {name: counted.loops[name] for name in zeros if name in counted.loops}
  return zeros, untapped, loops


_HALF = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))

#: The ``not_checked`` key of a ``loss_fn`` that got no taps and is no autocast function.
UNTAPPED = "loss_fn"

#: The primitives whose half-precision outputs count as a model's half-precision compute.
_HALF_COMPUTE = ("dot_general", "conv_general_dilated")


def _half_compute_outputs(jaxpr: Any) -> int:
  """The half-precision matmul and convolution outputs of a traced loss, nested jaxprs
  (``jit``, ``scan``, ``cond``, ``remat``, custom rules) included."""
  n = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in _HALF_COMPUTE:
      n += sum(np.dtype(v.aval.dtype) in _HALF for v in eqn.outvars)
    n += sum(_half_compute_outputs(sub) for sub in jaxprs_in_params(eqn.params))
  return n


def _check_taps_follow(call: Callable[..., Any], variables: Any, dtype: Any) -> None:
  """Refuses a float32 tap added to a half-precision activation made float32 for it.

  ``h + taps["h"]`` with a float32 tap inside an autocast function (or
  ``h.astype(jnp.float32) + taps["h"]``) adds the tap to the float32 copy of ``h``:
  its gradient is the float32 one, and the check would measure nothing.
  """
  leaves = jax.tree_util.tree_flatten_with_path(variables)[0]
  closed = jax.make_jaxpr(lambda v: call(v, dtype))(variables)
  names = {}
  for var, (path, _) in zip(closed.jaxpr.invars, leaves, strict=True):
    keys = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
    if keys[:1] == ["activations"]:
      names[var] = "/".join(keys[1:])
  _walk_taps(closed.jaxpr, names, {}, False)


#: The primitives a function is staged into whole (jit, remat, the call primitives of jax
#: 0.9-0.10 and eval_jaxpr from 0.11): the walk for a tap added in float32 enters them.
_STAGED = ("jit", "remat2", "closed_call", "eval_jaxpr")


def _walk_taps(jaxpr: Any, taps: dict[Any, str], upcast: dict[Any, Any], in_autocast: bool) -> None:
  from jax.extend.core import Var

  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    ins = [v if isinstance(v, Var) else None for v in eqn.invars]
    if name == "convert_element_type":
      src = eqn.invars[0].aval.dtype
      if ins[0] in taps:
        taps[eqn.outvars[0]] = taps[ins[0]]
      elif np.dtype(src) in _HALF and np.dtype(eqn.params["new_dtype"]) == np.float32:
        upcast[eqn.outvars[0]] = src
    elif name in ("add", "sub"):
      for a, b in ((ins[0], ins[1]), (ins[1], ins[0])):
        if a in taps and b in upcast and np.dtype(eqn.invars[0].aval.dtype) == np.float32:
          half = np.dtype(upcast[b]).name
          hint = (
            # inside autocast the activation reads float32 (h.dtype is float32 there):
            # no cast written in the function reaches the half activation
            "Pass the autocast function itself as loss_fn, check_underflow(jls.autocast(f), "
            "params, batch, activations=...) with f(params, batch, taps): its taps take "
            "the dtype of the activation they meet (inside autocast, h.dtype reads float32, "
            "so a cast to it changes nothing)."
            if in_autocast
            else f"Add the tap in the activation's dtype, before it is made float32 "
            f"(h + taps[...].astype(dtype), dtype the loss_fn's argument, here {half})."
          )
          raise ValueError(
            f"activations: the tap {taps[a]!r} is added in float32 to a {half} activation "
            f"made float32 for it, so it measures the float32 gradient. {hint}"
          )
    sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    if name in _STAGED and sub is not None:
      inner = getattr(sub, "jaxpr", sub)
      inner_taps = {iv: taps[v] for v, iv in zip(ins, inner.invars, strict=False) if v in taps}
      inner_up = {iv: upcast[v] for v, iv in zip(ins, inner.invars, strict=False) if v in upcast}
      if inner_taps:
        inside = in_autocast or AUTOCAST_MARK in str(eqn.params.get("name", ""))
        _walk_taps(inner, inner_taps, inner_up, inside)


def _arrays_only(params: Any, loss_fn: Any, spec: Any) -> tuple[Any, Any, Any]:
  """Params with their non-array leaves (an Equinox module's functions) held static."""
  # A None of the user's is a leaf here, as in `combine` below, and is no function to
  # hold static: params with no other non-array leaf are returned as they are.
  leaves, treedef = jax.tree_util.tree_flatten(params, is_leaf=lambda x: x is None)
  static = [
    x is not None and not (is_array(x) or isinstance(x, (int, float, complex))) for x in leaves
  ]
  if not any(static):
    return params, loss_fn, spec
  arrays = jax.tree_util.tree_unflatten(
    treedef, [None if s else x for x, s in zip(leaves, static, strict=True)]
  )

  def combine(p: Any) -> Any:
    got = jax.tree_util.tree_flatten(p, is_leaf=lambda x: x is None)[0]
    return jax.tree_util.tree_unflatten(
      treedef, [x if s else g for x, g, s in zip(leaves, got, static, strict=True)]
    )

  if spec is not None:
    fun = spec.fun
    return arrays, loss_fn, spec._replace(fun=lambda p, *a: fun(combine(p), *a))
  return arrays, lambda p, *a: loss_fn(combine(p), *a), spec


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
  attention scores; outside conds and custom rules) is reported under
  ``"activations/<scope>/<primitive>#<n>"``. Inside a ``lax.scan`` (a scanned
  model's blocks, a ``fori_loop`` of static trip count, Flax's ``nn.scan``) each
  output is tapped once per iteration, its leaves named
  ``"activations/scan#<k>[<i>]/<scope>/<primitive>#<n>"`` (iteration ``i`` of the
  function's ``k``-th scan, ``i`` the row of the scanned inputs it reads): each
  layer of a scanned model is checked as its unrolled twin's. Taps written into ``f``
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
  params, loss_fn, spec = _arrays_only(params, loss_fn, spec)
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
    lowp, not_checked, loops = _lowp_taps(spec, params, batch, taps, half_dtype)
    call: Callable[[Any, Any], Any] = _autocast_call(spec, batch, tapped, loops)
    variables: Any = {"params": params, "activations": taps, "lowp": lowp}
  else:
    half_dtype = jnp.float16 if half_dtype is None else half_dtype
    variables = {"params": params, "activations": taps} if tapped else params
    not_checked, loops = {}, {}

    def call(v: Any, dtype: Any) -> Any:
      if tapped:
        return loss_fn(v["params"], batch, dtype, v["activations"])
      return loss_fn(v, batch, dtype)

    if tapped or (isinstance(params, Mapping) and "activations" in params):
      # taps passed as activations=, or inside params under the same top-level key
      _check_taps_follow(call, variables, half_dtype)
    elif not (isinstance(params, Mapping) and "perturbations" in params):
      closed = jax.make_jaxpr(lambda v: call(v, half_dtype))(variables)
      outputs = _half_compute_outputs(closed.jaxpr)
      if outputs:
        not_checked = {UNTAPPED: jnp.asarray([1, outputs], jnp.int32)}

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
    out = named_float_leaves(tree)
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
    tap = name[len("activations/") :]
    # a tap inside a scan: one leaf per iteration, its row of the stacked tap
    rows = per_iteration(name, loops[tap]) if tap in loops else [(name, ())]
    for row_name, i in rows:
      nonzero[row_name] = jnp.sum(nz[i], dtype=jnp.int32)
      lost1[row_name] = jnp.sum(nz[i] & (flat1[name][i] == 0), dtype=jnp.int32)
      losts[row_name] = jnp.sum(nz[i] & (flats[name][i] == 0), dtype=jnp.int32)
  return UnderflowReport(nonzero, lost1, losts, finite1, finite_s, scale, not_checked)
