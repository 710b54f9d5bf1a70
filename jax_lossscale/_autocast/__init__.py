"""``autocast``: torch's CUDA autocast policy applied to any JAX function.

The subpackage's rooms:

* :mod:`._policy`: the rules and torch's lists mapped to lax primitives;
* :mod:`._primitives`: the kind of every JAX primitive (first-order, layout, scatter,
  collective, opaque, higher-order, kernel-only), checked against the installed JAX;
* :mod:`._interpreter`: the jaxpr interpreter, its per-value facts and the handlers that
  rebind the higher-order primitives;
* :mod:`._composite`: composite ops with their own rule (``autocast_op``) and the
  registrations torch implies (attention, RNN cells, batch norms);
* :mod:`._api`: ``autocast`` and ``float32``;
* :mod:`._errors`: the exception types.
"""

from jax_lossscale._autocast._api import AutocastSpec as AutocastSpec
from jax_lossscale._autocast._api import autocast as autocast
from jax_lossscale._autocast._api import autocast_spec as autocast_spec
from jax_lossscale._autocast._api import float32 as float32
from jax_lossscale._autocast._composite import autocast_op as autocast_op
from jax_lossscale._autocast._errors import AutocastError as AutocastError
from jax_lossscale._autocast._errors import ClosedOverTracerError as ClosedOverTracerError
from jax_lossscale._autocast._errors import UnsupportedPrimitiveError as UnsupportedPrimitiveError
from jax_lossscale._autocast._policy import autocast_policy as autocast_policy

__all__ = (
  "AutocastError",
  "AutocastSpec",
  "ClosedOverTracerError",
  "UnsupportedPrimitiveError",
  "autocast",
  "autocast_op",
  "autocast_policy",
  "autocast_spec",
  "float32",
)
