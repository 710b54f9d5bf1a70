"""``autocast``: torch's CUDA autocast policy applied to any JAX function.

The subpackage's rooms:

* :mod:`._rules`: what autocast does with each JAX primitive: one rule function per
  behaviour, in a room of its kind, each declared for its primitives (kind, names by JAX
  release, flags) in one registry, checked against the installed JAX;
* :mod:`._policy`: torch's CUDA lists as a table of lax primitives, the default policy,
  and a user's overrides checked;
* :mod:`._values`: the values the interpreter computes with, their facts, and the casts
  and binds every rule shares;
* :mod:`._interpreter`: the jaxpr interpreter: each equation's rule looked up and called;
* :mod:`._composite`: composite ops with their own rule (``autocast_op``);
* :mod:`._registrations`: the composite ops torch implies (attention, RNN cells, batch
  norms), installed while autocast traces;
* :mod:`._attention`: the attention kernel chosen for the platform;
* :mod:`._api`: ``autocast`` and ``float32``;
* :mod:`._arguments`: a call's arguments split into arrays and static values;
* :mod:`._errors`: the exception types.

Besides the public names, the subpackage gives the diagnostics what they build on:
:func:`interpret` (an autocast function evaluated with a :class:`TapSink` of gradient
taps), :func:`is_array`, ``jaxprs_in_params`` (the jaxprs an equation's params hold, on
every JAX release supported), and ``AUTOCAST_MARK`` (in the name of the ``jit`` an autocast
function is staged out as).
"""

# The rules declare themselves in the registry when their rooms are imported.
from jax_lossscale._autocast import _rules as _rules
from jax_lossscale._autocast._api import AUTOCAST_MARK as AUTOCAST_MARK
from jax_lossscale._autocast._api import AutocastSpec as AutocastSpec
from jax_lossscale._autocast._api import autocast as autocast
from jax_lossscale._autocast._api import autocast_spec as autocast_spec
from jax_lossscale._autocast._api import float32 as float32
from jax_lossscale._autocast._api import interpret as interpret
from jax_lossscale._autocast._arguments import is_array as is_array
from jax_lossscale._autocast._composite import autocast_op as autocast_op
from jax_lossscale._autocast._errors import AutocastError as AutocastError
from jax_lossscale._autocast._errors import ClosedOverTracerError as ClosedOverTracerError
from jax_lossscale._autocast._errors import UnsupportedPrimitiveError as UnsupportedPrimitiveError
from jax_lossscale._autocast._policy import autocast_policy as autocast_policy
from jax_lossscale._autocast._values import TapSink as TapSink
from jax_lossscale._autocast._values import jaxprs_in_params as jaxprs_in_params

__all__ = (
  "AutocastError",
  "AutocastSpec",
  "ClosedOverTracerError",
  "TapSink",
  "UnsupportedPrimitiveError",
  "autocast",
  "autocast_op",
  "autocast_policy",
  "autocast_spec",
  "float32",
  "interpret",
  "is_array",
)
