"""``autocast`` and ``float32``: the public functions over the interpreter."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
import functools
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_lossscale._autocast import _registrations
from jax_lossscale._autocast._arguments import rebuild
from jax_lossscale._autocast._arguments import split
from jax_lossscale._autocast._interpreter import Interpreter
from jax_lossscale._autocast._policy import check_policy
from jax_lossscale._autocast._rules._as_written import as_written
from jax_lossscale._autocast._rules._calls import jit_region
from jax_lossscale._autocast._rules._registry import Interp
from jax_lossscale._autocast._values import ELIGIBLE
from jax_lossscale._autocast._values import Facts
from jax_lossscale._autocast._values import TapSink
from jax_lossscale._autocast._values import Val
from jax_lossscale._typing import DTypeLike

__all__ = ("AutocastSpec", "autocast", "autocast_spec", "float32", "interpret")


#: The name prefixes of the ``jit`` regions the interpreter runs as written: a
#: ``float32(fn)`` region, and a nested ``autocast`` function (it casts on its own).
FLOAT32_MARK = "jls_float32"
AUTOCAST_MARK = "jls_autocast"


@jit_region(FLOAT32_MARK)
@jit_region(AUTOCAST_MARK)
def _as_written_region(interp: Interp, eqn: Any, ins: list[Val]) -> list[Val]:
  """A `float32(fn)` region or a nested `autocast`: bound as written, inputs cast back to
  their declared dtypes (a nested `autocast`'s own policy wins, as the innermost torch
  context does)."""
  return as_written(interp, eqn, ins)


def _check_dtype(dtype: Any) -> np.dtype[Any]:
  try:
    dt: np.dtype[Any] = np.dtype(dtype)
  except TypeError as e:
    raise TypeError(f"dtype must be a float dtype, got {dtype!r}.") from e
  if dt not in ELIGIBLE:
    raise ValueError(f"dtype must be float16, bfloat16 or float32, got {dt}.")
  return dt


def _jit_arrays(
  fun: Callable[..., Any], name: str, cache: dict[Any, Any], args: Any, kwargs: Any
) -> Any:
  """Calls ``fun(*args, **kwargs)`` inside a ``jit`` named ``name``, over the arrays.

  Leaves that are not arrays are held static. The ``jit`` object is kept in ``cache``
  under the static part when that part is hashable, so a second eager call neither
  retraces nor recompiles.
  """
  leaves, treedef, dyn_idx = split(args, kwargs)
  template = [None if i in dyn_idx else x for i, x in enumerate(leaves)]
  try:
    key = (treedef, dyn_idx, tuple((type(x), x) for x in template))  # 1 is not True
    hash(key)
  except TypeError:
    key = None
  jitted = cache.get(key) if key is not None else None
  if jitted is None:

    def region(*dyn: Any) -> Any:
      a, k = rebuild(treedef, template, dyn_idx, dyn)
      return fun(*a, **k)

    region.__name__ = name
    region.__qualname__ = name
    jitted = jax.jit(region)
    if key is not None:
      if len(cache) >= 64:
        cache.pop(next(iter(cache)))
      cache[key] = jitted
  return jitted(*[leaves[i] for i in dyn_idx])


class AutocastSpec(NamedTuple):
  """What an :func:`autocast` function was built from (its ``autocast_spec`` attribute).

  Attributes:
    fun: the function as written (the float32 model).
    dtype: the lower-precision dtype.
    policy: the overrides given, or ``None``.
  """

  fun: Callable[..., Any]
  dtype: np.dtype
  policy: Mapping[Any, str] | None


def autocast(
  fun: Callable[..., Any],
  dtype: DTypeLike = jnp.float16,
  policy: Mapping[Any, str] | None = None,
) -> Callable[..., Any]:
  """Runs ``fun`` under torch's CUDA autocast policy, mapped to lax primitives.

  The returned function takes ``fun``'s arguments. It traces ``fun`` to a jaxpr and
  evaluates it again with casts inserted: contractions and convolutions run in
  ``dtype``; exp, log, pow, rsqrt, the sums and the other float32-list primitives run
  in float32; everything else runs in the dtypes of its operands (promoting as torch
  does, with a bias added onto a matmul kept in the matmul's dtype). Integer and bool
  arrays are never cast; float32 arrays are cast only where a lower-precision
  primitive consumes them, so gradients come back in each input's own dtype.

  It composes with ``jax.jit``, ``jax.grad``, ``jax.vmap`` and ``jax.shard_map``. The
  higher-order primitives inside (``jit``, ``checkpoint``, ``scan``, ``while_loop``,
  ``cond``, ``shard_map``, ``custom_jvp``, ``custom_vjp``) are interpreted and rebound
  with all their parameters; loop carries keep their declared dtypes. Constants and
  masks (``zeros_like``, ``jnp.where(mask, h, 0.0)``, ``h * (x > 0)``) take the dtype of
  the activation they meet. Opaque primitives (custom calls, Pallas kernels, callbacks)
  run as written. Functions marked with :func:`jax_lossscale.autocast_op`, and the
  registrations it ships (``jax.nn.dot_product_attention``, the RNN cells and batch
  norms of Flax and Equinox), run as one op with their own rule. Arguments that are not
  arrays (Python scalars, callables, strings) are held static.

  Args:
    fun: the function to run.
    dtype: the lower-precision dtype: ``jnp.float16`` (default) or ``jnp.bfloat16``;
      ``jnp.float32`` evaluates the same jaxpr with no cast that changes a float32 model.
    policy: optional overrides, a mapping from a lax primitive (or its name, e.g.
      ``"exp"``) to ``"lower"``, ``"float32"`` or ``"promote"``.

  Returns:
    A function with ``fun``'s arguments that returns ``fun``'s outputs, computed under
    the policy (a float16 matmul returns float16, a float32 loss float32). Its
    ``autocast_spec`` attribute records ``(fun, dtype, policy)``, so tools such as
    :func:`jax_lossscale.diagnostics.check_underflow` can run the same model in float32
    or in another half dtype.

  Raises:
    TypeError: ``fun`` is not callable, or ``policy`` is not a mapping.
    ValueError: ``dtype`` is not float16, bfloat16 or float32, or a rule is unknown.
    ValueError: a policy key names no primitive of this JAX (the message gives the
      nearest names), or a layout or higher-order primitive is given a rule.
    UnsupportedPrimitiveError: at call time, for a higher-order primitive autocast has
      no kind for (a subclass of :class:`AutocastError`).

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from jax_lossscale import autocast
    >>> def dense(x, w, b):
    ...   return jax.nn.softmax(x @ w + b)
    >>> x, w, b = jnp.ones((2, 3)), jnp.ones((3, 4)), jnp.zeros((4,))
    >>> autocast(lambda x, w, b: x @ w + b)(x, w, b).dtype
    dtype('float16')
    >>> autocast(dense)(x, w, b).dtype
    dtype('float32')
  """
  if not callable(fun):
    raise TypeError(f"fun must be callable, got {type(fun).__name__}.")
  dt = _check_dtype(dtype)
  table = check_policy(policy)
  interp = Interpreter(dt, table)
  mark = f"{AUTOCAST_MARK}_{dt.name}"

  def run(*args: Any, **kwargs: Any) -> Any:
    return _interpret(interp, fun, args, kwargs)

  cache: dict[Any, Any] = {}

  @functools.wraps(fun)
  def wrapped(*args: Any, **kwargs: Any) -> Any:
    return _jit_arrays(run, mark, cache, args, kwargs)

  wrapped.autocast_spec = AutocastSpec(fun, dt, policy)  # type: ignore[attr-defined]
  return wrapped


def _interpret(
  interp: Interpreter,
  fun: Callable[..., Any],
  args: Any,
  kwargs: Any,
  follows: Callable[[tuple[Any, ...]], bool] | None = None,
) -> Any:
  """``fun(*args, **kwargs)`` traced, then evaluated by ``interp`` in the current trace.

  ``follows(path)`` marks the input leaves (by their path in ``(args, kwargs)``) that take
  the dtype of the activations they meet, as constants do (check_underflow's taps).
  """
  leaves, treedef, dyn_idx = split(args, kwargs)
  paths = [p for p, _ in jax.tree_util.tree_flatten_with_path((args, kwargs))[0]]
  dyn_set = set(dyn_idx)

  def flat_fun(*dyn: Any) -> Any:
    # A registered function held by an argument (an activation stored in a module)
    # calls its registration.
    static = [x if i in dyn_set else _registrations.registered(x) for i, x in enumerate(leaves)]
    a, k = rebuild(treedef, static, dyn_idx, dyn)
    return fun(*a, **k)

  dyn = [leaves[i] for i in dyn_idx]
  with _registrations.tracing(interp.dtype):
    closed, out_shape = jax.make_jaxpr(flat_fun, return_shape=True)(*dyn)

  def facts(i: int) -> Facts:
    if follows is not None and follows(paths[i]):
      return Facts(follows=True)
    return Facts(input_rank=np.ndim(leaves[i]))

  args_in = [Val(leaves[i], facts(i)) for i in dyn_idx]
  if interp.taps is not None:  # the user's taps: an output they are added to is tapped
    for v in args_in:
      if v.facts.follows:
        interp.taps.mark_user(v.x)
  outs = [v.x for v in interp.eval_closed(closed, args_in)]
  return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)


def interpret(
  spec: AutocastSpec,
  dtype: Any,
  args: Any,
  *,
  taps: TapSink | None = None,
  follows: Callable[[tuple[Any, ...]], bool] | None = None,
  as_written: bool = False,
) -> Any:
  """``spec.fun(*args)`` under ``spec``'s policy in ``dtype``, with ``taps`` added.

  ``as_written``: the function itself, every primitive on its declared dtypes (only the
  taps are added, at the outputs of the primitives the policy runs in lower precision).
  """
  interp = Interpreter(
    _check_dtype(dtype), check_policy(spec.policy), taps=taps, as_written=as_written
  )
  return _interpret(interp, spec.fun, tuple(args), {}, follows)


def autocast_spec(fun: Any) -> AutocastSpec | None:
  """The :class:`AutocastSpec` of an :func:`autocast` function, or ``None`` for any other."""
  spec = getattr(fun, "autocast_spec", None)
  return spec if isinstance(spec, AutocastSpec) else None


def float32(fun: Callable[..., Any]) -> Callable[..., Any]:
  """Marks ``fun`` as a region :func:`autocast` leaves in float32, as written.

  The equivalent of torch's nested ``autocast(enabled=False)`` or
  ``custom_fwd(cast_inputs=torch.float32)``: inside an autocast function, the region's
  float inputs are cast back to the dtypes ``fun`` was traced with (float32 for a
  float32 model) and its primitives run unchanged. Outside autocast it is ``fun``
  (under a ``jax.jit`` named for the marker, which survives inside ``jit``, ``scan``
  and the other higher-order primitives).

  Args:
    fun: the function to keep in float32.

  Returns:
    A function with ``fun``'s arguments and outputs.

  Raises:
    TypeError: ``fun`` is not callable.

  Examples:
    >>> import jax.numpy as jnp
    >>> from jax_lossscale import autocast, float32
    >>> def f(x, w):
    ...   return float32(lambda a, b: a @ b)(x, w), x @ w
    >>> kept, cast = autocast(f)(jnp.ones((2, 2)), jnp.ones((2, 2)))
    >>> kept.dtype, cast.dtype
    (dtype('float32'), dtype('float16'))
  """
  if not callable(fun):
    raise TypeError(f"fun must be callable, got {type(fun).__name__}.")
  name = f"{FLOAT32_MARK}_{getattr(fun, '__name__', 'region')}".replace("<", "").replace(">", "")

  cache: dict[Any, Any] = {}

  @functools.wraps(fun)
  def wrapped(*args: Any, **kwargs: Any) -> Any:
    return _jit_arrays(fun, name, cache, args, kwargs)

  return wrapped
