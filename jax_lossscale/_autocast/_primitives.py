"""What kind of primitive each JAX primitive is, for the autocast interpreter.

One table, keyed by the ``Primitive`` objects that JAX exports (``jax.lax.*_p`` and
``jax.extend.core.primitives``), and by name only for the primitives JAX exports no
object for (``shard_map``, ``pallas_call``, the callbacks...). Every primitive of the
installed JAX has a kind; ``tests/test_autocast_primitives.py`` fails on a name here
that is no primitive of the installed JAX, and on a primitive of JAX that has no kind
(a new primitive after an upgrade), so the table cannot drift silently.

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
  cond, shard_map, custom_jvp, custom_vjp, closed_call): rebound as the same primitive
  with every parameter, only the sub-jaxprs swapped (custom_jvp and custom_vjp are
  rebuilt through their public constructors, since their rules are traced lazily).
* ``KERNEL``: exists only inside a Pallas or Mosaic kernel body, which autocast never
  enters (the ``pallas_call`` around it runs as written).
"""

from __future__ import annotations

import jax
import jax.extend.core as jex
import jax.extend.core.primitives as _P

__all__ = (
  "AS_WRITTEN",
  "FIRST_ORDER",
  "HIGHER_ORDER",
  "INDEPENDENT",
  "KERNEL",
  "KERNEL_MODULES",
  "KIND_DESCRIPTIONS",
  "LAYOUT",
  "RULED_KINDS",
  "SCATTER",
  "NamedPrimitive",
  "by_name",
  "kind",
  "resolve",
  "table_names",
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

#: The modules whose primitives exist only inside kernel bodies: their reason for
#: ``KERNEL`` is that a ``pallas_call`` (``AS_WRITTEN``) is opaque to autocast.
KERNEL_MODULES = (
  "jax._src.pallas.mosaic",
  "jax._src.pallas.mosaic_gpu",
  "jax._src.pallas.triton",
  "jax._src.pallas.primitives",
  "jax._src.pallas.einshape",
  "jax._src.pallas.fuser.fusible_dtype",
)

_KINDS: dict[str, tuple[str, ...]] = {
  FIRST_ORDER: (
    # elementwise arithmetic and comparisons
    "abs",
    "acos",
    "acosh",
    "add",
    "add_any",
    "and",
    "asin",
    "asinh",
    "atan",
    "atan2",
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
    "cosh",
    "digamma",
    "div",
    "eq",
    "eq_to",
    "erf",
    "erf_inv",
    "erfc",
    "exp",
    "exp2",
    "expm1",
    "floor",
    "ge",
    "gt",
    "igamma",
    "igamma_grad_a",
    "igammac",
    "imag",
    "integer_pow",
    "is_finite",
    "le",
    "le_to",
    "lgamma",
    "log",
    "log1p",
    "logistic",
    "lt",
    "lt_to",
    "max",
    "min",
    "mul",
    "mulhi",
    "ne",
    "neg",
    "nextafter",
    "not",
    "or",
    "polygamma",
    "population_count",
    "pow",
    "real",
    "regularized_incomplete_beta",
    "rem",
    "round",
    "rsqrt",
    "shift_left",
    "shift_right_arithmetic",
    "shift_right_logical",
    "sign",
    "sin",
    "sinh",
    "sqrt",
    "square",
    "sub",
    "tan",
    "tanh",
    "xor",
    "zeta",
    # reductions, scans over an axis, contractions, convolutions
    "argmax",
    "argmin",
    "cumlogsumexp",
    "cummax",
    "cummin",
    "cumprod",
    "cumsum",
    "reduce_and",
    "reduce_max",
    "reduce_min",
    "reduce_or",
    "reduce_prod",
    "reduce_sum",
    "reduce_xor",
    "reduce_window_max",
    "reduce_window_min",
    "reduce_window_sum",
    "dot_general",
    "ragged_dot_general",
    "conv_general_dilated",
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
    "ormqr",
    "qr",
    "schur",
    "svd",
    "symmetric_product",
    "triangular_solve",
    "tridiagonal",
    "tridiagonal_solve",
  ),
  LAYOUT: (
    "reshape",
    "broadcast_in_dim",
    "transpose",
    "squeeze",
    "rev",
    "slice",
    "dynamic_slice",
    "dynamic_update_slice",
    "gather",
    "pad",
    "copy",
    "concatenate",
    "split",
    "select_n",
    "convert_element_type",
    "stop_gradient",
    "name",
    "zeros_like",
    "sharding_constraint",
    "layout_constraint",
    "reshard",
    "tile",
    "stack",
    "unstack",
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
    "reduced_vary_cast_p",
    "vary_unreduced_cast_p",
    "psend",
    "precv",
    "all_gather_start",
    "all_gather_done",
    "all_gather_reduced_start",
    "all_to_all_start",
    "all_to_all_done",
    "pbroadcast_start",
    "pbroadcast_done",
    "ppermute_start",
    "ppermute_done",
    "psum_start",
    "psum_done",
    "psum_invariant_start",
    "reduce_scatter_start",
    "reduce_scatter_done",
    "unreduced_psum_start",
    "unreduced_reduce_scatter_start",
    "optimization_barrier",
    "device_put",
    "sort",
    "shard_alike",
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
    "core_map",
    "mpmd_map",
    "fusible",
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
    "scaled_dot",
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
    "threefry4x32",
    "philox2x32",
    "philox4x32",
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
    "stage",
    # mutable references and boxes (their dtype is the reference's)
    "get",
    "swap",
    "addupdate",
    "new_ref",
    "empty_ref",
    "free_ref",
    "freeze",
    "accum_grad_in_ref",
    "run_state",
    "pin",
    "unpin",
    "create_linear",
    "broadcast_to",
    "box_get",
    "box_set",
    "new_box",
    "log_extend",
    "log_read",
    "new_log",
    "call_hi_primitive",
    "call_hi_primitive_linearized",
    "with_memory_space_constraint",
    "remove_memory_space",
    "eval_jaxpr",
  ),
  HIGHER_ORDER: (
    "jit",
    "closed_call",
    "call",
    "remat2",
    "scan",
    "while",
    "cond",
    "shard_map",
    "custom_jvp_call",
    "custom_vjp_call",
  ),
}


def _exported(name: str) -> jex.Primitive | None:
  attr = name.replace("-", "_") + ("" if name.endswith("_p") else "_p")
  for module in (jax.lax, _P):
    prim = getattr(module, attr, None)
    if isinstance(prim, jex.Primitive) and prim.name == name:
      return prim
  return None


def _build() -> tuple[dict[jex.Primitive, str], dict[str, str]]:
  by_object: dict[jex.Primitive, str] = {}
  by_name: dict[str, str] = {}
  for k, names in _KINDS.items():
    for name in names:
      prim = _exported(name)
      if prim is not None:
        by_object[prim] = k
      else:
        by_name[name] = k
  return by_object, by_name


_BY_OBJECT, _BY_NAME = _build()
_NAMED_OBJECTS: dict[str, jex.Primitive] = {p.name: p for p in _BY_OBJECT}


def kind(prim: jex.Primitive) -> str | None:
  """The kind of ``prim``, or ``None`` for a primitive the table does not know."""
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
    raise LookupError(f"JAX exports no primitive named {name!r}")
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


def table_names() -> dict[str, str]:
  """Every name of the table with its kind (for the drift test)."""
  return {name: k for k, names in _KINDS.items() for name in names}
