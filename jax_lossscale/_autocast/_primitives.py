"""The registry of autocast: what each JAX primitive is, its rule, its handler, its flags.

Everything autocast knows of a primitive is declared here, once (the name tables of the
kinds are the data of ``_kinds.py``):

* its **kind** (below), in one table keyed by the ``Primitive`` objects that JAX exports
  (``jax.lax.*_p`` and ``jax.extend.core.primitives``), and by name only for the
  primitives JAX exports no object for (``shard_map``, ``pallas_call``, the callbacks...);
* its **rule** (``lower``, ``float32``, ``promote``) for a first-order primitive that
  torch's CUDA lists name: a row of :data:`POLICY_TABLE`, which also declares the
  primitive first-order;
* its **handler** for a higher-order primitive: the function that rebinds it, declared by
  the :func:`higher_order` decorator on that function (``_higher_order.py``), which also
  gives its kind, its JAX versions and whether lower-precision outputs inside it are
  tapped (``untapped``);
* its **flags**: :data:`KEEPS_RANK` for the layout primitives through which a value stays
  (a layout of) the function input it was, the candidates for torch's bias rule.

Every primitive of the installed JAX has a kind; ``tests/test_autocast_primitives.py``
fails on a name here that is no primitive of the installed JAX, and on a primitive of JAX
that has no kind (a new primitive after an upgrade), so the registry cannot drift
silently. The primitives that only some of the tested JAX versions (0.9 to 0.12) define
are listed apart, each with the versions that define it (``_kinds.VERSIONED``, and the
``since``/``until`` of a handler), and the drift test checks those ranges too.
``CONTRIBUTING.md`` has the recipes for adding a primitive.

The kinds:

* ``FIRST_ORDER``: computes on its operands; it takes the policy's rule (``lower``,
  ``float32``; ``promote``, the default, is torch's rule for an op in no list).
* ``LAYOUT``: moves or selects data of its first operand (reshape, gather, pad,
  select_n...): the facts of that operand (a lower-precision result, a function input's
  rank, a constant) carry through it, and float operands that disagree are promoted.
* ``SCATTER``: the scatters; the operand and the updates are promoted together and the
  combiner is traced again for the dtype they get.
* ``INDEPENDENT``: variadic, but each operand is its own array (collectives, sort,
  optimization_barrier, device_put): operands are never promoted together.
* ``AS_WRITTEN``: opaque or dtype-bound (custom calls, Pallas kernels, callbacks,
  bitcasts, cuDNN's fused attention, linear solves): its operands go back to the dtypes
  the function was traced with and it runs exactly as written.
* ``HIGHER_ORDER``: holds sub-jaxprs that autocast interprets (jit, remat, scan, while,
  cond, shard_map, custom_jvp, custom_vjp): rebound as the same primitive with every
  parameter, only the sub-jaxprs swapped (custom_jvp and custom_vjp are rebuilt through
  their public constructors, since their rules are traced lazily); the call primitives
  (closed_call, and eval_jaxpr from jax 0.11) are inlined. The ones in ``UNHANDLED``
  raise ``UnsupportedPrimitiveError``.
* ``KERNEL``: exists only inside a Pallas or Mosaic kernel body, which autocast never
  enters (the ``pallas_call`` around it runs as written).

The policy's reference is ``aten/src/ATen/autocast_mode.h`` of torch 2.13.0 (commit
``cf30153c4c131c8164ee7798e5022d810682e2cb``): its ``AT_FORALL_LOWER_PRECISION_FP``,
``AT_FORALL_FP32``, ``AT_FORALL_FP32_SET_OPT_DTYPE`` and ``AT_FORALL_PROMOTE`` lists,
registered for CUDA in ``autocast_mode.cpp``. Each row of :data:`POLICY_TABLE` names the
lax primitive, the list it joins here, and the torch entries it stands for. A primitive
in no row runs in the dtypes of its operands, promoted as torch promotes when float
operands disagree: what torch does for an op in none of its lists (``add``, ``mul``,
``tanh``, ``max``...).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.extend.core as jex
import jax.extend.core.primitives as _P

from jax_lossscale._autocast._kinds import AS_WRITTEN
from jax_lossscale._autocast._kinds import CHECKED_RELEASES
from jax_lossscale._autocast._kinds import FIRST_ORDER
from jax_lossscale._autocast._kinds import HIGHER_ORDER
from jax_lossscale._autocast._kinds import INDEPENDENT
from jax_lossscale._autocast._kinds import KEEPS_RANK
from jax_lossscale._autocast._kinds import KERNEL
from jax_lossscale._autocast._kinds import KERNEL_MODULES
from jax_lossscale._autocast._kinds import KIND_DESCRIPTIONS
from jax_lossscale._autocast._kinds import KINDS
from jax_lossscale._autocast._kinds import LAYOUT
from jax_lossscale._autocast._kinds import OLDEST_TESTED
from jax_lossscale._autocast._kinds import RULED_KINDS
from jax_lossscale._autocast._kinds import SCATTER
from jax_lossscale._autocast._kinds import UNHANDLED
from jax_lossscale._autocast._kinds import VERSIONED
from jax_lossscale._autocast._kinds import Release as _Release
from jax_lossscale._autocast._kinds import jax_release

__all__ = (
  "AS_WRITTEN",
  "CHECKED_RELEASES",
  "COMPOSITE_RULES",
  "FIRST_ORDER",
  "FLOAT32",
  "FLOAT32_COMPUTE",
  "HIGHER_ORDER",
  "INDEPENDENT",
  "KEEPS_RANK",
  "KERNEL",
  "KERNEL_MODULES",
  "KIND_DESCRIPTIONS",
  "LAYOUT",
  "LOWER",
  "OLDEST_TESTED",
  "POLICY_TABLE",
  "PROMOTE",
  "RULED_KINDS",
  "RULES",
  "SCATTER",
  "UNHANDLED",
  "VERSIONED_ROWS",
  "Handler",
  "NamedPrimitive",
  "PolicyRow",
  "by_name",
  "defined_in",
  "handler_of",
  "handlers",
  "higher_order",
  "jax_release",
  "kind",
  "resolve",
  "table_names",
  "versioned_names",
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


# -- the handlers of the higher-order primitives ---------------------------------------


class Handler(NamedTuple):
  """How autocast rebinds one higher-order primitive (declared by :func:`higher_order`).

  Attributes:
    fn: ``fn(interpreter, eqn, ins) -> outs``: the equation's outputs (``Val``) for its
      inputs (``Val``), rebound with its sub-jaxprs interpreted.
    untapped: the lower-precision outputs inside it are counted, not tapped, by
      ``check_underflow`` (a tap in a loop, a branch or a custom rule would sum the
      gradients of every iteration or branch).
    since: the first JAX release that defines the primitive (``None``: every supported one).
    until: the first JAX release that no longer does (``None``: the newest still does).
  """

  fn: Callable[..., Any]
  untapped: bool = False
  since: _Release | None = None
  until: _Release | None = None


_HANDLERS: dict[str, Handler] = {}


def higher_order(
  *names: str, untapped: bool = False, since: _Release | None = None, until: _Release | None = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
  """Declares the decorated function the handler of the higher-order primitives ``names``.

  The declaration is the primitive's whole entry in the registry: its kind
  (``HIGHER_ORDER``), its handler, its flag and the JAX releases that define it.

  Raises:
    ValueError: a name is declared twice, or already has another kind.
  """

  def register(fn: Callable[..., Any]) -> Callable[..., Any]:
    for name in names:
      if name in _HANDLERS or name in _all_kinds(handled=False):
        raise ValueError(f"the primitive {name!r} is declared twice in the autocast registry.")
      _HANDLERS[name] = Handler(fn, untapped, since, until)
      _index(name, HIGHER_ORDER)
    return fn

  return register


def handler_of(name: str) -> Handler | None:
  """The handler declared for the higher-order primitive ``name``, or ``None``."""
  return _HANDLERS.get(name)


def handlers() -> dict[str, Handler]:
  """Every declared handler, by primitive name."""
  return dict(_HANDLERS)


# -- lookups -------------------------------------------------------------------------


def _range(name: str) -> tuple[_Release | None, _Release | None]:
  if name in VERSIONED:
    _, first, until = VERSIONED[name]
    return first, until
  found = _HANDLERS.get(name)
  if found is not None:
    return found.since, found.until
  return None, None


def defined_in(name: str, release: tuple[int, ...]) -> bool:
  """Whether JAX ``release`` (major, minor, patch) defines the primitive ``name``."""
  first, until = _range(name)
  return (first is None or first <= tuple(release)) and (until is None or tuple(release) < until)


def versioned_names() -> dict[str, tuple[_Release, _Release | None]]:
  """The names only some JAX releases define: (the first release, the first without it)."""
  out: dict[str, tuple[_Release, _Release | None]] = {}
  for name in (*VERSIONED, *_HANDLERS):
    first, until = _range(name)
    if first is not None or until is not None:
      out[name] = (first or OLDEST_TESTED, until)
  return out


def _all_kinds(handled: bool = True) -> dict[str, str]:
  kinds = {name: k for k, names in KINDS.items() for name in names}
  kinds.update({row.primitive: FIRST_ORDER for row in POLICY_TABLE})
  kinds.update({name: k for name, (k, _, _) in VERSIONED.items()})
  if handled:
    kinds.update({name: HIGHER_ORDER for name in _HANDLERS})
  return kinds


def _exported(name: str) -> jex.Primitive | None:
  attr = name.replace("-", "_") + ("" if name.endswith("_p") else "_p")
  for module in (jax.lax, _P):
    prim = getattr(module, attr, None)
    if isinstance(prim, jex.Primitive) and prim.name == name:
      return prim
  return None


_BY_OBJECT: dict[jex.Primitive, str] = {}
_BY_NAME: dict[str, str] = {}
_NAMED_OBJECTS: dict[str, jex.Primitive] = {}


def _index(name: str, k: str) -> None:
  prim = _exported(name)
  if prim is not None:
    _BY_OBJECT[prim] = k
    _NAMED_OBJECTS[prim.name] = prim
  else:
    _BY_NAME[name] = k


for _name, _kind in _all_kinds().items():
  _index(_name, _kind)


def kind(prim: jex.Primitive) -> str | None:
  """The kind of ``prim``, or ``None`` for a primitive the registry does not know."""
  k = _BY_OBJECT.get(prim)
  if k is not None:
    return k
  if prim.name in _NAMED_OBJECTS:  # a namesake (a kernel's `gather`), not the lax one
    return None
  return _BY_NAME.get(prim.name)


def resolve(name: str) -> jex.Primitive:
  """The exported ``Primitive`` object of the installed JAX named ``name``."""
  prim = _exported(name)
  if prim is None:
    raise LookupError(f"JAX exports no primitive named {name!r}.")
  return prim


class NamedPrimitive(jex.Primitive):
  """A stand-in key for a policy entry naming a primitive JAX exports no object for."""


_STAND_INS: dict[str, jex.Primitive] = {}


def by_name(name: str) -> jex.Primitive | None:
  """The primitive a policy key names: the exported object, else a stand-in by name."""
  prim = _NAMED_OBJECTS.get(name) or _exported(name)
  if prim is not None:
    return prim
  if name in _BY_NAME:
    if name not in _STAND_INS:
      _STAND_INS[name] = NamedPrimitive(name)
    return _STAND_INS[name]
  return None


def table_names(release: tuple[int, ...] | None = None) -> dict[str, str]:
  """Every name of the registry that JAX ``release`` (the installed one by default)
  defines, with its kind (for the drift test)."""
  release = jax_release() if release is None else release
  return {name: k for name, k in _all_kinds().items() if defined_in(name, release)}
