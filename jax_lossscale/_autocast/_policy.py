"""The autocast policy a user gets and passes: the default one, and overrides checked.

The rules and the rows that map torch's CUDA autocast lists to lax primitives are
declared in the registry (:mod:`jax_lossscale._autocast._primitives`); this module builds
the default policy from them, checks a user's ``policy=`` overrides, and says which
float dtypes autocast casts.
"""

from __future__ import annotations

from collections.abc import Mapping
import difflib
import types
from typing import Any

import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

from jax_lossscale._autocast import _primitives as prims
from jax_lossscale._autocast._primitives import POLICY_TABLE
from jax_lossscale._autocast._primitives import RULES
from jax_lossscale._autocast._primitives import VERSIONED_ROWS
from jax_lossscale._autocast._primitives import PolicyRow

__all__ = (
  "DEFAULT_POLICY",
  "ELIGIBLE",
  "autocast_policy",
  "check_policy",
  "is_eligible",
  "nearest",
)

#: Float dtypes autocast casts (torch: ``is_eligible`` excludes float64).
ELIGIBLE = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32))


def is_eligible(dtype: Any) -> bool:
  """Whether autocast casts arrays of ``dtype`` (float16, bfloat16, float32)."""
  try:
    return np.dtype(dtype) in ELIGIBLE
  except TypeError:  # an extended dtype (PRNG keys)
    return False


def _default_policy() -> dict[jex.Primitive, str]:
  policy = {prims.resolve(row.primitive): row.rule for row in POLICY_TABLE}
  rules = {row.primitive: row.rule for row in POLICY_TABLE}
  for name, row in VERSIONED_ROWS.items():
    if prims.defined_in(name, prims.jax_release()):
      policy[prims.resolve(name)] = rules[row]
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
      found = prims.by_name(key)
      if found is None:
        raise ValueError(
          f"policy: {key!r} is not the name of a primitive of this JAX"
          f"{nearest(key, prims.table_names())}."
        )
      prim = found
    else:
      raise TypeError(
        f"policy keys must be lax primitives or their names, got {type(key).__name__}."
      )
    kind = prims.kind(prim)
    if kind not in prims.RULED_KINDS:
      what = "unknown to autocast" if kind is None else prims.KIND_DESCRIPTIONS[kind]
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
