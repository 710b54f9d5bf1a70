"""The custom differentiation rules: ``custom_jvp`` and ``custom_vjp``.

Each is rebuilt through its public constructor, since JAX traces its rules lazily: the
primal, and the jvp rule or the forward and backward rules, are interpreted under the
policy, and each tangent or gradient comes back in the dtype of its primal or input, as
torch casts the gradient of an input to the input's dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_lossscale._autocast._errors import ClosedOverTracerError
from jax_lossscale._autocast._errors import unsupported
from jax_lossscale._autocast._errors import where
from jax_lossscale._autocast._rules._registry import HIGHER_ORDER
from jax_lossscale._autocast._rules._registry import Interp
from jax_lossscale._autocast._rules._registry import register
from jax_lossscale._autocast._values import Facts
from jax_lossscale._autocast._values import Val
from jax_lossscale._autocast._values import cast
from jax_lossscale._autocast._values import param

__all__ = ("custom_jvp", "custom_vjp")


def _check_no_stale_tracers(eqn: Any, consts: Sequence[Any], kind: str, rule: str) -> None:
  if any(isinstance(c, jax.core.Tracer) for c in consts):
    raise ClosedOverTracerError(
      f"autocast cannot rebuild a {kind}{where(eqn)} whose {rule} closes over a traced "
      "intermediate value of the function (the rule is traced lazily, after that value's "
      f"trace ended). Pass the value to the {kind} function as an argument, or exclude the "
      "region by wrapping it in `jax_lossscale.float32(fn)`."
    )


def _primal(
  interp: Interp, closed: Any, consts: Sequence[Val], args: Sequence[Val]
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


@register(HIGHER_ORDER, "custom_jvp_call", untapped=True)
def custom_jvp(interp: Interp, eqn: Any, ins: list[Val]) -> list[Val]:
  """Rebuilt through `jax.custom_jvp`, since JAX traces the rule lazily: the primal and the
  rule both evaluated under the policy; tangents cast to the primal's dtypes (`jax.nn.relu`'s
  gradient at 0 stays 0)."""
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


@register(HIGHER_ORDER, "custom_vjp_call", untapped=True)
def custom_vjp(interp: Interp, eqn: Any, ins: list[Val]) -> list[Val]:
  """Rebuilt through `jax.custom_vjp`: primal, `fwd` and the user's `bwd` (traced at its
  declared dtypes, then evaluated under the policy); cotangents cast to each input's dtype."""
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
