"""torch's CUDA autocast policy: its table, the default policy, a user's overrides checked.

The policy's reference is ``aten/src/ATen/autocast_mode.h`` of torch 2.13.0 (commit
``cf30153c4c131c8164ee7798e5022d810682e2cb``): its ``AT_FORALL_LOWER_PRECISION_FP``,
``AT_FORALL_FP32``, ``AT_FORALL_FP32_SET_OPT_DTYPE`` and ``AT_FORALL_PROMOTE`` lists,
registered for CUDA in ``autocast_mode.cpp``. Each row of :data:`POLICY_TABLE` names the
lax primitive, the list it joins here, and the torch entries it stands for. A primitive
in no row runs in the dtypes of its operands, promoted as torch promotes when float
operands disagree: what torch does for an op in none of its lists (``add``, ``mul``,
``tanh``, ``max``...).

The table's primitives are declared first-order by the first-order room
(:mod:`._rules._first_order`); this module builds the default policy from the table and
checks a user's ``policy=`` overrides against the registry.
"""

from __future__ import annotations

from collections.abc import Mapping
import difflib
import types
from typing import Any
from typing import NamedTuple

import jax.extend.core as jex

from jax_lossscale._autocast._rules import _registry as registry

__all__ = (
  "COMPOSITE_RULES",
  "DEFAULT_POLICY",
  "FLOAT32",
  "FLOAT32_COMPUTE",
  "LOWER",
  "POLICY_TABLE",
  "PROMOTE",
  "RULES",
  "VERSIONED_ROWS",
  "PolicyRow",
  "autocast_policy",
  "check_policy",
  "nearest",
)

# -- the rules: torch's CUDA autocast lists ------------------------------------------

#: Run in the autocast dtype (float16 or bfloat16): float32 operands are cast down.
LOWER = "lower"
#: Run in float32: float16 and bfloat16 operands are cast up.
FLOAT32 = "float32"
#: Run in the widest float dtype of the operands (torch's promote list, and the
#: rule for every primitive in no list).
PROMOTE = "promote"
#: A composite op only (:func:`jax_lossscale.autocast_op`): compute in float32 and return
#: the primary input's dtype, as cuDNN's batch norm does under torch's autocast.
FLOAT32_COMPUTE = "float32_compute"

#: The rules a primitive can have.
RULES = (LOWER, FLOAT32, PROMOTE)
#: The rules a composite op can have.
COMPOSITE_RULES = (LOWER, FLOAT32, PROMOTE, FLOAT32_COMPUTE)


class PolicyRow(NamedTuple):
  """One row of the policy table."""

  primitive: str
  rule: str
  torch: str
  note: str = ""


#: The default policy, row by row. Rendered in ``docs/guides/autocast.md``.
POLICY_TABLE: tuple[PolicyRow, ...] = (
  PolicyRow(
    "dot_general",
    LOWER,
    "lower_precision_fp: matmul, mm, bmm, mv, addmm, addmv, addr, addbmm, baddbmm, linear,"
    " einsum, chain_matmul, linalg_multi_dot, linalg_vecdot, the RNN cells,"
    " scaled_dot_product_attention",
    "Also jnp.dot, jnp.tensordot and jnp.vdot, which torch puts in its promote list"
    " (dot, vdot, tensordot): lax has one contraction primitive.",
  ),
  PolicyRow(
    "conv_general_dilated",
    LOWER,
    "lower_precision_fp: conv1d, conv2d, conv3d, conv_transpose1d/2d/3d, convolution,"
    " _convolution, conv_tbc",
  ),
  PolicyRow("exp", FLOAT32, "fp32: exp"),
  PolicyRow("expm1", FLOAT32, "fp32: expm1"),
  PolicyRow(
    "log",
    FLOAT32,
    "fp32: log, log2, log10",
    "jnp.log10 is log followed by a mul; jnp.log2 is too up to jax 0.10, and the"
    " primitive log2 from jax 0.11, which takes this row's rule.",
  ),
  PolicyRow("log1p", FLOAT32, "fp32: log1p"),
  PolicyRow("pow", FLOAT32, "fp32: pow (Tensor_Tensor, Scalar)"),
  PolicyRow(
    "integer_pow",
    FLOAT32,
    "fp32: pow (Tensor_Scalar), reciprocal",
    "x ** 2, x ** 3 and jnp.reciprocal (integer_pow y=-1). jax.nn.gelu(approximate=True)"
    " is written with x ** 3, but it is registered as one op that runs in its input's"
    " dtype, as torch's fused gelu kernel.",
  ),
  PolicyRow(
    "square",
    FLOAT32,
    "fp32: pow (torch.square is pow(x, 2))",
    "Keeps x ** 2 in the variance of a layer norm from overflowing float16.",
  ),
  PolicyRow("rsqrt", FLOAT32, "fp32: rsqrt"),
  PolicyRow("acos", FLOAT32, "fp32: acos"),
  PolicyRow("asin", FLOAT32, "fp32: asin"),
  PolicyRow("cosh", FLOAT32, "fp32: cosh"),
  PolicyRow("sinh", FLOAT32, "fp32: sinh"),
  PolicyRow("tan", FLOAT32, "fp32: tan"),
  PolicyRow("erf_inv", FLOAT32, "fp32: erfinv"),
  PolicyRow(
    "reduce_sum",
    FLOAT32,
    "fp32_set_opt_dtype: sum; and the sums inside softmax, log_softmax, logsumexp,"
    " layer_norm, group_norm, rms_norm, the norms and the losses (fp32)",
    "jnp.mean is reduce_sum then div, so it is float32 too; torch.mean is in no list and"
    " returns float16.",
  ),
  PolicyRow("reduce_prod", FLOAT32, "fp32_set_opt_dtype: prod"),
  PolicyRow("cumsum", FLOAT32, "fp32_set_opt_dtype: cumsum"),
  PolicyRow("cumprod", FLOAT32, "fp32_set_opt_dtype: cumprod"),
  PolicyRow(
    "cumlogsumexp",
    FLOAT32,
    "fp32: logsumexp (its cumulative form, torch.logcumsumexp, is in no list)",
  ),
  PolicyRow(
    "atan2",
    PROMOTE,
    "promote: atan2; and addcdiv, addcmul, cross, index_put, scatter_add, bilinear,"
    " grid_sampler (composites of promoting primitives here)",
  ),
)


#: Primitives that only some JAX versions define and that take the rule of a row where
#: they exist: name -> the row's primitive (see that row's note).
VERSIONED_ROWS = {"log2": "log"}


def _default_policy() -> dict[jex.Primitive, str]:
  policy = {registry.resolve(row.primitive): row.rule for row in POLICY_TABLE}
  rules = {row.primitive: row.rule for row in POLICY_TABLE}
  for name, row in VERSIONED_ROWS.items():
    try:  # a primitive of the JAX releases that define it (jax_release() decides which)
      policy[registry.resolve(name)] = rules[row]
    except LookupError:
      continue
  return policy


#: The default policy as a read-only mapping: primitive -> rule, keyed by the
#: ``Primitive`` objects of the installed JAX (built from the registry's rows).
DEFAULT_POLICY: types.MappingProxyType[jex.Primitive, str] = types.MappingProxyType(
  _default_policy()
)


def nearest(name: str, names: Any) -> str:
  """``" (did you mean 'exp' or 'expm1'?)"`` for the closest of ``names``, or ``""``."""
  close = difflib.get_close_matches(name, sorted(names), n=3, cutoff=0.6)
  if not close:
    return ""
  quoted = [repr(c) for c in close]
  listed = quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
  return f" (did you mean {listed}?)"


def check_policy(policy: Mapping[Any, str] | None) -> dict[jex.Primitive, str]:
  """The default policy with ``policy``'s overrides, keyed by ``Primitive`` objects.

  Raises:
    TypeError: ``policy`` is not a mapping, or a key is neither a primitive nor a str.
    ValueError: a key names no first-order primitive of the installed JAX, or a rule
      is not one of :data:`RULES`; the message names the key and the nearest names.
  """
  table = dict(DEFAULT_POLICY)
  if policy is None:
    return table
  if not isinstance(policy, Mapping):
    raise TypeError(
      f"policy must be a mapping from a lax primitive (or its name) to one of {RULES}, "
      f"got {type(policy).__name__}."
    )
  for key, rule in policy.items():
    if isinstance(key, jex.Primitive):
      prim = key
    elif isinstance(key, str):
      found = registry.by_name(key)
      if found is None:
        raise ValueError(
          f"policy: {key!r} is not the name of a primitive of this JAX"
          f"{nearest(key, registry.table_names())}."
        )
      prim = found
    else:
      raise TypeError(
        f"policy keys must be lax primitives or their names, got {type(key).__name__}."
      )
    kind = registry.kind_of(prim)
    if kind != registry.FIRST_ORDER:
      what = "unknown to autocast" if kind is None else registry.KINDS[kind]
      raise ValueError(
        f"policy[{prim.name!r}]: `{prim.name}` is {what}; only first-order primitives take a rule."
      )
    if not isinstance(rule, str) or rule not in RULES:
      raise ValueError(
        f"policy[{prim.name!r}] must be one of {RULES}, got {rule!r}{nearest(str(rule), RULES)}."
      )
    table[prim] = rule
  return table


def autocast_policy() -> tuple[PolicyRow, ...]:
  """The default policy of ``autocast``: one row per lax primitive it casts.

  Each :class:`PolicyRow` names the primitive, its rule (``"lower"``: runs in the
  autocast dtype; ``"float32"``; ``"promote"``: the widest float dtype of its operands),
  the entries of torch's CUDA autocast lists it stands for, and a note where the mapping
  is not one to one. A primitive in no row promotes.

  Returns:
    The rows, in the order of the guide's table.

  Examples:
    >>> from jax_lossscale import autocast_policy
    >>> {row.primitive: row.rule for row in autocast_policy()}["dot_general"]
    'lower'
    >>> {row.primitive: row.rule for row in autocast_policy()}["exp"]
    'float32'
  """
  return POLICY_TABLE
