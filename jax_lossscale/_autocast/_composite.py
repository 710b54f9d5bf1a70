"""Composite ops: a function autocast treats as one op with its own rule.

The equivalent of ``torch.library.register_autocast``. :func:`autocast_op` marks a
function; under :func:`jax_lossscale.autocast` each call is one op: its float inputs are
cast by its rule, the function is traced again on them (autocast is off inside, as in
torch's registered ops), and its outputs are what it returns (``"float32_compute"``:
the outputs shaped like the primary input come back in that input's dtype). Outside
autocast the function runs unchanged.

While autocast traces (:func:`marking`), each call of a marked function is staged as a
marker: a ``jit`` whose name carries the op's rule and arity, which the interpreter
evaluates through :func:`evaluate` (declared for that name by ``jit_region``). The
registrations torch implies are built on :func:`op_wrapper` in :mod:`._registrations`.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Sequence
import contextlib
import functools
import re
from typing import Any
from typing import NamedTuple
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from jax_lossscale._autocast._arguments import rebuild
from jax_lossscale._autocast._arguments import split
from jax_lossscale._autocast._errors import AutocastError
from jax_lossscale._autocast._interpreter import Interpreter
from jax_lossscale._autocast._policy import COMPOSITE_RULES
from jax_lossscale._autocast._policy import FLOAT32
from jax_lossscale._autocast._policy import FLOAT32_COMPUTE
from jax_lossscale._autocast._policy import LOWER
from jax_lossscale._autocast._policy import PROMOTE
from jax_lossscale._autocast._policy import nearest
from jax_lossscale._autocast._rules._as_written import as_written
from jax_lossscale._autocast._rules._calls import jit_region
from jax_lossscale._autocast._rules._registry import Interp
from jax_lossscale._autocast._values import Facts
from jax_lossscale._autocast._values import Val
from jax_lossscale._autocast._values import cast
from jax_lossscale._autocast._values import is_eligible
from jax_lossscale._autocast._values import torch_promote

__all__ = ("autocast_op", "evaluate", "marking", "op_wrapper", "tracing_dtype")

#: The autocast dtype while autocast traces its function, else ``None``. It is a JAX
#: user context, so a ``jax.jit`` traced under autocast is cached apart from the same
#: ``jax.jit`` traced outside it.
_TRACING = jax.make_user_context(None)

#: The name prefix of a composite op's marker (a ``jit``), evaluated by :func:`evaluate`.
OP_MARK = "jls_op_"


@contextlib.contextmanager
def marking(dtype: Any) -> Iterator[None]:
  """While autocast traces its function in ``dtype``: composite ops are staged as markers."""
  with _TRACING(np.dtype(dtype).name):
    yield


def tracing_dtype() -> np.dtype | None:
  """The dtype of the autocast whose function is being traced, or ``None``."""
  value = _TRACING.value
  return None if value is None else np.dtype(value)


class _Entry(NamedTuple):
  """What re-calls one traced call of a composite op on the actual dtypes.

  It holds no jaxpr: it is the value of its own declared jaxpr in ``_REGISTRY``, and a
  reference back to that key would keep both alive for ever.
  """

  fn: Callable[..., Any]
  rule: str
  treedef: Any
  template: tuple[Any, ...]
  dyn_idx: tuple[int, ...]
  primary: int | None  # the position in the dynamic leaves of the primary input


class _Meta(NamedTuple):
  """What a marker's name says: all a transformed marker needs (no registry lookup)."""

  rule: str
  primary: int | None  # the position in the dynamic leaves of the primary input
  n_in: int  # the op's dynamic inputs (the declared marker's inputs, one for one)
  n_out: int  # the op's flat outputs (the declared marker's outputs)
  label: str | None  # the function's ``__name__`` (the underflow taps' label)


#: ``jls_op_<rule>_p<primary or n>_i<inputs>_o<outputs>_<the function's name>``.
_NAME = re.compile(
  rf"^{re.escape(OP_MARK)}"
  rf"(?P<rule>{'|'.join(sorted(map(re.escape, COMPOSITE_RULES), key=len, reverse=True))})"
  r"_p(?P<primary>\d+|n)_i(?P<n_in>\d+)_o(?P<n_out>\d+)_(?P<label>.*)$",
  re.DOTALL,
)


def _marker_name(rule: str, primary: int | None, n_in: int, n_out: int, label: Any) -> str:
  p = "n" if primary is None else str(primary)
  return f"{OP_MARK}{rule}_p{p}_i{n_in}_o{n_out}_{label if isinstance(label, str) else ''}"


def _parse(name: str) -> _Meta:
  found = _NAME.match(name)
  if found is None:
    raise AutocastError(
      f"autocast met a jit named {name!r}, which autocast_op did not make: the prefix "
      f"{OP_MARK!r} is reserved for its markers. Rename the function."
    )
  primary = found["primary"]
  return _Meta(
    found["rule"],
    None if primary == "n" else int(primary),
    int(found["n_in"]),
    int(found["n_out"]),
    found["label"] or None,
  )


#: Each traced call of a composite op, by the identity of its marker's declared jaxpr
#: (the ``ClosedJaxpr`` its equation binds), held weakly: an entry lives exactly as long
#: as a jaxpr that holds the call (the trace autocast evaluates, or a ``jax.jit`` traced
#: under autocast and cached by JAX), and nothing else is kept per call. Keyed by
#: ``id`` with a weak reference rather than by a ``WeakKeyDictionary``, so a jaxpr is
#: never taken for another one equal to it.
_REGISTRY: dict[int, tuple[weakref.ref[Any], _Entry]] = {}


def _register(jaxpr: Any, entry: _Entry) -> None:
  key = id(jaxpr)

  def forget(ref: weakref.ref[Any]) -> None:
    # No lock: this runs when the jaxpr dies, possibly inside a collection triggered
    # while a lock is held. Its memory (so its id) is not reused before this returns.
    found = _REGISTRY.get(key)
    if found is not None and found[0] is ref:
      _REGISTRY.pop(key, None)

  _REGISTRY[key] = (weakref.ref(jaxpr, forget), entry)


def _lookup(jaxpr: Any) -> _Entry | None:
  """The entry of the call whose declared jaxpr is ``jaxpr``, else ``None``."""
  found = _REGISTRY.get(id(jaxpr))
  if found is None or found[0]() is not jaxpr:
    return None
  return found[1]


def _cast_inputs(
  rule: str, dyn: list[Any], lower: Any, follows: Sequence[bool] | None = None
) -> list[Any]:
  """``dyn`` cast by ``rule``. ``follows``: the inputs that take the dtype of the others
  (a converted mask, a constant), left out of ``"promote"``'s choice as the interpreter
  leaves them out of a primitive's."""
  floats = [np.dtype(x.dtype) for x in dyn if is_eligible(x.dtype)]
  if not floats:
    return dyn
  if rule == LOWER:
    target = np.dtype(lower)
  elif rule in (FLOAT32, FLOAT32_COMPUTE):
    target = np.dtype(jnp.float32)
  else:
    flags = [False] * len(dyn) if follows is None else follows
    driving = [
      np.dtype(x.dtype) for x, f in zip(dyn, flags, strict=True) if is_eligible(x.dtype) and not f
    ]
    target = torch_promote(driving or floats)
  return [cast(x, target) if is_eligible(x.dtype) else x for x in dyn]


def _restore_primary(entry: _Entry, outs: list[Any], primary: Any) -> list[Any]:
  if entry.rule != FLOAT32_COMPUTE or primary is None:
    return outs
  shape, dtype = tuple(primary.shape), np.dtype(primary.dtype)
  return [cast(o, dtype) if is_eligible(o.dtype) and tuple(o.shape) == shape else o for o in outs]


def _call(
  entry: _Entry, dyn: list[Any], lower: Any, follows: Sequence[bool] | None = None
) -> tuple[list[Any], Any]:
  """The op on ``dyn`` cast by its rule: its flat outputs and their treedef."""
  primary = dyn[entry.primary] if entry.primary is not None else None
  cast_dyn = _cast_inputs(entry.rule, dyn, lower, follows)
  args, kwargs = rebuild(entry.treedef, entry.template, entry.dyn_idx, cast_dyn)
  with _TRACING(None):  # autocast is off inside the op: a nested op runs as itself
    out = entry.fn(*args, **kwargs)
  leaves, tree = jax.tree_util.tree_flatten(out)
  return _restore_primary(entry, leaves, primary), tree


@jit_region(OP_MARK)
def evaluate(interp: Interp, eqn: Any, ins: list[Val]) -> list[Val]:
  """An `autocast_op` call: the op on its actual inputs, cast by its rule (the
  shipped registrations below)."""
  meta = _parse(str(eqn.params["name"]))
  # The equation that binds a declared jaxpr is the call itself: it holds that jaxpr,
  # so its entry is alive. Any other equation of a marker is the call transformed by
  # jax.vmap, jvp, partial evaluation or transposition, which its name describes.
  entry = _lookup(eqn.params["jaxpr"])
  saved_from = None
  if entry is not None:
    outs, _ = _call(entry, [v.x for v in ins], interp.dtype, [v.facts.follows for v in ins])
  else:
    outs, saved_from = _transformed(interp, meta, eqn, ins)
  lowp = meta.rule == LOWER
  if lowp:  # its outputs are lower-precision results: check_underflow taps them
    outs = interp.tap(eqn, outs, meta.label)
  facts = [
    Facts(lowp=lowp and is_eligible(o.dtype) and np.dtype(o.dtype) == interp.dtype) for o in outs
  ]
  # The outputs after the op's, in a forward part under grad, are residuals: they carry
  # what its backward part needs to know (saved_from is None for every other marker).
  facts[meta.n_out :] = [f._replace(saved_from=saved_from) for f in facts[meta.n_out :]]
  return [Val(o, f) for o, f in zip(outs, facts, strict=True)]


def _transformed(
  interp: Interp, meta: _Meta, eqn: Any, ins: list[Val]
) -> tuple[list[Any], tuple[tuple[int, ...], np.dtype | None] | None]:
  """A marker transformed by JAX (``vmap``, ``jvp``, partial evaluation, transposition).

  Its jaxpr is the transformed declared trace: the rule's casts on the declared dtypes,
  then the op. With the ``"lower"``, ``"float32"`` and ``"float32_compute"`` rules those
  casts give the op's compute dtype whatever the actual dtypes, so it runs on its
  declared inputs. With ``"promote"`` the compute dtype is the actual inputs' own: the
  jaxpr is evaluated on them with autocast off, every primitive in its operands' dtypes
  (what the op traced on those dtypes computes), its first inputs first promoted together
  as the plain call's are, and the others with them: under vmap and in the forward part
  under grad, the op's inputs; under jvp, the op's inputs then their tangents; in the
  tangent and the transposed parts under grad, the residuals (values of the forward
  part, computed in its dtype, or its inputs) then the tangents or cotangents, which take
  that dtype as torch casts the gradient of an output to the output's dtype.

  Returns the outputs and, for the forward part of a ``"float32_compute"`` op under
  ``grad``, what its residuals (the outputs after the op's) carry to its backward part:
  the shape and dtype of the op's primary input, or that shape and ``None`` where another
  input shares it with another dtype (:attr:`Facts.saved_from`), else ``None``.
  """
  if meta.rule == PROMOTE and not interp.as_written_mode:
    off = Interpreter(interp.dtype, {})
    xs = [v.x for v in ins]
    follows = [v.facts.follows for v in ins]
    # The first inputs drive the promotion (the op's inputs, or the residuals), the
    # tangents or cotangents after them follow.
    tangents = [True] * (len(ins) - meta.n_in)  # none when fewer
    xs = _cast_inputs(PROMOTE, xs, interp.dtype, follows[: meta.n_in] + tangents)
    # Every float input is now in the one dtype: which of them follow no longer matters.
    return [v.x for v in off.eval_closed(eqn.params["jaxpr"], [Val(x) for x in xs])], None
  outs = [v.x for v in as_written(interp, eqn, ins)]
  if meta.rule == LOWER:
    outs = [cast(o, interp.dtype) if is_eligible(o.dtype) else o for o in outs]
  if meta.rule != FLOAT32_COMPUTE or meta.primary is None:
    return outs, None
  # The outputs shaped like the primary input take its dtype (torch's cuDNN batch norm),
  # and so do their tangents and the gradients of the primary (torch's gradient of an
  # input has the input's dtype).
  saved: tuple[tuple[int, ...], np.dtype | None] | None = None
  if len(ins) == meta.n_in:
    # Under vmap, or the forward part under grad: the op's inputs, one for one. Under
    # grad the outputs after the op's are residuals, left as they are: they carry the
    # primary's dtype to the backward part, which may not get the primary itself, unless
    # another input has the primary's shape and another dtype (a float32 b in
    # sin(a) * b): the backward part could not tell their gradients apart by shape.
    primary = ins[meta.primary].x
    shape, dtype = tuple(primary.shape), np.dtype(primary.dtype)
    clash = any(
      i != meta.primary
      and is_eligible(v.x.dtype)
      and tuple(v.x.shape) == shape
      and np.dtype(v.x.dtype) != dtype
      for i, v in enumerate(ins)
    )
    saved, halves = (shape, None if clash else dtype), {shape: dtype}
    n_out = meta.n_out
  else:
    # Under jvp, or the tangent or the transposed part under grad: every output is an
    # output of the op or a tangent or gradient, which takes the dtype of its primal: that
    # of an input of its shape that autocast lowered (the primal, its tangent, a primary
    # saved as it is), or of the primary a residual was saved from.
    halves = {
      tuple(v.x.shape): np.dtype(v.x.dtype)
      for v, var in zip(ins, eqn.invars, strict=True)
      if _is_lowered(v.x, var)
    }
    saved_facts = [v.facts.saved_from for v in ins if v.facts.saved_from is not None]
    halves.update((s, d) for s, d in saved_facts if d is not None)
    # Saved from an op whose primary shares its shape with an input of another dtype:
    # only the first outputs (the primary's gradient, when the primary comes first, as
    # in an op's own outputs) take the dtype of a lowered input of their shape.
    clash = any(d is None for _, d in saved_facts)
    n_out = meta.n_out if clash else len(outs)
  outs = [
    cast(o, halves[tuple(o.shape)])
    if i < n_out and is_eligible(o.dtype) and tuple(o.shape) in halves
    else o
    for i, o in enumerate(outs)
  ]
  return outs, saved


def _is_lowered(x: Any, var: Any) -> bool:
  declared = getattr(var.aval, "dtype", None)
  return is_eligible(x.dtype) and declared is not None and np.dtype(x.dtype) != np.dtype(declared)


def _marker_call(
  fn: Callable[..., Any], rule: str, primary: int | None, args: Any, kwargs: Any
) -> Any:
  """``fn(*args, **kwargs)`` as a composite op's marker, while autocast traces."""
  lower = tracing_dtype()
  leaves, treedef, dyn_idx = split(args, kwargs)
  template = tuple(None if i in dyn_idx else x for i, x in enumerate(leaves))
  primary_pos = None
  if primary is not None:
    first = len(jax.tree_util.tree_leaves(args[:primary]))
    if first in dyn_idx:
      primary_pos = dyn_idx.index(first)
  entry = _Entry(fn, rule, treedef, template, dyn_idx, primary_pos)
  label = getattr(fn, "__name__", None)

  def name(n_out: int) -> str:
    return _marker_name(rule, primary_pos, len(dyn_idx), n_out, label)

  # The declared trace: the rule's casts on the declared dtypes stand in for the real
  # ones (so a kernel that needs half inputs, like cuDNN's attention, can be traced);
  # the interpreter replaces this body by the op on the actual dtypes.
  out_tree: list[Any] = []

  def traced(*dyn: Any) -> list[Any]:
    outs, tree = _call(entry, list(dyn), lower)
    out_tree.append(tree)
    # The marker's name counts the op's outputs: jit names its equation once the body
    # is traced (checked below). Through a weak reference: no cycle delays its release.
    this = itself()
    if this is not None:
      this.__name__ = this.__qualname__ = name(len(outs))
    # The declared trace stays a trace of the model as written: the outputs leave in the
    # dtype of the declared inputs (the interpreter gives them their real dtype).
    floats = [np.dtype(x.dtype) for x in dyn if is_eligible(x.dtype)]
    if floats:
      declared = torch_promote(floats)
      outs = [cast(o, declared) if is_eligible(o.dtype) else o for o in outs]
    return outs

  traced.__name__ = traced.__qualname__ = OP_MARK
  itself = weakref.ref(traced)
  # keep_unused: the marker's inputs are the op's arguments one for one.
  marker = jax.jit(traced, keep_unused=True)
  dyn = [leaves[i] for i in dyn_idx]
  stage = marker.trace(*dyn)
  jaxpr = stage.jaxpr  # the call below binds this very jaxpr (jit's cache)
  if getattr(stage, "fun_name", None) != traced.__name__:
    # A JAX that names the equation before tracing its body (or does not say): the
    # declared trace again, under a jit named from the start.
    from jax.extend.core import jaxpr_as_fun

    first = jaxpr

    def declared(*dyn: Any) -> Any:
      return jaxpr_as_fun(first)(*dyn)

    declared.__name__ = declared.__qualname__ = traced.__name__
    marker = jax.jit(declared, keep_unused=True)
    jaxpr = marker.trace(*dyn).jaxpr
  _register(jaxpr, entry)
  flat = marker(*dyn)
  return jax.tree_util.tree_unflatten(out_tree[-1], flat)


def autocast_op(
  fun: Callable[..., Any] | None = None, rule: str = LOWER, *, primary: int = 0
) -> Any:
  """Marks ``fun`` as one op of :func:`jax_lossscale.autocast`, with its own rule.

  The equivalent of ``torch.library.register_autocast``. Under autocast each call of the
  returned function is one op: its float array arguments are cast by ``rule``, ``fun``
  is traced again on them with autocast off inside (its own casts and its choice of
  kernel stand), and what it returns is the op's output. Outside autocast the returned
  function is ``fun``. ``fun`` must be a function of its array arguments (pytrees of
  arrays, such as an Equinox module, are fine; non-array arguments are static and
  should be hashable).

  Args:
    fun: the function; omit it to use ``autocast_op(rule=...)`` as a decorator.
    rule: ``"lower"`` (float inputs cast to the autocast dtype, as torch's
      ``lower_precision_fp`` ops), ``"float32"`` (cast to float32), ``"promote"`` (to
      the widest float dtype among them) or ``"float32_compute"`` (computed in float32;
      every output shaped like the ``primary`` argument comes back in that argument's
      dtype, as cuDNN's batch norm).
    primary: with ``"float32_compute"``, the position of the argument whose dtype the
      outputs take (default 0).

  Returns:
    A function with ``fun``'s arguments and outputs.

  Raises:
    TypeError: ``fun`` is not callable, or ``primary`` is not an int.
    ValueError: ``rule`` is unknown, or ``primary`` is negative.

  Examples:
    >>> import jax.numpy as jnp
    >>> import jax_lossscale as jls
    >>> @jls.autocast_op(rule="float32_compute")
    ... def normalize(x):
    ...   return (x - x.mean()) / jnp.sqrt(x.var() + 1e-5)
    >>> w = jnp.ones((4, 4))
    >>> jls.autocast(lambda x: normalize(x @ w))(jnp.ones((2, 4))).dtype
    dtype('float16')
  """
  if not isinstance(rule, str) or rule not in COMPOSITE_RULES:
    raise ValueError(
      f"rule must be one of {COMPOSITE_RULES}, got {rule!r}{nearest(str(rule), COMPOSITE_RULES)}."
    )
  if isinstance(primary, bool) or not isinstance(primary, int):
    raise TypeError(f"primary must be an int, got {type(primary).__name__}.")
  if primary < 0:
    raise ValueError(f"primary must be >= 0, got {primary}.")
  if fun is None:
    return functools.partial(autocast_op, rule=rule, primary=primary)
  if not callable(fun):
    raise TypeError(f"fun must be callable, got {type(fun).__name__}.")
  return op_wrapper(fun, rule, primary)


def op_wrapper(fun: Callable[..., Any], rule: str, primary: int) -> Callable[..., Any]:
  """``fun`` as a composite op of ``rule``: itself outside autocast, a marker inside."""

  @functools.wraps(fun)
  def op(*args: Any, **kwargs: Any) -> Any:
    if tracing_dtype() is None:
      return fun(*args, **kwargs)
    return _marker_call(fun, rule, primary if rule == FLOAT32_COMPUTE else None, args, kwargs)

  op.autocast_rule = rule  # type: ignore[attr-defined]
  return op
