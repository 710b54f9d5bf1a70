"""The kinds of JAX primitives, and which primitive names have each, by JAX release.

The data of autocast's registry (``_primitives.py`` holds its rules, its handlers and its
lookups): the kind constants and their descriptions, the names of every primitive of each
kind that every supported JAX release defines, the primitives only some releases define
(:data:`VERSIONED`, with the first release that defines each and the first that no longer
does), the higher-order primitives autocast refuses (:data:`UNHANDLED`) and the layout
primitives that keep a value's rank (:data:`KEEPS_RANK`). ``_primitives.py``'s docstring
describes each kind; ``tests/test_autocast_primitives.py`` checks the tables against the
installed JAX.
"""

from __future__ import annotations

import jax

__all__ = (
  "AS_WRITTEN",
  "CHECKED_RELEASES",
  "FIRST_ORDER",
  "HIGHER_ORDER",
  "INDEPENDENT",
  "KEEPS_RANK",
  "KERNEL",
  "KERNEL_MODULES",
  "KINDS",
  "KIND_DESCRIPTIONS",
  "LAYOUT",
  "OLDEST_TESTED",
  "RULED_KINDS",
  "SCATTER",
  "UNHANDLED",
  "VERSIONED",
  "Release",
  "jax_release",
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


# -- the names of each kind -------------------------------------------------------------

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

#: Each kind's primitive names, defined by every supported JAX release.
KINDS: dict[str, tuple[str, ...]] = {
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
VERSIONED: dict[str, tuple[str, tuple[int, int, int], tuple[int, int, int] | None]] = {
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

#: A JAX release: (major, minor, patch).
Release = tuple[int, int, int]


def jax_release() -> Release:
  """The installed JAX's (major, minor, patch) release."""
  major, minor, patch = (int(v) for v in jax.__version_info__[:3])
  return (major, minor, patch)
