"""The opaque and dtype-bound primitives: they run exactly as written.

Custom calls, Pallas kernels, callbacks, bitcasts, cuDNN's fused attention, linear solves,
random bits and mutable references: their operands go back to the dtypes the function was
traced with and they run as written (no error, no cast inside).
"""

from __future__ import annotations

from typing import Any

from jax_lossscale._autocast._rules._registry import AS_WRITTEN
from jax_lossscale._autocast._rules._registry import V0_9_1
from jax_lossscale._autocast._rules._registry import V0_10
from jax_lossscale._autocast._rules._registry import V0_11
from jax_lossscale._autocast._rules._registry import Interp
from jax_lossscale._autocast._rules._registry import Name
from jax_lossscale._autocast._rules._registry import register
from jax_lossscale._autocast._values import Val
from jax_lossscale._autocast._values import bind
from jax_lossscale._autocast._values import cast_to_declared

__all__ = ("as_written",)

#: Defined by every supported JAX release.
OPAQUE = (
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
)

#: Defined by some.
OPAQUE_SINCE = (
  Name("sparse_dense_matmul", until=V0_10),
  Name("sparse_pack_nm", until=V0_10),
  Name("custom_dce_call", until=V0_10),
  Name("dce_sential", until=V0_10),
  Name("custom_transpose_call", until=V0_10),
  Name("core_map", until=V0_11),
  Name("fusible", until=V0_11),
  Name("box_get", until=V0_11),
  Name("box_set", until=V0_11),
  Name("new_box", until=V0_11),
  Name("scaled_dot", since=V0_9_1),
  Name("mpmd_map", since=V0_9_1),
  Name("empty_ref", since=V0_9_1),
  Name("free_ref", since=V0_9_1),
  Name("log_extend", since=V0_10, until=V0_11),
  Name("log_read", since=V0_10, until=V0_11),
  Name("new_log", since=V0_10, until=V0_11),
  Name("philox2x32", since=V0_10),
  Name("philox4x32", since=V0_10),
  Name("threefry4x32", since=V0_10),
  Name("stage", since=V0_10),
  Name("program_order", since=V0_11),
)


@register(AS_WRITTEN, *OPAQUE, *OPAQUE_SINCE)
def as_written(interp: Interp, eqn: Any, ins: list[Val]) -> list[Val]:
  """Opaque or dtype-bound: its operands go back to the dtypes the function was traced
  with and it runs exactly as written (no error)."""
  vals = cast_to_declared([v.x for v in ins], [v.aval for v in eqn.invars])
  return [Val(o) for o in bind(eqn, vals)]
