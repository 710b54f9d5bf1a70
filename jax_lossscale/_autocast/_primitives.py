"""The registry of autocast: what each JAX primitive is, its rule, its handler, its flags.

Everything autocast knows of a primitive is declared here, once:

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
are listed apart, each with the versions that define it (``_VERSIONED``, and the
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

FIRST_ORDER = "first_order"
LAYOUT = "layout"
SCATTER = "scatter"
INDEPENDENT = "independent"
AS_WRITTEN = "as_written"
HIGHER_ORDER = "higher_order"
KERNEL = "kernel"

#: The kinds whose primitives take a rule of the policy.
RULED_KINDS = (FIRST_ORDER,)

KIND_DESCRIPTIONS = {
  FIRST_ORDER: "a first-order primitive",
  LAYOUT: "a layout primitive (it moves data; its operand's dtype carries through)",
  SCATTER: "a scatter (its operand and updates are promoted together)",
  INDEPENDENT: "a primitive whose operands are independent arrays (a collective, sort)",
  AS_WRITTEN: "an opaque primitive that runs as written, on its declared dtypes",
  HIGHER_ORDER: "a higher-order primitive whose sub-jaxprs autocast interprets",
  KERNEL: "a kernel-language primitive (it exists only inside a Pallas kernel)",
}

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


# -- the kinds -----------------------------------------------------------------------

#: Layout primitives through which a value stays (a layout of) the function input it was:
#: the candidates for torch's bias rule (a parameter of lower rank added onto a
#: lower-precision result is part of that op, as in torch's ``linear``).
KEEPS_RANK = (
  "reshape",
  "broadcast_in_dim",
  "transpose",
  "squeeze",
  "convert_element_type",
  "copy",
  "slice",
  "rev",
  "sharding_constraint",
  "layout_constraint",
  "reshard",
  "name",
  "stop_gradient",
)

#: The modules whose primitives exist only inside kernel bodies: their reason for
#: ``KERNEL`` is that a ``pallas_call`` (``AS_WRITTEN``) is opaque to autocast.
KERNEL_MODULES = (
  "jax._src.pallas.mosaic",
  "jax._src.pallas.mosaic_gpu",
  "jax._src.pallas.triton",
  "jax._src.pallas.primitives",
  "jax._src.pallas.einshape",
  "jax._src.pallas.fuser.fusible_dtype",
  # jax 0.12's thunky: a program for XLA:GPU's thunk executor, written in its own primitives
  "jax._src.thunky",
)

_KINDS: dict[str, tuple[str, ...]] = {
  FIRST_ORDER: (
    # (and the primitive of each row of POLICY_TABLE)
    # elementwise arithmetic and comparisons
    "abs",
    "acosh",
    "add",
    "add_any",
    "and",
    "asinh",
    "atan",
    "atanh",
    "bessel_i0e",
    "bessel_i1e",
    "cbrt",
    "ceil",
    "clamp",
    "clz",
    "complex",
    "conj",
    "cos",
    "digamma",
    "div",
    "eq",
    "eq_to",
    "erf",
    "erfc",
    "exp2",
    "floor",
    "ge",
    "gt",
    "igamma",
    "igamma_grad_a",
    "igammac",
    "imag",
    "is_finite",
    "le",
    "le_to",
    "lgamma",
    "logistic",
    "lt",
    "lt_to",
    "max",
    "min",
    "mul",
    "ne",
    "neg",
    "nextafter",
    "not",
    "or",
    "polygamma",
    "population_count",
    "real",
    "regularized_incomplete_beta",
    "rem",
    "round",
    "shift_left",
    "shift_right_arithmetic",
    "shift_right_logical",
    "sign",
    "sin",
    "sqrt",
    "sub",
    "tanh",
    "xor",
    "zeta",
    # reductions, scans over an axis, contractions, convolutions
    "argmax",
    "argmin",
    "cummax",
    "cummin",
    "reduce_and",
    "reduce_max",
    "reduce_min",
    "reduce_or",
    "reduce_xor",
    "reduce_window_max",
    "reduce_window_min",
    "reduce_window_sum",
    "ragged_dot_general",
    "fft",
    "top_k",
    "approx_top_k",
    # linear algebra (one float operand each, or operands of one dtype)
    "cholesky",
    "cholesky_update",
    "eig",
    "eigh",
    "geqp3",
    "geqrf",
    "hessenberg",
    "householder_product",
    "lu",
    "lu_pivots_to_permutation",
    "qr",
    "schur",
    "svd",
    "symmetric_product",
    "triangular_solve",
    "tridiagonal",
    "tridiagonal_solve",
  ),
  LAYOUT: (
    *KEEPS_RANK,
    "dynamic_slice",
    "dynamic_update_slice",
    "gather",
    "pad",
    "concatenate",
    "split",
    "select_n",
    "zeros_like",
    "tile",
  ),
  SCATTER: ("scatter", "scatter-add", "scatter-sub", "scatter-mul", "scatter-min", "scatter-max"),
  INDEPENDENT: (
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
  ),
  AS_WRITTEN: (
    # jax.experimental: sparse formats, cuDNN's RNN, key-reuse checks, fused calls
    "bcoo_dot_general",
    "bcoo_dot_general_sampled",
    "bcoo_extract",
    "bcoo_fromdense",
    "bcoo_sort_indices",
    "bcoo_spdot_general",
    "bcoo_sum_duplicates",
    "bcoo_todense",
    "bcoo_transpose",
    "bcsr_dot_general",
    "bcsr_extract",
    "bcsr_fromdense",
    "bcsr_todense",
    "coo_fromdense",
    "coo_matmat",
    "coo_matvec",
    "coo_spmm",
    "coo_spmv",
    "coo_todense",
    "csr_fromdense",
    "csr_matmat",
    "csr_matvec",
    "csr_spmm",
    "csr_spmv",
    "csr_todense",
    "spsolve",
    "todense",
    "rnn_fwd",
    "rnn_bwd",
    "consume",
    "assert_consumed_value",
    "fused_call",
    "xla_metadata_call",
    # opaque kernels and custom calls
    "pallas_call",
    "custom_fusion",
    "ffi_call",
    "tpu_custom_call",
    "mosaic_gpu_p",
    "cudnn_fusion",
    "custom_partitioning",
    "dot_product_attention_fwd",
    "dot_product_attention_bwd",
    "dot_product_attention_fwd_wrapper",
    "dot_product_attention_bwd_wrapper",
    "dot_product_attention_fp8_fwd",
    "dot_product_attention_fp8_bwd",
    "dot_product_attention_fp8_fwd_wrapper",
    "dot_product_attention_fp8_bwd_wrapper",
    "scaled_matmul",
    "scaled_matmul_wrapper",
    "call_exported",
    # host callbacks and debugging
    "pure_callback",
    "io_callback",
    "debug_callback",
    "debug_print",
    "buffer_callback",
    "inspect_sharding",
    "check",
    # dtype-bound: a reinterpretation of bits, a traced combiner, a linear solve
    "bitcast_convert_type",
    "reduce_precision",
    "reduce",
    "reduce_window",
    "select_and_scatter",
    "select_and_scatter_add",
    "select_and_gather_add",
    "custom_linear_solve",
    "custom_vmap_call",
    "linear_call",
    "custom_lin",
    "composite",
    "compute_on",
    "remat_opt",
    "custom_jvp_call_jaxpr",
    "unreachable",
    "platform_index",
    # sources: no float operand to cast
    "iota",
    "iota_2x32_shape",
    "create_token",
    "after_all",
    "axis_index",
    "rng_bit_generator",
    "rng_uniform",
    "random_bits",
    "random_fold_in",
    "random_seed",
    "random_split",
    "random_wrap",
    "random_unwrap",
    "random_clone",
    "random_gamma",
    "threefry2x32",
    "empty",
    "empty2",
    "to_edtype",
    "from_edtype",
    "shape_assertion",
    "dim_as_value",
    "dimension_size",
    "xla_metadata_value",
    "dce_sink",
    "tie",
    # mutable references and boxes (their dtype is the reference's)
    "get",
    "swap",
    "addupdate",
    "new_ref",
    "freeze",
    "accum_grad_in_ref",
    "run_state",
    "pin",
    "unpin",
    "create_linear",
    "broadcast_to",
    "call_hi_primitive",
    "call_hi_primitive_linearized",
    "with_memory_space_constraint",
    "remove_memory_space",
  ),
}


#: The JAX releases whose primitives the table was checked against (every primitive each one
#: defines, from jax 0.9.0, the oldest supported, to the newest): tests/test_autocast_primitives.py
#: checks the installed one; CONTRIBUTING.md has the runs.
CHECKED_RELEASES = ((0, 9, 0), (0, 9, 1), (0, 9, 2), (0, 10, 2), (0, 11, 2), (0, 12, 0))
OLDEST_TESTED = CHECKED_RELEASES[0]

_V090, _V091 = (0, 9, 0), (0, 9, 1)
_V10, _V11, _V12 = (0, 10, 0), (0, 11, 0), (0, 12, 0)

#: The primitives only some JAX releases define: name -> (kind, the first release that
#: defines it, the first that no longer does, ``None`` if the newest still does). The
#: names above are defined by every release from jax 0.9.0 on. The drift test checks both
#: ways: the installed JAX defines a name exactly when its range holds the installed release.
_VERSIONED: dict[str, tuple[str, tuple[int, int, int], tuple[int, int, int] | None]] = {
  # jax 0.9 only (pgather in 0.9.0 only; ag_start and ag_done from 0.9.1)
  "pgather": (INDEPENDENT, _V090, _V091),
  "ag_start": (INDEPENDENT, _V091, _V10),
  "ag_done": (INDEPENDENT, _V091, _V10),
  "full_to_shard": (INDEPENDENT, _V090, _V10),
  "shard_to_full": (INDEPENDENT, _V090, _V10),
  "sparse_dense_matmul": (AS_WRITTEN, _V090, _V10),
  "sparse_pack_nm": (AS_WRITTEN, _V090, _V10),
  # jax.experimental.custom_dce and custom_transpose (their rules are opaque to autocast)
  "custom_dce_call": (AS_WRITTEN, _V090, _V10),
  "dce_sential": (AS_WRITTEN, _V090, _V10),
  "custom_transpose_call": (AS_WRITTEN, _V090, _V10),
  # jax.pmap's own primitive: autocast has no rule for it and raises
  # UnsupportedPrimitiveError (see UNHANDLED); from jax 0.10 pmap is a shard_map.
  "xla_pmap": (HIGHER_ORDER, _V090, _V10),
  # jax 0.9 and 0.10 (call and closed_call, which eval_jaxpr replaces in jax 0.11, are
  # declared by their handlers)
  "shard_alike": (INDEPENDENT, _V090, _V11),
  "core_map": (AS_WRITTEN, _V090, _V11),
  "fusible": (AS_WRITTEN, _V090, _V11),
  "box_get": (AS_WRITTEN, _V090, _V11),
  "box_set": (AS_WRITTEN, _V090, _V11),
  "new_box": (AS_WRITTEN, _V090, _V11),
  # jax 0.9 to 0.11 (renamed without the `_p` in jax 0.12)
  "reduced_vary_cast_p": (INDEPENDENT, _V090, _V12),
  "vary_unreduced_cast_p": (INDEPENDENT, _V090, _V12),
  # from jax 0.9.1
  "scaled_dot": (AS_WRITTEN, _V091, None),
  "mpmd_map": (AS_WRITTEN, _V091, None),
  "empty_ref": (AS_WRITTEN, _V091, None),
  "free_ref": (AS_WRITTEN, _V091, None),
  # jax 0.10 only
  "pbroadcast_start": (INDEPENDENT, _V10, _V11),
  "pbroadcast_done": (INDEPENDENT, _V10, _V11),
  "psum_start": (INDEPENDENT, _V10, _V11),
  "unreduced_psum_start": (INDEPENDENT, _V10, _V11),
  "unreduced_reduce_scatter_start": (INDEPENDENT, _V10, _V11),
  "log_extend": (AS_WRITTEN, _V10, _V11),
  "log_read": (AS_WRITTEN, _V10, _V11),
  "new_log": (AS_WRITTEN, _V10, _V11),
  # from jax 0.10
  "mulhi": (FIRST_ORDER, _V10, None),
  "ormqr": (FIRST_ORDER, _V10, None),
  "stack": (LAYOUT, _V10, None),
  "unstack": (LAYOUT, _V10, None),
  "all_gather_start": (INDEPENDENT, _V10, None),
  "all_gather_done": (INDEPENDENT, _V10, None),
  "all_gather_reduced_start": (INDEPENDENT, _V10, None),
  "all_to_all_start": (INDEPENDENT, _V10, None),
  "all_to_all_done": (INDEPENDENT, _V10, None),
  "ppermute_start": (INDEPENDENT, _V10, None),
  "ppermute_done": (INDEPENDENT, _V10, None),
  "psum_done": (INDEPENDENT, _V10, None),
  "psum_invariant_start": (INDEPENDENT, _V10, None),
  "reduce_scatter_start": (INDEPENDENT, _V10, None),
  "reduce_scatter_done": (INDEPENDENT, _V10, None),
  "philox2x32": (AS_WRITTEN, _V10, None),
  "philox4x32": (AS_WRITTEN, _V10, None),
  "threefry4x32": (AS_WRITTEN, _V10, None),
  "stage": (AS_WRITTEN, _V10, None),
  # from jax 0.11 (jnp.log2 is its own primitive there; log followed by a div before)
  "log2": (FIRST_ORDER, _V11, None),
  "one_minus_square": (FIRST_ORDER, _V11, None),
  "relayout": (LAYOUT, _V11, None),
  "unreduced_pmax": (INDEPENDENT, _V11, None),
  "unreduced_pmin": (INDEPENDENT, _V11, None),
  # jax.experimental's program_order region: opaque, it runs as written
  "program_order": (AS_WRITTEN, _V11, None),
  # from jax 0.12
  "polynomial": (FIRST_ORDER, _V12, None),
  "pbroadcast_dynamic": (INDEPENDENT, _V12, None),
  "reduced_vary_cast": (INDEPENDENT, _V12, None),
  "vary_unreduced_cast": (INDEPENDENT, _V12, None),
}

#: Higher-order primitives autocast has no rule for: it raises UnsupportedPrimitiveError
#: on them (wrap the region in ``jax_lossscale.float32`` to run it as written).
UNHANDLED = ("xla_pmap",)

_Release = tuple[int, int, int]


def jax_release() -> _Release:
  """The installed JAX's (major, minor, patch) release."""
  major, minor, patch = (int(v) for v in jax.__version_info__[:3])
  return (major, minor, patch)


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
  if name in _VERSIONED:
    _, first, until = _VERSIONED[name]
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
  for name in (*_VERSIONED, *_HANDLERS):
    first, until = _range(name)
    if first is not None or until is not None:
      out[name] = (first or OLDEST_TESTED, until)
  return out


def _all_kinds(handled: bool = True) -> dict[str, str]:
  kinds = {name: k for k, names in _KINDS.items() for name in names}
  kinds.update({row.primitive: FIRST_ORDER for row in POLICY_TABLE})
  kinds.update({name: k for name, (k, _, _) in _VERSIONED.items()})
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
