"""Autocast's rules: what it does with each JAX primitive, one room per behaviour.

Each room is a module of rule functions, each declared for its primitives by
:func:`~._registry.register` (its kind, its names by JAX release, its flags): the registry
(:mod:`._registry`) is the one index and :func:`lookup` the one lookup. The rooms:

* :mod:`._first_order`: the policy's rules (``lower``, ``float32``, ``promote``), ``add``
  with torch's bias rule, and the rule of a primitive no room declares;
* :mod:`._layout`: data moved or selected, facts carried; the model's own casts;
* :mod:`._scatter`: operand and updates promoted together;
* :mod:`._independent`: collectives, sort, barriers, each operand as it is;
* :mod:`._as_written`: opaque and dtype-bound primitives, run as written;
* :mod:`._calls`: ``jit``, the call primitives, ``remat``, ``shard_map`` (and the ``jit``
  regions of autocast's own: composite ops, ``float32``, nested autocasts);
* :mod:`._loops`: ``scan``, ``while``;
* :mod:`._branches`: ``cond``;
* :mod:`._custom`: ``custom_jvp``, ``custom_vjp``.

:mod:`._promotion` holds torch's promotion, which several rooms share. Importing this
package declares every rule.
"""

from jax_lossscale._autocast._rules import _as_written as _as_written
from jax_lossscale._autocast._rules import _branches as _branches
from jax_lossscale._autocast._rules import _calls as _calls
from jax_lossscale._autocast._rules import _custom as _custom
from jax_lossscale._autocast._rules import _first_order as _first_order
from jax_lossscale._autocast._rules import _independent as _independent
from jax_lossscale._autocast._rules import _layout as _layout
from jax_lossscale._autocast._rules import _loops as _loops
from jax_lossscale._autocast._rules import _scatter as _scatter
from jax_lossscale._autocast._rules._registry import lookup as lookup

__all__ = ("lookup",)
