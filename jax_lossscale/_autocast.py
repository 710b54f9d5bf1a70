"""``autocast``: torch's CUDA autocast policy applied to any JAX function.

:func:`autocast` traces a function to a jaxpr and evaluates that jaxpr again, equation
by equation, inserting ``convert_element_type`` where the policy of
:mod:`jax_lossscale._autocast_policy` says an operation runs in float16 (or bfloat16)
or in float32. It recurses into the higher-order primitives (``jit``,
``custom_jvp_call``, ``custom_vjp_call``, ``remat``, ``scan``, ``while``, ``cond``,
``shard_map``) and rebuilds each with its public JAX constructor, so differentiation
rules, loop structure and sharding survive. All of this happens while tracing: under
``jax.jit`` the interpreter costs compile time, not step time.

The mixed-dtype rule (an elementwise primitive whose float operands disagree):

* Operands promote as torch's tensors do: the widest float dtype wins, except that a
  rank-0 array does not promote an array of rank >= 1 and a weakly typed value (a Python
  scalar) promotes nothing. ``x_f16 + r_f32`` (both full-size) is float32, as
  ``x + linear(h)`` is in torch.
* Bias exception: an ``add`` of a float32 function input (a parameter, possibly reshaped,
  broadcast or converted) of lower rank onto the output of a lower-precision primitive
  is part of that primitive and stays in the lower dtype, as torch's ``linear``,
  ``addmm`` and ``conv*`` include their bias. ``x @ w + b`` and ``flax.linen.Dense``
  return float16.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
import functools
from typing import Any
from typing import NamedTuple

import jax
from jax import lax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

from jax_lossscale._autocast_policy import DEFAULT_POLICY
from jax_lossscale._autocast_policy import FLOAT32
from jax_lossscale._autocast_policy import LOWER
from jax_lossscale._autocast_policy import PROMOTE
from jax_lossscale._autocast_policy import RULES
from jax_lossscale._typing import DTypeLike

__all__ = ("AutocastError", "autocast", "float32")

#: The name prefixes of the ``jit`` regions the interpreter leaves as they are.
_FLOAT32_MARK = "jls_float32"
_AUTOCAST_MARK = "jls_autocast"

#: Float dtypes autocast casts (torch: ``is_eligible`` excludes float64).
_ELIGIBLE = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32))

#: Primitives that only move or reshape data: a lower-precision result stays one, and a
#: function input stays a function input, through them.
_LAYOUT = frozenset(
  {
    "reshape",
    "broadcast_in_dim",
    "transpose",
    "squeeze",
    "expand_dims",
    "convert_element_type",
    "copy",
    "copy_p",
    "slice",
    "rev",
    "sharding_constraint",
  }
)

#: Variadic primitives whose operands are independent arrays: never promoted together.
_INDEPENDENT = frozenset(
  {
    "psum",
    "psum_invariant",
    "pmax",
    "pmin",
    "pmean",
    "ppermute",
    "pbroadcast",
    "pvary",
    "all_gather",
    "all_gather_invariant",
    "all_to_all",
    "psum_scatter",
    "reduce_scatter",
    "optimization_barrier",
    "device_put",
    "sort",
  }
)

#: First-order primitives whose behaviour is fixed by their declared operand dtypes (a
#: traced update computation, a host callback, a bit reinterpretation): their operands
#: are cast back to the dtypes the traced function declared.
_DECLARED = frozenset(
  {
    "scatter",
    "scatter_add",
    "scatter_mul",
    "scatter_min",
    "scatter_max",
    "scatter-add",
    "reduce",
    "reduce_window",
    "select_and_scatter",
    "select_and_scatter_add",
    "select_and_gather_add",
    "bitcast_convert_type",
    "pure_callback",
    "io_callback",
    "debug_callback",
    "reduce_precision",
  }
)

_JIT_NAMES = frozenset({"jit", "pjit"})
_REMAT_NAMES = frozenset({"remat", "remat2", "checkpoint"})


class AutocastError(TypeError):
  """A primitive :func:`autocast` cannot evaluate under its policy."""


def _unsupported(name: str) -> AutocastError:
  return AutocastError(
    f"autocast cannot interpret the higher-order primitive `{name}`: it does not know "
    "how to rebuild it with cast operands, and it does not fall back silently. Exclude "
    "the region that emits it by wrapping that function in `jax_lossscale.float32(fn)`: "
    "the region then runs exactly as written, on its inputs cast back to their declared "
    "dtypes."
  )


def _is_eligible(dtype) -> bool:
  try:
    return np.dtype(dtype) in _ELIGIBLE
  except TypeError:  # an extended dtype (PRNG keys)
    return False


def _cast(x, dtype):
  if np.dtype(x.dtype) == np.dtype(dtype):
    return x
  return lax.convert_element_type(x, dtype)


def _cast_floats(vals, dtype):
  return [_cast(v, dtype) if _is_eligible(v.dtype) else v for v in vals]


def _cast_to_declared(vals, avals):
  out = []
  for v, a in zip(vals, avals, strict=True):
    dt = getattr(a, "dtype", None)
    if dt is not None and hasattr(v, "dtype") and jnp.issubdtype(v.dtype, jnp.floating):
      v = _cast(v, dt)
    out.append(v)
  return out


def _dtype_of(x):
  return np.dtype(x.dtype)


def _promote(dtypes):
  """torch's type promotion of tensors of these dtypes, whatever JAX's promotion mode.

  For the floats autocast casts between it is JAX's standard lattice: float16 with
  bfloat16 is float32 in both, and the wider dtype wins otherwise.
  """
  with jax.numpy_dtype_promotion("standard"):
    return np.dtype(functools.reduce(jnp.promote_types, dtypes))


def _has_jaxpr_param(params) -> bool:
  for val in params.values():
    vals = val if isinstance(val, (tuple, list)) else (val,)
    for v in vals:
      if isinstance(v, (jex.Jaxpr, jex.ClosedJaxpr)):
        return True
  return False


def _member(v, container) -> bool:
  """``v in container`` for a jaxpr atom (Literals are not hashable)."""
  return isinstance(v, jex.Var) and v in container


def _is_unspecified(s) -> bool:
  return type(s).__name__ == "UnspecifiedValue"


class _Interpreter:
  """Evaluates jaxprs with the casts of one policy inserted."""

  def __init__(self, dtype, policy: Mapping[str, str]):
    self.dtype = np.dtype(dtype)
    self.policy = policy

  # -- the rule of one primitive ---------------------------------------------------

  def rule(self, eqn) -> str:
    name = eqn.primitive.name
    if name in self.policy:
      return self.policy[name]
    return PROMOTE

  # -- evaluation ------------------------------------------------------------------

  def eval_closed(self, closed, args):
    """Evaluates a ClosedJaxpr; returns (outputs, flags) with flags: lower-precision."""
    return self.eval_jaxpr(closed.jaxpr, closed.consts, args)

  def eval_jaxpr(self, jaxpr, consts, args):
    env: dict[Any, Any] = {}
    lowp: set[Any] = set()
    # A function input (or layout of one) maps to the rank of the input it came from.
    source_rank: dict[Any, int] = {}

    def read(v):
      if isinstance(v, jex.Literal):
        val = v.val
        if not hasattr(val, "dtype"):  # a Python scalar: give it its declared dtype
          val = np.asarray(val, dtype=v.aval.dtype)  # type: ignore[attr-defined]
        return val
      return env[v]

    def write(v, val):
      if isinstance(v, jex.Var) and type(v).__name__ != "DropVar":
        env[v] = val

    for v, val in zip(jaxpr.constvars, consts, strict=True):
      write(v, val)
      source_rank[v] = len(v.aval.shape)
    for v, val in zip(jaxpr.invars, args, strict=True):
      write(v, val)
      source_rank[v] = len(getattr(v.aval, "shape", ()))

    for eqn in jaxpr.eqns:
      invals = [read(v) for v in eqn.invars]
      outs, out_lowp = self.eval_eqn(eqn, invals, lowp, source_rank)
      if not eqn.primitive.multiple_results:
        outs = [outs]
        out_lowp = [out_lowp]
      for v, val, flag in zip(eqn.outvars, outs, out_lowp, strict=True):
        write(v, val)
        if flag and isinstance(v, jex.Var):
          lowp.add(v)
      name = eqn.primitive.name
      if name in _LAYOUT and eqn.invars and _member(eqn.invars[0], source_rank):
        for v in eqn.outvars:
          source_rank[v] = source_rank[eqn.invars[0]]

    outs = [read(v) for v in jaxpr.outvars]
    flags = [_member(v, lowp) for v in jaxpr.outvars]
    return outs, flags

  def eval_eqn(self, eqn, invals, lowp, source_rank):
    prim = eqn.primitive
    name = prim.name
    handler = _HANDLERS.get(name)
    if handler is None and name in _JIT_NAMES:
      handler = _eval_jit
    if handler is None and name in _REMAT_NAMES:
      handler = _eval_remat
    if handler is not None:
      try:
        return handler(self, eqn, invals)
      except KeyError as e:  # a jax version whose params this handler does not know
        raise _unsupported(f"{name}` (its parameter {e} is missing in this jax version") from e
    if name in _DECLARED:
      vals = _cast_to_declared(invals, [v.aval for v in eqn.invars])
      out = prim.bind(*vals, **eqn.params)
      return out, ([False] * len(out) if prim.multiple_results else False)
    if _has_jaxpr_param(eqn.params):
      raise _unsupported(name)
    return self.first_order(eqn, invals, lowp, source_rank)

  def first_order(self, eqn, invals, lowp, source_rank):
    prim = eqn.primitive
    name = prim.name
    params = dict(eqn.params)
    rule = self.rule(eqn)
    multiple = prim.multiple_results
    out_lowp = False
    if rule == LOWER:
      vals = _cast_floats(invals, self.dtype)
      pet = params.get("preferred_element_type")
      if pet is not None and _is_eligible(pet):
        params["preferred_element_type"] = self.dtype
      out_lowp = True
    elif rule == FLOAT32:
      vals = _cast_floats(invals, jnp.float32)
    elif name in _INDEPENDENT or len(invals) < 2:
      vals = list(invals)
      if name in _LAYOUT and eqn.invars and _member(eqn.invars[0], lowp):
        out_lowp = _dtype_of(invals[0]) == self.dtype
    else:
      # A bias added onto a lower-precision result runs in its dtype, but the sum is
      # no longer that op's output: torch's linear takes one bias, and a second
      # lower-rank tensor added to it (a positional table) promotes.
      vals = self.promote(eqn, invals, lowp, source_rank)
    out = prim.bind(*vals, **params)
    if multiple:
      return out, [out_lowp] * len(out)
    if out_lowp and _dtype_of(out) != self.dtype:
      out_lowp = False
    return out, out_lowp

  def promote(self, eqn, invals, lowp, source_rank):
    """Casts the float operands of an elementwise primitive to one dtype."""
    idx = [
      i
      for i, v in enumerate(invals)
      if hasattr(v, "dtype") and jnp.issubdtype(v.dtype, jnp.floating)
    ]
    if len(idx) < 2:
      return invals
    # Group by the declared dtype: operands that were traced with different dtypes are
    # allowed to differ by the primitive itself.
    groups: dict[Any, list[int]] = {}
    for i in idx:
      groups.setdefault(np.dtype(eqn.invars[i].aval.dtype), []).append(i)
    vals = list(invals)
    for members in groups.values():
      current = {_dtype_of(invals[i]) for i in members}
      if len(current) < 2:
        continue
      target = self._bias_target(eqn, invals, members, lowp, source_rank)
      if target is None:
        target = self._torch_promotion(eqn, invals, members)
      for i in members:
        vals[i] = _cast(vals[i], target)
    return vals

  def _bias_target(self, eqn, invals, members, lowp, source_rank):
    if eqn.primitive.name != "add" or len(members) != 2:
      return None
    a, b = members
    for lo, other in ((a, b), (b, a)):
      v_lo, v_other = eqn.invars[lo], eqn.invars[other]
      if not isinstance(v_lo, jex.Var) or v_lo not in lowp:
        continue
      if _dtype_of(invals[lo]) != self.dtype:
        continue
      if isinstance(v_other, jex.Var) and v_other in lowp:
        continue
      rank = source_rank.get(v_other) if isinstance(v_other, jex.Var) else None
      if rank is None or rank >= len(invals[lo].shape):
        continue
      return self.dtype
    return None

  @staticmethod
  def _torch_promotion(eqn, invals, members):
    # torch's categories: dimensioned tensors > zero-dim tensors > Python scalars.
    def category(i):
      var = eqn.invars[i]
      if getattr(var.aval, "weak_type", False):
        return 0
      if len(invals[i].shape) == 0:
        return 1
      return 2

    top = max(category(i) for i in members)
    return _promote([_dtype_of(invals[i]) for i in members if category(i) == top])


# -- higher-order primitives ------------------------------------------------------


def _no_flags(outs):
  return outs, [False] * len(outs)


def _eval_jit(interp: _Interpreter, eqn, invals):
  params = eqn.params
  name = str(params.get("name", ""))
  if _FLOAT32_MARK in name or _AUTOCAST_MARK in name:
    # A region left as written: its inputs go back to the declared dtypes.
    vals = _cast_to_declared(invals, [v.aval for v in eqn.invars])
    return _no_flags(eqn.primitive.bind(*vals, **params))
  closed = params["jaxpr"]
  captured: list[list[bool]] = []

  def body(*args):
    outs, flags = interp.eval_closed(closed, args)
    captured.append(flags)
    return tuple(outs)

  body.__name__ = name or "jit"
  # jax.jit's own defaults where a jax version's jit eqn lacks the parameter.
  kwargs: dict[str, Any] = {
    "inline": params.get("inline", False),
    "keep_unused": params.get("keep_unused", False),
  }
  ins = params.get("in_shardings", ())
  if ins and not all(_is_unspecified(s) for s in ins):
    kwargs["in_shardings"] = tuple(ins)
  outs_sh = params.get("out_shardings", ())
  if outs_sh and not all(_is_unspecified(s) for s in outs_sh):
    kwargs["out_shardings"] = tuple(outs_sh)
  outs = jax.jit(body, **kwargs)(*invals)
  # `body` is a new function, so jax.jit always traces it: `captured` is never empty.
  return list(outs), captured[-1]


def _eval_closed_call(interp: _Interpreter, eqn, invals):
  outs, flags = interp.eval_closed(eqn.params["call_jaxpr"], invals)
  return outs, flags


def _eval_remat(interp: _Interpreter, eqn, invals):
  params = eqn.params
  jaxpr = params["jaxpr"]

  def body(*args):
    return interp.eval_jaxpr(jaxpr, (), args)[0]

  fn = jax.checkpoint(
    body, prevent_cse=params.get("prevent_cse", True), policy=params.get("policy")
  )
  return _no_flags(list(fn(*invals)))


def _check_no_stale_tracers(consts, kind, rule):
  if any(isinstance(c, jax.core.Tracer) for c in consts):
    raise AutocastError(
      f"autocast cannot rebuild a {kind} whose {rule} closes over a traced intermediate "
      "value of the function (the rule is traced lazily, after that value's trace ended). "
      f"Pass the value to the {kind} function as an argument, or exclude the region by "
      "wrapping it in `jax_lossscale.float32(fn)`."
    )


def _eval_custom_jvp(interp: _Interpreter, eqn, invals):
  params = eqn.params
  closed = params["call_jaxpr"]
  num_consts = params["num_consts"]
  jvp_jaxpr_fun = params["jvp_jaxpr_fun"]
  consts, args = invals[:num_consts], invals[num_consts:]

  def primal(*xs):
    return tuple(interp.eval_closed(closed, [*consts, *xs])[0])

  fn = jax.custom_jvp(primal)

  def jvp(primals, tangents):
    outs = primal(*primals)
    jvp_jaxpr, jvp_consts, out_zeros = jvp_jaxpr_fun.call_wrapped(*[False] * len(primals))
    _check_no_stale_tracers(jvp_consts, "custom_jvp", "jvp rule")
    res, _ = interp.eval_jaxpr(jvp_jaxpr, jvp_consts, [*primals, *tangents])
    nz_tangents = iter(res[len(out_zeros) :])
    out_tangents: list[Any] = []
    for p, zero in zip(outs, out_zeros, strict=True):
      if zero and jnp.issubdtype(p.dtype, jnp.inexact):
        out_tangents.append(jnp.zeros(p.shape, p.dtype))
      elif zero:
        out_tangents.append(np.zeros(p.shape, jax.dtypes.float0))
      else:
        out_tangents.append(_cast(next(nz_tangents), p.dtype))
    return outs, tuple(out_tangents)

  fn.defjvp(jvp)
  return _no_flags(list(fn(*args)))


def _eval_custom_vjp(interp: _Interpreter, eqn, invals):
  params = eqn.params
  closed = params["call_jaxpr"]
  num_consts = params["num_consts"]
  fwd_thunk = params["fwd_jaxpr_thunk"]
  bwd = params["bwd"]
  out_trees = params["out_trees"]
  consts, args = invals[:num_consts], invals[num_consts:]
  declared_in = closed.in_avals[num_consts:]
  declared_out = closed.out_avals

  def primal(*xs):
    return tuple(interp.eval_closed(closed, [*consts, *xs])[0])

  fn = jax.custom_vjp(primal)
  arg_dtypes = [_dtype_of(a) for a in args]
  static: dict[str, Any] = {}

  def fwd(*xs):
    outs = primal(*xs)
    fwd_jaxpr, fwd_consts = fwd_thunk.call_wrapped(*[True] * len(xs))
    _check_no_stale_tracers(fwd_consts, "custom_vjp", "fwd rule")
    res_outs, _ = interp.eval_jaxpr(fwd_jaxpr, fwd_consts, list(xs))
    _, res_tree, input_fwds = out_trees()
    n_pruned = len(res_outs) - len(declared_out)
    pruned = iter(res_outs[:n_pruned])
    pruned_avals = iter(fwd_jaxpr.outvars[:n_pruned])
    res, res_avals = [], []
    for i in input_fwds:
      if i is None:
        res.append(next(pruned))
        res_avals.append(next(pruned_avals).aval)
      else:
        res.append(xs[i])
        res_avals.append(declared_in[i])
    assert len(res) == res_tree.num_leaves
    static["res_avals"] = tuple(res_avals)
    return outs, tuple(res)

  def bwd_rule(res, cts):
    res_avals = static["res_avals"]
    zero_flags: list[bool] = []

    def flat_bwd(*a):
      out = bwd.call_wrapped(*a)
      flat = []
      for o, av in zip(out, declared_in, strict=True):
        is_zero = not hasattr(o, "shape") or type(o).__name__ in ("Zero", "SymbolicZero")
        zero_flags.append(is_zero)
        flat.append(jnp.zeros(av.shape, av.dtype) if is_zero else o)
      return flat

    ct_avals = [a.to_tangent_aval() for a in declared_out]
    bwd_closed = jax.make_jaxpr(flat_bwd)(*_abstract(res_avals), *_abstract(ct_avals))
    cts_in, _ = interp.eval_closed(bwd_closed, [*res, *cts])
    out: list[Any] = []
    for ct, zero, dt in zip(cts_in, zero_flags, arg_dtypes, strict=True):
      if zero or not jnp.issubdtype(dt, jnp.inexact):
        out.append(None)
      else:
        out.append(_cast(ct, dt))
    return tuple(out)

  fn.defvjp(fwd, bwd_rule)
  return _no_flags(list(fn(*args)))


def _abstract(avals):
  out = []
  for a in avals:
    sharding = getattr(a, "sharding", None)
    try:
      out.append(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding))
    except (TypeError, ValueError):
      out.append(jax.ShapeDtypeStruct(a.shape, a.dtype))
  return out


def _eval_scan(interp: _Interpreter, eqn, invals):
  params = eqn.params
  closed = params["jaxpr"]
  nc, ncarry = params["num_consts"], params["num_carry"]
  consts, init, xs = invals[:nc], invals[nc : nc + ncarry], invals[nc + ncarry :]
  carry_avals = closed.in_avals[nc : nc + ncarry]
  init = _cast_to_declared(init, carry_avals)

  def body(carry, x):
    outs, _ = interp.eval_closed(closed, [*consts, *carry, *x])
    new_carry = _cast_to_declared(outs[:ncarry], carry_avals)
    return new_carry, outs[ncarry:]

  carry, ys = lax.scan(
    body,
    init,
    list(xs),
    length=params["length"],
    reverse=params["reverse"],
    unroll=params.get("unroll", 1),
  )
  return _no_flags([*carry, *ys])


def _eval_while(interp: _Interpreter, eqn, invals):
  params = eqn.params
  cond_closed, body_closed = params["cond_jaxpr"], params["body_jaxpr"]
  cn, bn = params["cond_nconsts"], params["body_nconsts"]
  cconsts, bconsts, init = invals[:cn], invals[cn : cn + bn], invals[cn + bn :]
  carry_avals = body_closed.in_avals[bn:]
  init = _cast_to_declared(init, carry_avals)

  def cond_fun(carry):
    return interp.eval_closed(cond_closed, [*cconsts, *carry])[0][0]

  def body_fun(carry):
    outs, _ = interp.eval_closed(body_closed, [*bconsts, *carry])
    return _cast_to_declared(outs, carry_avals)

  return _no_flags(list(lax.while_loop(cond_fun, body_fun, init)))


def _eval_cond(interp: _Interpreter, eqn, invals):
  branches = eqn.params["branches"]
  index, ops = invals[0], invals[1:]

  def make(branch):
    def run(*xs):
      return interp.eval_closed(branch, xs)[0]

    return run

  runs = [make(b) for b in branches]
  shapes = [jax.eval_shape(r, *ops) for r in runs]
  targets = [_promote([np.dtype(s[i].dtype) for s in shapes]) for i in range(len(shapes[0]))]

  def cast_branch(run):
    def out(*xs):
      return [_cast(y, t) for y, t in zip(run(*xs), targets, strict=True)]

    return out

  outs = lax.switch(index, [cast_branch(r) for r in runs], *ops)
  return _no_flags(list(outs))


def _eval_shard_map(interp: _Interpreter, eqn, invals):
  params = eqn.params
  jaxpr = params["jaxpr"]

  def body(*args):
    return tuple(interp.eval_jaxpr(jaxpr, (), args)[0])

  axis_names = params.get("newly_manual_axes", params.get("manual_axes", frozenset()))
  fn = jax.shard_map(
    body,
    mesh=params["mesh"],
    in_specs=tuple(params["in_specs"]),
    out_specs=tuple(params["out_specs"]),
    axis_names=frozenset(axis_names),
    check_vma=params.get("check_vma", params.get("check_rep", True)),
  )
  return _no_flags(list(fn(*invals)))


_HANDLERS: dict[str, Callable[..., Any]] = {
  "custom_jvp_call": _eval_custom_jvp,
  "custom_vjp_call": _eval_custom_vjp,
  "scan": _eval_scan,
  "while": _eval_while,
  "cond": _eval_cond,
  "shard_map": _eval_shard_map,
  "closed_call": _eval_closed_call,
  "core_call": _eval_closed_call,
}


# -- the public functions ---------------------------------------------------------


def _is_array(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _check_policy(policy) -> dict[str, str]:
  table = dict(DEFAULT_POLICY)
  if policy is None:
    return table
  if not isinstance(policy, Mapping):
    raise TypeError(
      f"policy must be a mapping from primitive (or its name) to one of {RULES}, "
      f"got {type(policy).__name__}"
    )
  for key, rule in policy.items():
    if isinstance(key, jex.Primitive):
      key = key.name
    if not isinstance(key, str):
      raise TypeError(
        f"policy keys must be lax primitives or their names, got {type(key).__name__}"
      )
    if rule not in RULES:
      raise ValueError(f"policy[{key!r}] must be one of {RULES}, got {rule!r}")
    table[key] = rule
  return table


def _check_dtype(dtype) -> np.dtype:
  try:
    dt = np.dtype(dtype)
  except TypeError as e:
    raise TypeError(f"dtype must be a float dtype, got {dtype!r}") from e
  if dt not in _ELIGIBLE:
    raise ValueError(f"dtype must be float16, bfloat16 or float32, got {dt}")
  return dt


def _jit_arrays(fun: Callable, name: str, cache: dict, args, kwargs):
  """Calls ``fun(*args, **kwargs)`` inside a ``jit`` named ``name``, over the arrays.

  Leaves that are not arrays are held static. The ``jit`` object is kept in ``cache``
  under the static part when that part is hashable, so a second eager call neither
  retraces nor recompiles.
  """
  leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
  dyn_idx = tuple(i for i, x in enumerate(leaves) if _is_array(x))
  template = [None if i in dyn_idx else x for i, x in enumerate(leaves)]
  try:
    key = (treedef, dyn_idx, tuple((type(x), x) for x in template))  # 1 is not True
    hash(key)
  except TypeError:
    key = None
  jitted = cache.get(key) if key is not None else None
  if jitted is None:

    def region(*dyn):
      full = list(template)
      for i, x in zip(dyn_idx, dyn, strict=True):
        full[i] = x
      a, k = jax.tree_util.tree_unflatten(treedef, full)
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

  It composes with ``jax.jit``, ``jax.grad``, ``jax.vmap`` and ``jax.shard_map``, and
  recurses into ``jit``, ``custom_jvp``, ``custom_vjp``, ``checkpoint``, ``scan``,
  ``while_loop``, ``cond`` and ``shard_map`` (custom differentiation rules are kept,
  and evaluated under the policy too; loop carries keep their declared dtypes).
  Arguments that are not arrays (Python scalars, callables, strings) are held static.

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
    AutocastError: at call time, for a higher-order primitive it cannot interpret.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from jax_lossscale._autocast import autocast
    >>> def dense(x, w, b):
    ...   return jax.nn.softmax(x @ w + b)
    >>> x, w, b = jnp.ones((2, 3)), jnp.ones((3, 4)), jnp.zeros((4,))
    >>> autocast(lambda x, w, b: x @ w + b)(x, w, b).dtype
    dtype('float16')
    >>> autocast(dense)(x, w, b).dtype
    dtype('float32')
  """
  if not callable(fun):
    raise TypeError(f"fun must be callable, got {type(fun).__name__}")
  dt = _check_dtype(dtype)
  table = _check_policy(policy)
  interp = _Interpreter(dt, table)
  mark = f"{_AUTOCAST_MARK}_{dt.name}"

  def run(*args, **kwargs):
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    dyn_idx = [i for i, x in enumerate(leaves) if _is_array(x)]

    def flat_fun(*dyn):
      full = list(leaves)
      for i, x in zip(dyn_idx, dyn, strict=True):
        full[i] = x
      a, k = jax.tree_util.tree_unflatten(treedef, full)
      return fun(*a, **k)

    dyn = [leaves[i] for i in dyn_idx]
    closed, out_shape = jax.make_jaxpr(flat_fun, return_shape=True)(*dyn)
    outs, _ = interp.eval_closed(closed, dyn)
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)

  cache: dict[Any, Any] = {}

  @functools.wraps(fun)
  def wrapped(*args, **kwargs):
    return _jit_arrays(run, mark, cache, args, kwargs)

  wrapped.autocast_spec = AutocastSpec(fun, dt, policy)  # type: ignore[attr-defined]
  return wrapped


def autocast_spec(fun: Any) -> AutocastSpec | None:
  """The :class:`AutocastSpec` of an :func:`autocast` function, or ``None`` for any other."""
  spec = getattr(fun, "autocast_spec", None)
  return spec if isinstance(spec, AutocastSpec) else None


def float32(fun: Callable) -> Callable:
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
    >>> from jax_lossscale._autocast import autocast, float32
    >>> def f(x, w):
    ...   return float32(lambda a, b: a @ b)(x, w), x @ w
    >>> kept, cast = autocast(f)(jnp.ones((2, 2)), jnp.ones((2, 2)))
    >>> kept.dtype, cast.dtype
    (dtype('float32'), dtype('float16'))
  """
  if not callable(fun):
    raise TypeError(f"fun must be callable, got {type(fun).__name__}")
  name = f"{_FLOAT32_MARK}_{getattr(fun, '__name__', 'region')}".replace("<", "").replace(">", "")

  cache: dict[Any, Any] = {}

  @functools.wraps(fun)
  def wrapped(*args, **kwargs):
    return _jit_arrays(fun, name, cache, args, kwargs)

  return wrapped
