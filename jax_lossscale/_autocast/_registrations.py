"""The composite ops torch implies, installed while autocast traces.

``jax.nn.dot_product_attention`` runs in the lower dtype (torch's
``scaled_dot_product_attention``), picking cuDNN's fused kernel on a GPU;
``jax.nn.gelu`` (and Flax's) runs in its input's dtype, as torch's fused ``gelu`` (its
``x ** 3`` would otherwise be torch's float32 ``pow``); the LSTM, GRU and simple RNN cells
of Flax linen, NNX and Equinox run in the lower dtype (torch's ``lstm_cell``,
``gru_cell``, ``rnn_tanh_cell``); their batch norms compute in float32 and return the
input's dtype (cuDNN's ``batch_norm``). Each is a composite op (:mod:`._composite`),
installed only while autocast traces (:func:`tracing`), on the modules already imported,
and restored afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterator
import contextlib
import functools
import sys
import threading
from typing import Any
from typing import NamedTuple

import jax

from jax_lossscale._autocast._attention import attention as routed_attention
from jax_lossscale._autocast._composite import marking
from jax_lossscale._autocast._composite import op_wrapper
from jax_lossscale._autocast._composite import tracing_dtype
from jax_lossscale._autocast._policy import FLOAT32_COMPUTE
from jax_lossscale._autocast._policy import LOWER
from jax_lossscale._autocast._policy import PROMOTE

__all__ = ("registered", "registrations", "tracing")

_LOCK = threading.Lock()  # the registrations' installation


def _attention(original: Callable[..., Any]) -> Callable[..., Any]:
  def impl(
    query: Any, key: Any, value: Any, bias: Any = None, mask: Any = None, **kwargs: Any
  ) -> Any:
    # The kernel is chosen by the platform the step is lowered for (see _attention.py).
    implementation = kwargs.pop("implementation", None)
    return routed_attention(original, query, key, value, bias, mask, implementation, kwargs)

  impl.__name__ = "dot_product_attention"
  return op_wrapper(impl, LOWER, 0)


_attention.rule = LOWER  # type: ignore[attr-defined]


def _method(
  rule: str, primary: int | None = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
  """A pure module method (an Equinox module is a pytree of its arrays) as one op."""

  def make(original: Callable[..., Any]) -> Callable[..., Any]:
    return op_wrapper(original, rule, 0 if primary is None else primary)

  make.rule = rule  # type: ignore[attr-defined]
  return make


def _nnx(rule: str, stats: bool) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
  """An NNX module method as one op; ``stats``: its batch statistics are written back."""

  def make(original: Callable[..., Any]) -> Callable[..., Any]:
    from flax import nnx

    def split_call(state: Any, graphdef: Any, *args: Any, **kwargs: Any) -> Any:
      module = nnx.merge(graphdef.value, state)
      before = jax.tree.leaves(nnx.state(module, nnx.BatchStat)) if stats else []
      out = original(module, *args, **kwargs)
      if not stats:
        return out
      after = nnx.state(module, nnx.BatchStat)
      # The statistics go back only when the call wrote them (training): in evaluation
      # they are left alone, so a module closed over by the function stays usable.
      changed = any(a is not b for a, b in zip(jax.tree.leaves(after), before, strict=True))
      return out, (after if changed else None)

    op = op_wrapper(split_call, rule, 2)

    @functools.wraps(original)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
      if tracing_dtype() is None:
        return original(self, *args, **kwargs)
      graphdef, state = nnx.split(self)
      out = op(state, _Static(graphdef), *args, **kwargs)
      if stats:
        out, new_stats = out
        if new_stats is not None:
          nnx.update(self, new_stats)
      return out

    return method

  make.rule = rule  # type: ignore[attr-defined]
  return make


class _Static:
  """A hashable-by-identity holder for a static argument (an NNX graphdef)."""

  def __init__(self, value: Any):
    self.value = value

  def __eq__(self, other: object) -> bool:
    return isinstance(other, _Static) and other.value == self.value

  def __hash__(self) -> int:
    try:
      return hash(self.value)
    except TypeError:
      return id(self.value)


def _linen(rule: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
  """A linen module's ``__call__`` as one op, through ``apply`` on its variables."""

  def make(original: Callable[..., Any]) -> Callable[..., Any]:
    def apply_call(variables: Any, module: Any, *args: Any, **kwargs: Any) -> Any:
      mutable = kwargs.pop("_jls_mutable")
      return module.value.apply(variables, *args, method=original, mutable=mutable, **kwargs)

    op = op_wrapper(apply_call, rule, 2)

    @functools.wraps(original)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
      if tracing_dtype() is None or self.scope is None or self.is_initializing():
        return original(self, *args, **kwargs)
      variables = self.variables
      mutable = tuple(c for c in variables if self.is_mutable_collection(c))
      unbound = self.clone(parent=None)
      out, updates = op(dict(variables), _Static(unbound), *args, _jls_mutable=mutable, **kwargs)
      for col, tree in dict(updates).items():
        for name, val in dict(tree).items():
          self.put_variable(col, name, val)
      return out

    # Wrapped as linen wraps a module's own methods (compact scope, intermediates).
    from flax.linen.module import wrap_method_once

    vars(method).pop("method_handler_wrapped", None)  # copied from `original` by wraps
    wrapped: Callable[..., Any] = wrap_method_once(method)
    return wrapped

  make.rule = rule  # type: ignore[attr-defined]
  return make


class Registration(NamedTuple):
  """A shipped composite-op registration: where the function lives, how it is wrapped, and
  the torch op it stands for (the autocast guide's table renders from these rows)."""

  module: str
  path: str  # the attribute path: "fun", or "Class.__call__" for a method
  make: Callable[[Callable[..., Any]], Callable[..., Any]]  # the wrapper maker
  torch: str  # the torch op (Markdown), and how it runs there


#: Installed while autocast traces, on the modules already imported; each is restored
#: afterwards.
_REGISTRATIONS: tuple[Registration, ...] = (
  Registration(
    "jax.nn",
    "dot_product_attention",
    _attention,
    "`scaled_dot_product_attention` (lower_precision_fp); on a GPU with float16 or bfloat16 "
    "inputs and `implementation=None` it picks cuDNN's fused kernel where cuDNN takes the "
    "shapes, as torch picks flash attention",
  ),
  Registration(
    "jax.nn",
    "gelu",
    _method(PROMOTE),
    "`gelu` (in no list): torch's fused kernel returns its input's dtype; written out, "
    "`x ** 3` would be torch's float32 `pow`",
  ),
  Registration("flax.linen", "gelu", _method(PROMOTE), "`gelu`"),
  Registration("flax.nnx", "gelu", _method(PROMOTE), "`gelu`"),
  Registration(
    "equinox.nn",
    "LSTMCell.__call__",
    _method(LOWER),
    "`lstm_cell`: every input cast, the float32 carry too",
  ),
  Registration("equinox.nn", "GRUCell.__call__", _method(LOWER), "`gru_cell`"),
  Registration(
    "equinox.nn",
    "BatchNorm.__call__",
    _method(FLOAT32_COMPUTE, primary=1),
    "cuDNN's `batch_norm`: float32 statistics, the output in the input's dtype",
  ),
  Registration("flax.nnx", "LSTMCell.__call__", _nnx(LOWER, stats=False), "`lstm_cell`"),
  Registration("flax.nnx", "OptimizedLSTMCell.__call__", _nnx(LOWER, stats=False), "`lstm_cell`"),
  Registration("flax.nnx", "GRUCell.__call__", _nnx(LOWER, stats=False), "`gru_cell`"),
  Registration("flax.nnx", "SimpleCell.__call__", _nnx(LOWER, stats=False), "`rnn_tanh_cell`"),
  Registration(
    "flax.nnx",
    "BatchNorm.__call__",
    _nnx(FLOAT32_COMPUTE, stats=True),
    "`batch_norm`; the batch statistics are written back to the module",
  ),
  Registration("flax.linen", "LSTMCell.__call__", _linen(LOWER), "`lstm_cell`"),
  Registration("flax.linen", "OptimizedLSTMCell.__call__", _linen(LOWER), "`lstm_cell`"),
  Registration("flax.linen", "GRUCell.__call__", _linen(LOWER), "`gru_cell`"),
  Registration(
    "flax.linen", "MGUCell.__call__", _linen(LOWER), "`gru_cell` (the nearest torch cell)"
  ),
  Registration("flax.linen", "SimpleCell.__call__", _linen(LOWER), "`rnn_tanh_cell`"),
  Registration(
    "flax.linen",
    "BatchNorm.__call__",
    _linen(FLOAT32_COMPUTE),
    "`batch_norm`; the `batch_stats` collection is updated as `mutable=` asks",
  ),
)


def registrations() -> tuple[tuple[str, str, str, str], ...]:
  """``(module, attribute, rule, torch op)`` of each shipped registration (the guide's table)."""
  return tuple((r.module, r.path, r.make.rule, r.torch) for r in _REGISTRATIONS)  # type: ignore[attr-defined]


def _resolve(module: str, path: str) -> tuple[Any, str] | None:
  mod = sys.modules.get(module)
  if mod is None:
    return None
  owner: Any = mod
  *parents, attr = path.split(".")
  for p in parents:
    owner = getattr(owner, p, None)
    if owner is None:
      return None
  if not hasattr(owner, attr):
    return None
  return owner, attr


_ORIGINALS: dict[tuple[str, str], Any] = {}
_DEPTH = {"n": 0}
#: The installed registration of each registered function, by the original's id.
_BY_ORIGINAL: dict[int, tuple[Any, Any]] = {}


def registered(leaf: Any) -> Any:
  """``leaf``'s registration while autocast traces, if it is a registered function itself.

  An argument that holds ``jax.nn.gelu`` (``equinox.nn.MLP(activation=jax.nn.gelu)``
  keeps the function it was given) calls the registration, as a lookup of the module
  attribute does.
  """
  found = _BY_ORIGINAL.get(id(leaf))
  return found[1] if found is not None and found[0] is leaf else leaf


@contextlib.contextmanager
def tracing(dtype: Any) -> Iterator[None]:
  """While autocast traces its function: the context set and the registrations installed."""
  with _LOCK:
    _DEPTH["n"] += 1
    if _DEPTH["n"] == 1:
      for module, path, make, _ in _REGISTRATIONS:
        found = _resolve(module, path)
        if found is None:
          continue
        owner, attr = found
        original = (
          owner.__dict__.get(attr, getattr(owner, attr))
          if isinstance(owner, type)
          else getattr(owner, attr)
        )
        _ORIGINALS[(module, path)] = (owner, attr, original)
        wrapper = make(original)
        setattr(owner, attr, wrapper)
        if "." not in path:  # a function (a method is found through its class)
          _BY_ORIGINAL.setdefault(id(original), (original, wrapper))
  try:
    with marking(dtype):
      yield
  finally:
    with _LOCK:
      _DEPTH["n"] -= 1
      if _DEPTH["n"] == 0:
        for owner, attr, original in _ORIGINALS.values():
          setattr(owner, attr, original)
        _ORIGINALS.clear()
        _BY_ORIGINAL.clear()
