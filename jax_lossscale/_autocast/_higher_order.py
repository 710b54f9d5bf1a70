"""The handlers of the higher-order primitives: each rebinds its primitive, interpreted.

Each handler is declared in the registry by :func:`~._primitives.higher_order` (its
primitive's kind, versions and flags) and receives the interpreter, the equation and its
input values. The sub-jaxprs are traced again through the interpreter and swapped into the
equation's parameters; every other parameter (shardings, donation, layouts,
``branches_platforms``, remat's policy, scan's unroll...) is carried as it was.
``custom_jvp`` and ``custom_vjp`` are rebuilt through their public constructors, since
JAX traces their rules lazily.

Each handler reads its equation's parameters through :func:`~._values.param` (or
``_scan_layout``), which knows each parameter's spellings across the JAX versions autocast
supports and raises ``UnsupportedPrimitiveError`` naming the JAX version and the parameter
for any other.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
import importlib
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

from jax_lossscale._autocast import _primitives as prims
from jax_lossscale._autocast._errors import ClosedOverTracerError
from jax_lossscale._autocast._errors import unsupported
from jax_lossscale._autocast._errors import where
from jax_lossscale._autocast._interpreter import Interpreter
from jax_lossscale._autocast._policy import is_eligible
from jax_lossscale._autocast._values import NO_FACTS
from jax_lossscale._autocast._values import Facts
from jax_lossscale._autocast._values import Val
from jax_lossscale._autocast._values import aval_of
from jax_lossscale._autocast._values import bind
from jax_lossscale._autocast._values import cast
from jax_lossscale._autocast._values import cast_to_declared
from jax_lossscale._autocast._values import hoist
from jax_lossscale._autocast._values import param
from jax_lossscale._autocast._values import torch_promote

__all__ = ("jit_region",)

#: ``jit`` regions that a module of autocast evaluates itself, by a mark in their name
#: (:func:`jit_region`): composite ops, ``float32`` regions, nested autocasts.
_REGIONS: dict[str, Callable[[Interpreter, Any, list[Val]], list[Val]]] = {}


def jit_region(
  mark: str,
) -> Callable[[Callable[[Interpreter, Any, list[Val]], list[Val]]], Any]:
  """Declares the decorated ``fn(interp, eqn, ins)`` the evaluation of every ``jit``
  whose name holds ``mark``, instead of interpreting its body."""

  def register(fn: Callable[[Interpreter, Any, list[Val]], list[Val]]) -> Any:
    if mark in _REGIONS:
      raise ValueError(f"the jit region mark {mark!r} is declared twice.")
    _REGIONS[mark] = fn
    return fn

  return register


def _scan_layout(eqn: Any) -> tuple[int, int]:
  """The number of consts and of carries of a ``scan`` equation.

  jax 0.9-0.10 give them as ``num_consts`` and ``num_carry``; from jax 0.11 the
  operands are described by ``ft_in``, a flat tree of three parts (consts, carry, xs).
  """
  if "num_consts" in eqn.params or "ft_in" not in eqn.params:
    return param(eqn, "num_consts"), param(eqn, "num_carry")
  consts, carry, _ = param(eqn, "ft_in").unpack()
  return len(consts), len(carry)


def _scan_with_leading_consts(eqn: Any, params: dict[str, Any], k: int) -> dict[str, Any]:
  """``params`` of a ``scan`` whose body takes ``k`` more leading consts."""
  if not k:
    return params
  if "num_consts" in params or "ft_in" not in params:
    new = dict(params, num_consts=param(eqn, "num_consts") + k)
    if "linear" in params:
      new["linear"] = (False,) * k + tuple(params["linear"])
    return new
  # jax >= 0.11: ft_in has no public constructor (and jax 0.10 has no such module).
  flattree: Any = importlib.import_module("jax._src.flattree")

  consts, carry, xs = param(eqn, "ft_in").unpack()
  consts = flattree.pack((flattree.nones(k), consts))
  return dict(params, ft_in=flattree.pack((consts, carry, xs)))


def _scan_with_trailing_xs(eqn: Any, params: dict[str, Any], m: int) -> dict[str, Any]:
  """``params`` of a ``scan`` whose body takes ``m`` more scanned inputs, last."""
  if not m:
    return params
  if "num_consts" in params or "ft_in" not in params:
    if "linear" in params:
      return dict(params, linear=(*params["linear"], *(False,) * m))
    return params
  flattree: Any = importlib.import_module("jax._src.flattree")

  consts, carry, xs = params["ft_in"].unpack()
  return dict(params, ft_in=flattree.pack((consts, carry, flattree.pack((xs, flattree.nones(m))))))


@prims.higher_order("jit")
def _eval_jit(interp: Interpreter, eqn: Any, ins: list[Val]) -> list[Val]:
  params = eqn.params
  name = str(params.get("name", ""))
  for mark, region in _REGIONS.items():
    if mark in name:
      return region(interp, eqn, ins)
  jaxpr = param(eqn, "jaxpr")
  closed, facts = interp.trace(
    lambda vs: interp.eval_closed(jaxpr, vs), [v.x for v in ins], [v.facts for v in ins]
  )
  closed, consts = hoist(closed)
  new = dict(params, jaxpr=closed)
  if consts:
    k = len(consts)
    in_shardings = param(eqn, "in_shardings")
    new["in_shardings"] = (*_unspecified(in_shardings, k), *in_shardings)
    if "in_layouts" in params:
      new["in_layouts"] = (None,) * k + tuple(params["in_layouts"])
    if "donated_invars" in params:
      new["donated_invars"] = (False,) * k + tuple(params["donated_invars"])
  outs = bind(eqn, [*consts, *(v.x for v in ins)], new)
  return [Val(o, f) for o, f in zip(outs, facts, strict=True)]


def _unspecified(shardings: Sequence[Any], k: int) -> tuple[Any, ...]:
  unspec = next((s for s in shardings if type(s).__name__ == "UnspecifiedValue"), None)
  if unspec is None:
    from jax._src.sharding_impls import UNSPECIFIED  # only for a jit with every input sharded

    unspec = UNSPECIFIED
  return (unspec,) * k


@prims.higher_order("closed_call", until=(0, 11, 0))
@prims.higher_order("eval_jaxpr")
def _eval_closed_call(interp: Interpreter, eqn: Any, ins: list[Val]) -> list[Val]:
  # closed_call (jax <= 0.10), and eval_jaxpr, which replaces it from jax 0.11 (jax 0.10's
  # eval_jaxpr, which spells it `jaxpr`, is staged out as a closed_call).
  return interp.eval_closed(param(eqn, "call_jaxpr", "jaxpr"), ins)


@prims.higher_order("call", until=(0, 11, 0))
def _eval_call(interp: Interpreter, eqn: Any, ins: list[Val]) -> list[Val]:
  return interp.eval_jaxpr(param(eqn, "call_jaxpr"), (), ins)


@prims.higher_order("remat2")
def _eval_remat(interp: Interpreter, eqn: Any, ins: list[Val]) -> list[Val]:
  params = eqn.params
  jaxpr = param(eqn, "jaxpr")
  closed, facts = interp.trace(
    lambda vs: interp.eval_jaxpr(jaxpr, (), vs),
    [v.x for v in ins],
    [v.facts for v in ins],
  )
  closed, consts = hoist(closed)
  outs = bind(eqn, [*consts, *(v.x for v in ins)], dict(params, jaxpr=closed.jaxpr))
  return [Val(o, f) for o, f in zip(outs, facts, strict=True)]


def _users_cross(interp: Interpreter, outer: Sequence[Val], inner: Sequence[Val]) -> None:
  """A user's tap passed into a body (a scan's rows of it) is a user's tap there too."""
  taps = interp.taps
  if taps is None:
    return
  for o, i in zip(outer, inner, strict=True):
    if taps.is_user(o.x):
      taps.mark_user(i.x)


def _carry_facts(n: int) -> list[Facts]:
  return [NO_FACTS] * n


@prims.higher_order("scan")
def _eval_scan(interp: Interpreter, eqn: Any, ins: list[Val]) -> list[Val]:
  params = eqn.params
  closed = param(eqn, "jaxpr")
  nc, ncarry = _scan_layout(eqn)
  consts, init, xs = ins[:nc], ins[nc : nc + ncarry], ins[nc + ncarry :]
  carry_avals = closed.in_avals[nc : nc + ncarry]
  init_x = cast_to_declared([v.x for v in init], carry_avals)
  length = param(eqn, "length")
  x_avals = [jex.mapped_aval(length, 0, aval_of(v.x)) for v in xs]
  x_facts = [
    v.facts._replace(input_rank=None if v.facts.input_rank is None else v.facts.input_rank - 1)
    for v in xs
  ]
  # check_underflow's taps of the outputs inside: stacked, one row per iteration, scanned.
  taps = interp.loop_taps()
  threaded = [] if taps is None else taps.loop(length)
  tap_avals = [jex.mapped_aval(length, 0, aval_of(v)) for _, v in threaded]
  n_in = len(ins)

  def body(vs: list[Val]) -> list[Val]:
    if taps is not None:
      taps.iteration({name: v.x for (name, _), v in zip(threaded, vs[n_in:], strict=True)})
    _users_cross(interp, ins, vs[:n_in])
    outs = interp.eval_closed(closed, vs[:n_in])
    carry = cast_to_declared([o.x for o in outs[:ncarry]], carry_avals)
    return [*(Val(c) for c in carry), *outs[ncarry:]]

  try:
    new_closed, facts = interp.trace(
      body,
      [*(v.x for v in consts), *init_x, *x_avals, *tap_avals],
      [*(v.facts for v in consts), *_carry_facts(ncarry), *x_facts, *_carry_facts(len(threaded))],
    )
  finally:
    if taps is not None:
      taps.end_loop()
  new_closed, hoisted = hoist(new_closed)
  new = _scan_with_trailing_xs(
    eqn, _scan_with_leading_consts(eqn, dict(params), len(hoisted)), len(threaded)
  )
  vals = [*hoisted, *(v.x for v in consts), *init_x, *(v.x for v in xs), *(v for _, v in threaded)]
  outs = bind(eqn, vals, dict(new, jaxpr=new_closed))
  return [
    Val(o, NO_FACTS if i < ncarry else f) for i, (o, f) in enumerate(zip(outs, facts, strict=True))
  ]


@prims.higher_order("while", untapped=True)
def _eval_while(interp: Interpreter, eqn: Any, ins: list[Val]) -> list[Val]:
  params = eqn.params
  cond_closed, body_closed = param(eqn, "cond_jaxpr"), param(eqn, "body_jaxpr")
  cn, bn = param(eqn, "cond_nconsts"), param(eqn, "body_nconsts")
  cconsts, bconsts, init = ins[:cn], ins[cn : cn + bn], ins[cn + bn :]
  carry_avals = body_closed.in_avals[bn:]
  init_x = cast_to_declared([v.x for v in init], carry_avals)

  new_cond, _ = interp.trace(
    lambda vs: interp.eval_closed(cond_closed, vs),
    [*(v.x for v in cconsts), *init_x],
    [*(v.facts for v in cconsts), *_carry_facts(len(init))],
  )

  def body(vs: list[Val]) -> list[Val]:
    outs = interp.eval_closed(body_closed, vs)
    return [Val(c) for c in cast_to_declared([o.x for o in outs], carry_avals)]

  new_body, _ = interp.trace(
    body,
    [*(v.x for v in bconsts), *init_x],
    [*(v.facts for v in bconsts), *_carry_facts(len(init))],
  )
  new_cond, ch = hoist(new_cond)
  new_body, bh = hoist(new_body)
  new = dict(
    params,
    cond_jaxpr=new_cond,
    body_jaxpr=new_body,
    cond_nconsts=cn + len(ch),
    body_nconsts=bn + len(bh),
  )
  vals = [*ch, *(v.x for v in cconsts), *bh, *(v.x for v in bconsts), *init_x]
  return [Val(o) for o in bind(eqn, vals, new)]


@prims.higher_order("cond", untapped=True)
def _eval_cond(interp: Interpreter, eqn: Any, ins: list[Val]) -> list[Val]:
  params = eqn.params
  branches = param(eqn, "branches")
  index, ops = ins[0], ins[1:]
  op_x, op_facts = [v.x for v in ops], [v.facts for v in ops]

  def branch_fn(b: Any) -> Callable[[list[Val]], list[Val]]:
    def run(vs: list[Val]) -> list[Val]:
      _users_cross(interp, ops, vs)
      return interp.eval_closed(b, vs)

    return run

  # Each branch is interpreted once (check_underflow counts its ops once); the casts to
  # the outputs' common dtypes are added to the traced branch afterwards.
  traced = [interp.trace(branch_fn(b), op_x, op_facts) for b in branches]
  n_out = len(traced[0][0].out_avals)
  targets = [_common_float([c.out_avals[i].dtype for c, _ in traced]) for i in range(n_out)]
  cast_branches = [_cast_outputs(c, targets, op_x) for c, _ in traced]
  closed_branches, consts = _common_consts(cast_branches, op_x)
  facts = [
    Facts(lowp=all(f[i].lowp for _, f in traced) and targets[i] == interp.dtype)
    for i in range(n_out)
  ]
  outs = bind(eqn, [index.x, *consts, *op_x], dict(params, branches=tuple(closed_branches)))
  return [Val(o, f) for o, f in zip(outs, facts, strict=True)]


def _common_float(dtypes: Sequence[Any]) -> np.dtype | None:
  """The dtype a float output takes from its dtypes in the branches; ``None`` for any other
  output (an integer, a PRNG key), which every branch gives in its declared dtype."""
  if not all(is_eligible(d) for d in dtypes):
    return None
  return torch_promote([np.dtype(d) for d in dtypes])


def _cast_outputs(closed: Any, targets: Sequence[Any], args: Sequence[Any]) -> Any:
  """``closed`` with its float outputs cast to ``targets``, traced again as it is (not
  through the interpreter, so no op of it is counted twice)."""
  if all(
    t is None or np.dtype(a.dtype) == t for a, t in zip(closed.out_avals, targets, strict=True)
  ):
    return closed
  fn = jex.jaxpr_as_fun(closed)

  def run(*xs: Any) -> list[Any]:
    return [o if t is None else cast(o, t) for o, t in zip(fn(*xs), targets, strict=True)]

  return jax.make_jaxpr(run)(*args)


def _common_consts(closed: Sequence[Any], args: Sequence[Any]) -> tuple[list[Any], list[Any]]:
  """Branches without consts: every branch's consts become shared leading inputs."""
  hoisted = [hoist(c) for c in closed]
  consts = [c for _, cs in hoisted for c in cs]
  if not consts:
    return [c for c, _ in hoisted], []
  out = []
  start = 0
  for jaxpr, cs in hoisted:
    lo, hi = start, start + len(cs)
    start = hi
    fn = jex.jaxpr_as_fun(jaxpr)

    def branch(*xs: Any, lo: int = lo, hi: int = hi, fn: Any = fn) -> Any:
      return fn(*xs[lo:hi], *xs[len(consts) :])

    out.append(jax.make_jaxpr(branch)(*consts, *args))
  return out, consts


@prims.higher_order("shard_map", untapped=True)
def _eval_shard_map(interp: Interpreter, eqn: Any, ins: list[Val]) -> list[Val]:
  # The body is traced through the public constructor (it sets up the manual axes), and
  # the sub-jaxpr it traced is swapped into this equation's own parameters.
  params = eqn.params
  jaxpr = param(eqn, "jaxpr")
  captured: list[list[Facts]] = []
  facts_in = [v.facts for v in ins]

  def body(*xs: Any) -> tuple[Any, ...]:
    outs = interp.eval_jaxpr(jaxpr, (), [Val(x, f) for x, f in zip(xs, facts_in, strict=True)])
    captured.append([o.facts for o in outs])
    return tuple(o.x for o in outs)

  axis_names = params.get("newly_manual_axes", params.get("manual_axes", frozenset()))
  fn = jax.shard_map(
    body,
    mesh=param(eqn, "mesh"),
    in_specs=tuple(param(eqn, "in_specs")),
    out_specs=tuple(param(eqn, "out_specs")),
    axis_names=frozenset(axis_names),
    check_vma=params.get("check_vma", params.get("check_rep", True)),
  )
  outer = jax.make_jaxpr(fn)(*(v.x for v in ins))
  traced = [e for e in outer.jaxpr.eqns if e.primitive is eqn.primitive]
  if len(outer.jaxpr.eqns) != 1 or len(traced) != 1 or outer.consts:
    # The constructor's own equations, as traced (not traced again: its ops are counted once).
    outs = jex.jaxpr_as_fun(outer)(*(v.x for v in ins))
  else:
    outs = bind(eqn, [v.x for v in ins], dict(params, jaxpr=traced[0].params["jaxpr"]))
  return [Val(o, f) for o, f in zip(outs, captured[-1], strict=True)]


def _check_no_stale_tracers(eqn: Any, consts: Sequence[Any], kind: str, rule: str) -> None:
  if any(isinstance(c, jax.core.Tracer) for c in consts):
    raise ClosedOverTracerError(
      f"autocast cannot rebuild a {kind}{where(eqn)} whose {rule} closes over a traced "
      "intermediate value of the function (the rule is traced lazily, after that value's "
      f"trace ended). Pass the value to the {kind} function as an argument, or exclude the "
      "region by wrapping it in `jax_lossscale.float32(fn)`."
    )


def _primal(
  interp: Interpreter, closed: Any, consts: Sequence[Val], args: Sequence[Val]
) -> tuple[Callable[..., tuple[Any, ...]], list[list[Facts]]]:
  """A custom rule's primal over arrays, evaluated by ``interp``; its outputs' facts are
  appended to the list returned with it (the arguments keep their own facts)."""
  arg_facts = [v.facts for v in args]
  captured: list[list[Facts]] = []

  def primal(*xs: Any) -> tuple[Any, ...]:
    outs = interp.eval_closed(
      closed, [*consts, *(Val(x, f) for x, f in zip(xs, arg_facts, strict=True))]
    )
    captured.append([o.facts for o in outs])
    return tuple(o.x for o in outs)

  return primal, captured


@prims.higher_order("custom_jvp_call", untapped=True)
def _eval_custom_jvp(interp: Interpreter, eqn: Any, ins: list[Val]) -> list[Val]:
  # Rebuilt through the public constructor: the jvp rule is a thunk JAX traces lazily.
  closed = param(eqn, "call_jaxpr")
  num_consts = param(eqn, "num_consts")
  jvp_jaxpr_fun = param(eqn, "jvp_jaxpr_fun")
  consts, args = ins[:num_consts], ins[num_consts:]
  primal, captured = _primal(interp, closed, consts, args)
  fn = jax.custom_jvp(primal)

  def jvp(primals: Any, tangents: Any) -> Any:
    outs = primal(*primals)
    jvp_jaxpr, jvp_consts, out_zeros = jvp_jaxpr_fun.call_wrapped(*[False] * len(primals))
    _check_no_stale_tracers(eqn, jvp_consts, "custom_jvp", "jvp rule")
    res = interp.eval_jaxpr(jvp_jaxpr, jvp_consts, [Val(x) for x in (*primals, *tangents)])
    nz_tangents = iter(res[len(out_zeros) :])
    out_tangents: list[Any] = []
    for p, zero in zip(outs, out_zeros, strict=True):
      if zero and jnp.issubdtype(p.dtype, jnp.inexact):
        out_tangents.append(jnp.zeros(p.shape, p.dtype))
      elif zero:
        out_tangents.append(np.zeros(p.shape, jax.dtypes.float0))
      else:
        out_tangents.append(cast(next(nz_tangents).x, p.dtype))
    return outs, tuple(out_tangents)

  fn.defjvp(jvp)
  outs = fn(*(v.x for v in args))
  return [Val(o, f) for o, f in zip(outs, captured[0], strict=True)]


@prims.higher_order("custom_vjp_call", untapped=True)
def _eval_custom_vjp(interp: Interpreter, eqn: Any, ins: list[Val]) -> list[Val]:
  # Rebuilt through the public constructor: fwd and bwd are traced lazily by JAX.
  closed = param(eqn, "call_jaxpr")
  num_consts = param(eqn, "num_consts")
  fwd_thunk = param(eqn, "fwd_jaxpr_thunk")
  bwd = param(eqn, "bwd")
  out_trees = param(eqn, "out_trees")
  consts, args = ins[:num_consts], ins[num_consts:]
  declared_in = closed.in_avals[num_consts:]
  declared_out = closed.out_avals
  primal, captured = _primal(interp, closed, consts, args)
  fn = jax.custom_vjp(primal)
  arg_dtypes = [np.dtype(v.x.dtype) for v in args]
  static: dict[str, Any] = {}

  def fwd(*xs: Any) -> Any:
    outs = primal(*xs)
    fwd_jaxpr, fwd_consts = fwd_thunk.call_wrapped(*[True] * len(xs))
    _check_no_stale_tracers(eqn, fwd_consts, "custom_vjp", "fwd rule")
    res_outs = [v.x for v in interp.eval_jaxpr(fwd_jaxpr, fwd_consts, [Val(x) for x in xs])]
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

  def bwd_rule(res: Any, cts: Any) -> Any:
    res_avals = static["res_avals"]
    zero_flags: list[bool] = []

    def flat_bwd(*a: Any) -> list[Any]:
      out = bwd.call_wrapped(*a)
      if _BWD_RETURNS_LOGS:  # jax >= 0.11: (cotangents, backward-pass logs)
        out, logs = out
        if logs is not None:
          raise unsupported(
            "custom_vjp_call",
            eqn,
            f" (its backward rule returns logs, `custom_vjp.defvjp_with_logs` of jax"
            f" {jax.__version__}, which autocast does not carry)",
          )
      flat = []
      for o, av in zip(out, declared_in, strict=True):
        is_zero = not hasattr(o, "shape") or type(o).__name__ in ("Zero", "SymbolicZero")
        zero_flags.append(is_zero)
        flat.append(jnp.zeros(av.shape, av.dtype) if is_zero else o)
      return flat

    ct_avals = [a.to_tangent_aval() for a in declared_out]
    bwd_closed = jax.make_jaxpr(flat_bwd)(*_abstract(res_avals), *_abstract(ct_avals))
    cts_in = interp.eval_closed(bwd_closed, [Val(x) for x in (*res, *cts)])
    out: list[Any] = []
    for ct, zero, dt in zip(cts_in, zero_flags, arg_dtypes, strict=True):
      if zero or not jnp.issubdtype(dt, jnp.inexact):
        out.append(None)
      else:
        out.append(cast(ct.x, dt))
    return tuple(out)

  fn.defvjp(fwd, bwd_rule)
  outs = fn(*(v.x for v in args))
  return [Val(o, f) for o, f in zip(outs, captured[0], strict=True)]


#: Whether a custom_vjp's ``bwd`` parameter returns ``(cotangents, logs)`` (jax >= 0.11,
#: which has ``custom_vjp.defvjp_with_logs``) rather than the cotangents alone.
_BWD_RETURNS_LOGS = hasattr(jax.custom_vjp, "defvjp_with_logs")


def _abstract(avals: Sequence[Any]) -> list[Any]:
  out = []
  for a in avals:
    sharding = getattr(a, "sharding", None)
    try:
      out.append(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding))
    except (TypeError, ValueError):
      out.append(jax.ShapeDtypeStruct(a.shape, a.dtype))
  return out
