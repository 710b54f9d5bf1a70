"""What kind of primitive each JAX primitive is, for the autocast interpreter.

One table, keyed by the ``Primitive`` objects that JAX exports (``jax.lax.*_p`` and
``jax.extend.core.primitives``), and by name only for the primitives JAX exports no
object for (``shard_map``, ``pallas_call``, the callbacks...). Every primitive of the
installed JAX has a kind; ``tests/test_autocast_primitives.py`` fails on a name here
that is no primitive of the installed JAX, and on a primitive of JAX that has no kind
(a new primitive after an upgrade), so the table cannot drift silently. The primitives
that only some of the tested JAX versions (0.9 to 0.12) define are listed apart, each
with the versions that define it (``_VERSIONED``), and the drift test checks those
ranges too.

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
"""

from __future__ import annotations

import jax
import jax.extend.core as jex
import jax.extend.core.primitives as _P

__all__ = (
  "AS_WRITTEN",
  "CHECKED_RELEASES",
  "FIRST_ORDER",
  "HIGHER_ORDER",
  "INDEPENDENT",
  "KERNEL",
  "KERNEL_MODULES",
  "KIND_DESCRIPTIONS",
  "LAYOUT",
  "NEWEST_TESTED",
  "OLDEST_TESTED",
  "RULED_KINDS",
  "SCATTER",
  "UNHANDLED",
  "NamedPrimitive",
  "by_name",
  "defined_in",
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
  HIGHER_ORDER: (
    "jit",
    "eval_jaxpr",
    "remat2",
    "scan",
    "while",
    "cond",
    "shard_map",
    "custom_jvp_call",
    "custom_vjp_call",
  ),
}


#: The JAX releases whose primitives the table was checked against (every primitive each one
#: defines, from jax 0.9.0, the oldest supported, to the newest): tests/test_autocast_primitives.py
#: checks the installed one; docs/getting-started.md has the runs.
CHECKED_RELEASES = ((0, 9, 0), (0, 9, 1), (0, 9, 2), (0, 10, 2), (0, 11, 2), (0, 12, 0))
OLDEST_TESTED = CHECKED_RELEASES[0]
NEWEST_TESTED = CHECKED_RELEASES[-1]

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
  # jax 0.9 and 0.10 (the call primitives became eval_jaxpr in jax 0.11)
  "call": (HIGHER_ORDER, _V090, _V11),
  "closed_call": (HIGHER_ORDER, _V090, _V11),
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


def jax_release() -> tuple[int, int, int]:
  """The installed JAX's (major, minor, patch) release."""
  major, minor, patch = (int(v) for v in jax.__version_info__[:3])
  return (major, minor, patch)


def defined_in(name: str, release: tuple[int, ...]) -> bool:
  """Whether JAX ``release`` (major, minor, patch) defines the primitive ``name``."""
  if name not in _VERSIONED:
    return True
  _, first, until = _VERSIONED[name]
  return first <= tuple(release) and (until is None or tuple(release) < until)


def versioned_names() -> dict[str, tuple[tuple[int, int, int], tuple[int, int, int] | None]]:
  """The names only some JAX releases define: (the first release, the first without it)."""
  return {name: (first, until) for name, (_, first, until) in _VERSIONED.items()}


def _all_kinds() -> dict[str, str]:
  kinds = {name: k for k, names in _KINDS.items() for name in names}
  kinds.update({name: k for name, (k, _, _) in _VERSIONED.items()})
  return kinds


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
  for name, k in _all_kinds().items():
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


def table_names(release: tuple[int, ...] | None = None) -> dict[str, str]:
  """Every name of the table that JAX ``release`` (the installed one by default) defines,
  with its kind (for the drift test)."""
  release = jax_release() if release is None else release
  return {name: k for name, k in _all_kinds().items() if defined_in(name, release)}
