"""The primitives whose operands are independent arrays: collectives, sort, barriers.

Variadic, but each operand is its own array (``psum`` of a tuple, ``sort`` of keys and
values, ``optimization_barrier``, ``device_put``): they are bound on the operands as they
are, never promoted together.
"""

from __future__ import annotations

from typing import Any

from jax_lossscale._autocast._rules._registry import INDEPENDENT
from jax_lossscale._autocast._rules._registry import V0_9_1
from jax_lossscale._autocast._rules._registry import V0_10
from jax_lossscale._autocast._rules._registry import V0_11
from jax_lossscale._autocast._rules._registry import V0_12
from jax_lossscale._autocast._rules._registry import Interp
from jax_lossscale._autocast._rules._registry import Name
from jax_lossscale._autocast._rules._registry import register
from jax_lossscale._autocast._values import Val
from jax_lossscale._autocast._values import bind

__all__ = ("independent",)

#: Defined by every supported JAX release.
COLLECTIVES = (
  "psum",
  "pmax",
  "pmin",
  "ppermute",
  "all_gather",
  "all_to_all",
  "ragged_all_to_all",
  "pbroadcast",
  "pvary",
  "psum_invariant",
  "all_gather_invariant",
  "all_gather_reduced",
  "reduce_scatter",
  "preduced",
  "unreduced_psum",
  "unreduced_reduce_scatter",
  "psend",
  "precv",
  "optimization_barrier",
  "device_put",
  "sort",
  "host_local_array_to_global_array",
  "global_array_to_host_local_array",
)

#: Defined by some (the async pairs come and go with the releases).
COLLECTIVES_SINCE = (
  Name("pgather", until=V0_9_1),
  Name("ag_start", since=V0_9_1, until=V0_10),
  Name("ag_done", since=V0_9_1, until=V0_10),
  Name("full_to_shard", until=V0_10),
  Name("shard_to_full", until=V0_10),
  Name("shard_alike", until=V0_11),
  Name("reduced_vary_cast_p", until=V0_12),
  Name("vary_unreduced_cast_p", until=V0_12),
  Name("pbroadcast_start", since=V0_10, until=V0_11),
  Name("pbroadcast_done", since=V0_10, until=V0_11),
  Name("psum_start", since=V0_10, until=V0_11),
  Name("unreduced_psum_start", since=V0_10, until=V0_11),
  Name("unreduced_reduce_scatter_start", since=V0_10, until=V0_11),
  Name("all_gather_start", since=V0_10),
  Name("all_gather_done", since=V0_10),
  Name("all_gather_reduced_start", since=V0_10),
  Name("all_to_all_start", since=V0_10),
  Name("all_to_all_done", since=V0_10),
  Name("ppermute_start", since=V0_10),
  Name("ppermute_done", since=V0_10),
  Name("psum_done", since=V0_10),
  Name("psum_invariant_start", since=V0_10),
  Name("reduce_scatter_start", since=V0_10),
  Name("reduce_scatter_done", since=V0_10),
  Name("unreduced_pmax", since=V0_11),
  Name("unreduced_pmin", since=V0_11),
  Name("pbroadcast_dynamic", since=V0_12),
  Name("reduced_vary_cast", since=V0_12),
  Name("vary_unreduced_cast", since=V0_12),
)


@register(INDEPENDENT, *COLLECTIVES, *COLLECTIVES_SINCE)
def independent(interp: Interp, eqn: Any, ins: list[Val]) -> list[Val]:
  """Each operand is its own array: bound on the operands as they are, never promoted
  together."""
  return [Val(o) for o in bind(eqn, [v.x for v in ins])]
