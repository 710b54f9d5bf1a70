"""The semantic mutants ``tools/mutation/mutate.py`` runs (``make mutate``).

Each :class:`Mutant` is one realistic bug: ``old`` must occur exactly once in
``file`` (the runner stops when it does not: re-sync the snippet after a
refactor), ``new`` replaces it, and ``tests`` are the pytest paths or node ids
that should catch it. ``equivalent`` is set only for a mutant that cannot
change any observable value, with the reason.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Mutant:
  name: str
  file: str
  old: str
  new: str
  tests: tuple[str, ...]
  why: str
  equivalent: str | None = None
  note: str | None = None  # for a known survivor: why it is not killed (yet)


# Test files; each mutant lists the test most likely to kill it first, since
# pytest -x stops at the first failure (a survivor runs them all).
TR = "tests/test_transform.py"
ST = "tests/test_rule_storms.py"
PR = "tests/test_rule_properties.py"
HY = "tests/test_rule_hysteresis.py"
SE = "tests/test_transform_seeds.py"
BAD = "tests/test_transform_bad_input.py"
CONF = "tests/test_torch_conformance.py"
INTEROP_TESTS = ("tests/test_torch_interop.py",)
NUM = "tests/test_numerics.py"
SK = "tests/test_skip.py"
COMP = "tests/test_transform_composition.py"
CFG = "tests/test_transform_config.py"
ONE = "tests/test_entry_points_one_decision.py"
FP8 = "tests/test_fp8.py"
CKPT = "tests/test_checkpoint.py"
FL = "tests/test_flax.py"
NNX = "tests/test_nnx.py"
CMP = "tests/test_compiled.py"
MD = "tests/test_multidevice.py"
SH = "tests/test_sharding.py"
MET = "tests/test_metrics.py"

RULE = "jax_lossscale/_scaler/_rule.py"
INTEROP = "jax_lossscale/_integrations/_torch_interop.py"
NUMERICS = "jax_lossscale/_scaler/_numerics.py"
PRODUCT = "jax_lossscale/_scaler/_product.py"
SKIP = "jax_lossscale/_scaler/_skip.py"
TRANSFORM = "jax_lossscale/_scaler/_transform.py"
LOSS = "jax_lossscale/_scaler/_loss.py"
FIND = "jax_lossscale/_scaler/_find.py"
SHARDING = "jax_lossscale/_scaler/_sharding.py"
STATE = "jax_lossscale/_scaler/_state.py"
FLAX = "jax_lossscale/_integrations/_flax.py"
ACCUMULATION = "jax_lossscale/_scaler/_accumulation.py"
METRICS = "jax_lossscale/_scaler/_metrics.py"
CHECKPOINT = "jax_lossscale/_integrations/_checkpoint.py"
SIGNALS = "jax_lossscale/_scaler/_signals.py"

MUTANTS = [
  # --- the rule -----------------------------------------------------------------
  Mutant(
    "rule-grow-eq",
    RULE,
    "grow = tracker >= c.growth_interval",
    "grow = tracker == c.growth_interval",
    (TR + "::test_growth_when_the_tracker_reaches_or_passes_the_interval", PR, ST, HY),
    "torch's `==`: a tracker loaded past the interval never grows",
  ),
  Mutant(
    "rule-grow-gt",
    RULE,
    "grow = tracker >= c.growth_interval",
    "grow = tracker > c.growth_interval",
    (ST, PR, HY, TR),
    "growth one clean step late",
  ),
  Mutant(
    "rule-growth-capped-not-blocked",
    RULE,
    "grown = jnp.where(jnp.isfinite(grown), jnp.minimum(grown, np.float32(c.max_scale)), scale)",
    "grown = jnp.minimum(grown, np.float32(c.max_scale))",
    (ST + "::test_upward_storm_never_reaches_inf", PR, TR),
    "growth past float32 capped at max_scale instead of blocked (torch keeps the scale)",
  ),
  Mutant(
    "rule-no-max-cap",
    RULE,
    "jnp.minimum(grown, np.float32(c.max_scale))",
    "grown",
    (ST + "::test_upward_storm_never_reaches_inf", PR),
    "max_scale ignored",
  ),
  Mutant(
    "rule-growth-f32-product",
    RULE,
    "grown = scale_product(scale, c.growth_factor)",
    "grown = scale * np.float32(c.growth_factor)",
    (ST + "::test_upward_storm_never_reaches_inf", PR, CONF),
    "growth in float32, not float64 rounded once (torch)",
  ),
  Mutant(
    "rule-backoff-f32-product",
    RULE,
    "scale_product(scale, c.backoff_factor)",
    "scale * np.float32(c.backoff_factor)",
    (PR, ST, CONF),
    "backoff in float32, not float64 rounded once (torch)",
  ),
  Mutant(
    "rule-tracker-not-reset-on-growth",
    RULE,
    "clean_tracker = jnp.where(grow, jnp.zeros_like(tracker), tracker)",
    "clean_tracker = tracker",
    (ST, PR, HY, TR),
    "tracker keeps counting after growth",
  ),
  Mutant(
    "rule-tracker-not-reset-on-overflow",
    RULE,
    "growth_tracker=jnp.where(finite, clean_tracker, jnp.zeros_like(tracker))",
    "growth_tracker=jnp.where(finite, clean_tracker, state.growth_tracker)",
    (PR, ST, HY, TR),
    "an overflow does not restart the clean run",
  ),
  Mutant(
    "rule-no-increment",
    RULE,
    "tracker = state.growth_tracker + one",
    "tracker = state.growth_tracker + one * 2",
    (ST, PR, TR),
    "tracker counts two per clean step",
  ),
  Mutant(
    "rule-hysteresis-not-refilled",
    RULE,
    "clean_hysteresis = jnp.where(grow, full, state.hysteresis_tracker)",
    "clean_hysteresis = state.hysteresis_tracker",
    (HY, PR),
    "hysteresis budget never refilled at growth (Megatron refills it)",
  ),
  Mutant(
    "rule-hysteresis-off-by-one",
    RULE,
    "overflow_scale = jnp.where(hysteresis <= 0, backed, scale)",
    "overflow_scale = jnp.where(hysteresis < 0, backed, scale)",
    (HY, PR),
    "hysteresis=N absorbs N overflows instead of N-1",
  ),
  Mutant(
    "rule-hysteresis-unfloored",
    RULE,
    "hysteresis = jnp.maximum(state.hysteresis_tracker - one, jnp.zeros_like(one))",
    "hysteresis = state.hysteresis_tracker - one",
    (ST, PR, HY),
    "hysteresis tracker goes negative in a storm",
  ),
  Mutant(
    "rule-no-floor",
    RULE,
    "backed = jnp.maximum(scale_product(scale, c.backoff_factor), np.float32(c.min_scale))",
    "backed = scale_product(scale, c.backoff_factor)",
    (ST, PR),
    "min_scale ignored: the scale reaches 0",
  ),
  Mutant(
    "rule-skipped-swapped",
    RULE,
    "skipped_steps=jnp.where(finite, state.skipped_steps, skipped)",
    "skipped_steps=jnp.where(finite, skipped, state.skipped_steps)",
    (ST, PR, TR),
    "clean steps counted as skipped",
  ),
  Mutant(
    "rule-consecutive-not-reset",
    RULE,
    "consecutive_skips=jnp.where(finite, jnp.zeros_like(consecutive), consecutive)",
    "consecutive_skips=jnp.where(finite, state.consecutive_skips, consecutive)",
    (ST, PR, TR),
    "a clean step does not end the run of skips",
  ),
  Mutant(
    "rule-counters-wrap",
    RULE,
    "skipped = optax.safe_int32_increment(state.skipped_steps)",
    "skipped = state.skipped_steps + 1",
    (ST + "::test_counters_saturate_instead_of_wrapping", PR),
    "counters wrap to negative at 2**31",
  ),
  Mutant(
    "rule-static-scale-moves",
    RULE,
    "  if not c.dynamic:\n    return new\n",
    "",
    (TR + "::test_static_and_disabled_scaling_keep_the_scale", PR),
    "static_loss_scale / no_loss_scale change their scale",
  ),
  Mutant(
    "rule-flag-unchecked",
    RULE,
    "if finite.dtype != jnp.bool_ or finite.shape != ():",
    "if finite.shape != ():",
    (BAD + "::test_python_float_flag_is_rejected_python_bool_accepted", TR),
    "a float flag (1.0) accepted as finite",
  ),
  # --- torch interop --------------------------------------------------------------
  Mutant(
    "interop-drop-tracker",
    INTEROP,
    "return state.replace(growth_tracker=jnp.asarray(tracker, jnp.int32))",
    "return state",
    INTEROP_TESTS,
    "from_torch_state_dict loses _growth_tracker",
  ),
  Mutant(
    "interop-export-tracker-zero",
    INTEROP,
    'sd["_growth_tracker"] = int(_host_scalar("growth_tracker", s.growth_tracker))',
    'sd["_growth_tracker"] = 0',
    INTEROP_TESTS,
    "to_torch_state_dict loses the growth tracker",
  ),
  Mutant(
    "interop-export-scale-f32-rounded-wrong",
    INTEROP,
    '{"scale": float(_host_scalar("scale", s.scale))}',
    '{"scale": float(_host_scalar("scale", s.scale)) * 1.0000001}',
    INTEROP_TESTS,
    "exported scale differs from the state's",
  ),
  Mutant(
    "interop-strict-min-scale",
    INTEROP,
    "if field.torch_key is None and getattr(c, name) != getattr(DEFAULT_CONFIG, name)",
    'if field.torch_key is None and name != "min_scale" and getattr(c, name) != getattr(DEFAULT_CONFIG, name)',
    INTEROP_TESTS,
    "strict does not refuse a min_scale torch cannot hold",
  ),
  Mutant(
    "interop-strict-max-scale",
    INTEROP,
    "if field.torch_key is None and getattr(c, name) != getattr(DEFAULT_CONFIG, name)",
    'if field.torch_key is None and name != "max_scale" and getattr(c, name) != getattr(DEFAULT_CONFIG, name)',
    INTEROP_TESTS,
    "strict does not refuse a max_scale torch cannot hold",
  ),
  Mutant(
    "interop-strict-hysteresis",
    INTEROP,
    "if field.torch_key is None and getattr(c, name) != getattr(DEFAULT_CONFIG, name)",
    'if field.torch_key is None and name != "hysteresis" and getattr(c, name) != getattr(DEFAULT_CONFIG, name)',
    INTEROP_TESTS,
    "strict does not refuse hysteresis",
  ),
  Mutant(
    "interop-strict-static",
    INTEROP,
    "if field.torch_key is None and getattr(c, name) != getattr(DEFAULT_CONFIG, name)",
    'if field.torch_key is None and name != "dynamic" and getattr(c, name) != getattr(DEFAULT_CONFIG, name)',
    INTEROP_TESTS,
    "strict does not refuse a static scale",
  ),
  Mutant(
    "interop-strict-ignored",
    INTEROP,
    "  if strict:\n    lost = [",
    "  if False:\n    lost = [",
    INTEROP_TESTS,
    "strict=True never refuses anything",
  ),
  Mutant(
    "interop-reject-0d-arrays",
    INTEROP,
    'hasattr(x, "__float__") and getattr(x, "ndim", None) == 0',
    "False",
    INTEROP_TESTS,
    "0-d torch tensors and numpy arrays rejected (torch may store tensors)",
  ),
  Mutant(
    "interop-0d-int-not-unwrapped",
    INTEROP,
    'value = x.item() if hasattr(x, "item") else x',
    "value = x",
    INTEROP_TESTS,
    "a 0-d integer tensor/array rejected as growth_interval/_growth_tracker",
  ),
  Mutant(
    "interop-accept-bool",
    INTEROP,
    '  if isinstance(x, (bool, np.bool_)) or "bool" in str(getattr(x, "dtype", "")):\n'
    "    return False  # also 0-d bool arrays and tensors (torch.bool)\n",
    "",
    INTEROP_TESTS,
    "True accepted as a scale",
  ),
  Mutant(
    "interop-accept-0d-bool",
    INTEROP,
    'if isinstance(x, (bool, np.bool_)) or "bool" in str(getattr(x, "dtype", "")):',
    "if isinstance(x, (bool, np.bool_)):",
    INTEROP_TESTS,
    "a 0-d bool array or torch.bool tensor read as scale 1.0",
  ),
  Mutant(
    "interop-accept-nonfinite",
    INTEROP,
    "  if not math.isfinite(value):\n    raise",
    "  if False:\n    raise",
    INTEROP_TESTS,
    "a NaN/inf scale from a corrupt dict accepted",
  ),
  Mutant(
    "interop-accept-negative-tracker",
    INTEROP,
    "if not 0 <= tracker <= np.iinfo(np.int32).max:",
    "if tracker > np.iinfo(np.int32).max:",
    INTEROP_TESTS,
    "a negative _growth_tracker accepted",
  ),
  Mutant(
    "interop-unknown-keys-ignored",
    INTEROP,
    "  if unknown:\n    raise",
    "  if False:\n    raise",
    INTEROP_TESTS,
    "a dict with unknown keys (not a GradScaler's) accepted",
  ),
  # --- numerics: unscaling and the check -----------------------------------------
  Mutant(
    "numerics-half-stays-half",
    NUMERICS,
    "return np.dtype(np.float32) if dtype.itemsize < 4 else dtype",
    "return np.dtype(np.float32) if dtype.itemsize < 2 else dtype",
    (TR + "::test_dtypes_of_updates_inner_state_and_unscaled", SE, CONF),
    "float16 gradients unscaled in float16 (tiny values lost)",
  ),
  Mutant(
    "numerics-f64-downcast",
    NUMERICS,
    "return np.dtype(np.float32) if dtype.itemsize < 4 else dtype",
    "return np.dtype(np.float32)",
    (BAD, TR, NUM),
    "float64 gradients silently unscaled in float32",
  ),
  Mutant(
    "numerics-no-two-step",
    NUMERICS,
    "big = scale > _TWO_STEP_THRESHOLD",
    "big = scale > np.float32(np.inf)",
    (NUM + "::test_reciprocal_around_2_to_126", CONF),
    "scales above 2**126: reciprocal flushed to 0, gradients zeroed",
  ),
  Mutant(
    "numerics-reciprocal-f32-division",
    NUMERICS,
    "return (jnp.asarray(g).astype(dt) * inv.astype(dt)) / shift.astype(dt)",
    "return jnp.asarray(g).astype(dt) / (jnp.asarray(scale, jnp.float32).astype(dt))",
    (CONF + "::test_float16_gradients_unscale_like_torchs_float32_copies", NUM),
    "divides by the scale instead of multiplying by torch's reciprocal",
  ),
  Mutant(
    "numerics-check-any",
    NUMERICS,
    "return combine_flags([jnp.all(jnp.isfinite(x)) for x in leaves])",
    "return combine_flags([jnp.any(jnp.isfinite(x)) for x in leaves])",
    (TR, BAD),
    "a leaf with one finite element counts as finite",
  ),
  Mutant(
    "numerics-check-skips-first-leaf",
    NUMERICS,
    "return combine_flags([jnp.all(jnp.isfinite(x)) for x in leaves])",
    "return combine_flags([jnp.all(jnp.isfinite(x)) for x in leaves[1:]] or [jnp.asarray(True)])",
    (TR, BAD, ST),
    "inf in the first leaf not seen",
  ),
  Mutant(
    "numerics-combine-tolerates-one",
    NUMERICS,
    "return jnp.sqrt(bad) == np.float32(0)",
    "return jnp.sqrt(bad) <= np.float32(1)",
    (TR, BAD),
    "one non-finite leaf among several passes the check",
  ),
  Mutant(
    "numerics-combine-single-flag-dropped",
    NUMERICS,
    "  if len(flags) == 1:\n    return flags[0]\n",
    "  if len(flags) == 1:\n    return jnp.asarray(True)\n",
    (TR, BAD),
    "a one-leaf gradient is never checked",
  ),
  Mutant(
    "numerics-check-scaled-values",
    NUMERICS,
    "return unscaled, all_finite(unscaled)",
    "return unscaled, all_finite(grads)",
    (TR + "::test_overflow_created_by_unscaling_is_caught", BAD),
    "overflow created by unscaling (scale < 1) not caught",
  ),
  Mutant(
    "numerics-promote-none",
    NUMERICS,
    "return jnp.asarray(x).astype(compute_dtype(jnp.result_type(x)))",
    "return jnp.asarray(x)",
    (TR + "::test_dtypes_of_updates_inner_state_and_unscaled", CFG, FL),
    "inner optimizer sees float16 params/grads (float16 state)",
  ),
  Mutant(
    "numerics-fp16-roundtrip-no-f16",
    NUMERICS,
    "return (g * scale).astype(jnp.float16).astype(jnp.float32) / scale",
    "return (g * scale) / scale",
    (SE, "--doctest-modules", NUMERICS),
    "fp16_roundtrip does not round to float16",
  ),
  # --- the scale products (float64 emulation) -----------------------------------------
  Mutant(
    "product-always-f32",
    PRODUCT,
    "if float(np.float32(factor)) == factor:",
    "if True:",
    (NUM, PR, CONF),
    "factors like 1.1 multiplied in float32 (one bit off torch)",
  ),
  Mutant(
    "product-round1-no-ties-even",
    PRODUCT,
    "up1 = (low > half) | ((low == half) & ((mid & 1) == 1))",
    "up1 = low >= half",
    (PR + "::test_rule_trajectory_equals_reference", NUM),
    "float64 rounding ties away from zero instead of to even",
  ),
  Mutant(
    "product-round2-truncates",
    PRODUCT,
    "t = t + up2.astype(jnp.int32)",
    "t = t",
    (NUM,),
    "float32 rounding truncates",
  ),
  Mutant(
    "product-no-carry",
    PRODUCT,
    "t = t + (mid >> 29)  # carry out of the 29 bits",
    "t = t",
    (NUM,),
    "carry of the first rounding lost",
  ),
  Mutant(
    "product-77bit-ignored",
    PRODUCT,
    "t = jnp.where(is77, t77, t76)",
    "t = t76",
    (NUM,),
    "products of 77 bits rounded at the wrong position",
  ),
  Mutant(
    "product-no-overflow-inf",
    PRODUCT,
    "out = jnp.where(out_biased >= 255, jnp.float32(jnp.inf), out)",
    "",
    (NUM, ST, PR),
    "overflowing products wrap to garbage instead of inf (growth not blocked)",
  ),
  Mutant(
    "product-no-round-up-to-tiny",
    PRODUCT,
    "return jnp.where(scale >= _smallest_normal_result(factor), jnp.maximum(out, tiny), jnp.float32(0))",
    "return jnp.where(scale >= _smallest_normal_result(factor), out, jnp.float32(0))",
    (NUM, ST, PR),
    "products that round up to 2**-126 in float64 -> float32 come out flushed to 0 (XLA:CPU)",
  ),
  Mutant(
    "product-reciprocal-truncates",
    PRODUCT,
    "t = t + (guard & (sticky | (t & 1)))",
    "t = t",
    (NUM, CONF),
    "the reciprocal is truncated instead of rounded to nearest",
  ),
  Mutant(
    "product-reciprocal-ties-away",
    PRODUCT,
    "t = t + (guard & (sticky | (t & 1)))",
    "t = t + guard",
    (NUM,),
    "round half away from zero instead of half to even",
    equivalent="no tie can occur: a tie needs 2**48 / m to end exactly at the guard bit, "
    "i.e. m (in [2**23, 2**24)) to divide 2**48, so m = 2**23, whose quotient 2**25 has "
    "guard bit 0; so guard == 1 implies sticky == 1 and both expressions add 1",
  ),
  Mutant(
    "product-reciprocal-no-shift",
    PRODUCT,
    "biased = 253 - exponent + jnp.asarray(shift_exponent, jnp.int32) + carry",
    "biased = 253 - exponent + carry",
    (NUM, CONF),
    "scales above 2**126 unscale by a reciprocal 2**64 too small",
  ),
  Mutant(
    "numerics-reciprocal-float-division",
    NUMERICS,
    "inv = exact_reciprocal(scale, jnp.where(big, 64, 0).astype(jnp.int32))",
    "inv = np.float32(1) / (scale / shift)",
    (NUM, CONF),
    "the reciprocal by float32 division (one bit off on XLA:GPU for ~13% of scales)",
    equivalent="on CPU only: XLA:CPU's float32 division is correctly rounded, so the values "
    "are identical there; on a GPU the CUDA conformance test (make gpu-check, "
    "tests/test_gpu.py) catches it",
  ),
  # --- the skip -------------------------------------------------------------------
  Mutant(
    "skip-positive-zero",
    SKIP,
    "return jnp.full_like(u, -0.0)",
    "return jnp.full_like(u, 0.0)",
    (TR + "::test_skipped_step_leaves_params_and_adam_state_bit_identical", SK, PR),
    "+0.0 updates turn a -0.0 param into +0.0",
  ),
  Mutant(
    "skip-applies-updates",
    SKIP,
    "out = _where(finite, new_out, old_out)",
    "out = _where(finite, new_out, new_out)",
    (TR, SK),
    "a non-finite step's updates are applied",
  ),
  Mutant(
    "skip-state-advances-unshaped",
    SKIP,
    "      return _where(finite, new, old)",
    "      return new",
    (TR, SK),
    "the inner state not shaped like the outputs (Adam's count) advances on a skipped step",
  ),
  Mutant(
    "skip-state-advances-large",
    SKIP,
    "return out, jax.tree_util.tree_map(select, new_state, old_state, is_leaf=shaped_like_out)",
    "return out, new_state",
    (TR, SK),
    "the inner state advances on a skipped step (large leaves, copy-free path)",
  ),
  Mutant(
    "skip-shaped-state-unordered-value",
    SKIP,
    "return [jnp.logical_and(finite, _order_flag(x)) for x in outs]",
    "return [_order_flag(x) for x in outs]",
    (TR, SK),
    "Adam's mu/nu of large leaves selected by the ordering flag alone (always true)",
  ),
  Mutant(
    "skip-order-flag-false",
    SKIP,
    "return (bits | 1) != 0",
    "return (bits | 1) == 0",
    (TR, SK, CMP),
    "large leaves: the state select sees a false predicate",
  ),
  Mutant(
    "skip-order-flag-value",
    SKIP,
    "return (bits | 1) != 0",
    "return bits != 0",
    (TR, SK, CMP),
    "the ordering flag depends on the value (false when the first element is +0.0)",
  ),
  Mutant(
    "skip-no-per-leaf-ordering",
    SKIP,
    "return [jnp.logical_and(finite, _order_flag(x)) for x in outs]",
    "return [finite for x in outs]",
    (CMP, TR, SK),
    "Adam's mu/nu selects not ordered after their output leaf",
  ),
  Mutant(
    "skip-int-leaves",
    SKIP,
    "    return jnp.zeros_like(u)\n",
    "    return u\n",
    (BAD, TR, COMP, SK),
    "integer updates of a skipped step applied",
  ),
  # --- the Optax wrapper ------------------------------------------------------------
  Mutant(
    "transform-no-promote-init",
    TRANSFORM,
    "inner_state=inner.init(promote_floats(params)),",
    "inner_state=inner.init(params),",
    (TR + "::test_dtypes_of_updates_inner_state_and_unscaled", CFG),
    "inner state of float16 params is float16",
  ),
  Mutant(
    "transform-inner-sees-half-params",
    TRANSFORM,
    "grads, state.inner_state, promote_floats(params), **extra_args",
    "grads, state.inner_state, params, **extra_args",
    (COMP + "::test_inner_transformation_sees_float32_params", TR, CFG),
    "the inner optimizer gets float16 params (weight decay, lookahead in float16)",
  ),
  Mutant(
    "sharding-no-placement",
    SHARDING,
    "  if mesh is None:\n    return tree\n",
    "  return tree\n",
    (SH, MD),
    "scalars of init stay on one device when the params live on a mesh",
  ),
  Mutant(
    "transform-scale-not-advanced",
    TRANSFORM,
    "new_scale = update_scale(state.loss_scale, finite)",
    "new_scale = update_scale(state.loss_scale, jnp.asarray(True))",
    (TR, CFG),
    "the scale never backs off",
  ),
  Mutant(
    "transform-update-dtype-of-grad",
    TRANSFORM,
    "    if jnp.result_type(param).itemsize > dtype.itemsize:\n      dtype = jnp.result_type(param)\n",
    "    pass\n",
    (CFG, TR, COMP),
    "float32 params get float16 updates (small updates rounded away)",
  ),
  Mutant(
    "transform-update-dtype-inner",
    TRANSFORM,
    "new_updates = _cast_updates(new_updates, updates, params)",
    "",
    (TR, CFG),
    "updates come back in the inner optimizer's float32 for float16 params",
  ),
  Mutant(
    "transform-config-unchecked",
    TRANSFORM,
    "    _check_state(state, config)\n",
    "",
    (CFG, TR),
    "a state from another configuration silently used",
  ),
  Mutant(
    "transform-pmap-flag-local",
    SHARDING,
    "  bad = across_axis(jax.lax.psum, (~finite).astype(jnp.int32), axis_name)\n  return bad == 0",
    "  return finite",
    (MD, SH),
    "under pmap/shard_map each device skips on its own overflow only",
  ),
  Mutant(
    "transform-scale-loss-half",
    LOSS,
    "return loss.astype(dt) * scale.astype(dt)",
    "return loss * scale.astype(loss.dtype)",
    (TR + "::test_scale_loss_promotes_half_precision", SE),
    "float16 loss times 65536 overflows",
  ),
  Mutant(
    "state-weak-scale",
    STATE,
    "scale=jnp.asarray(np.float32(config.init_scale), jnp.float32),",
    "scale=jnp.asarray(config.init_scale),",
    (TR + "::test_no_recompilation_and_no_dtype_drift", BAD),
    "a weak-typed initial scale retraces the second step",
  ),
  # --- Flax glue ----------------------------------------------------------------------
  Mutant(
    "flax-step-always-advances",
    FLAX,
    "step=jnp.where(finite, optax.safe_int32_increment(self.step), self.step),",
    "step=optax.safe_int32_increment(self.step),",
    (FL, NNX),
    "TrainState.step advances on a skipped step",
  ),
  Mutant(
    "flax-params-not-selected",
    FLAX,
    "finite, new_params, self.params, new_opt_state, self.opt_state",
    "finite, new_params, new_params, new_opt_state, self.opt_state",
    (FL, NNX),
    "TrainState applies a non-finite step to its params",
  ),
  Mutant(
    "flax-scale-not-advanced",
    FLAX,
    "dynamic_scale=update_scale(self.dynamic_scale, finite),",
    "dynamic_scale=self.dynamic_scale,",
    (FL, NNX),
    "TrainState's scale never changes",
  ),
  Mutant(
    "flax-grads-not-unscaled",
    FLAX,
    "return unscale_and_check(leaves, dynamic_scale.scale)",
    "return unscale_and_check(leaves, 1.0)",
    (FL, NNX),
    "value_and_grad returns scaled gradients",
  ),
  Mutant(
    "flax-no-pmean",
    FLAX,
    "leaves = across_axis(jax.lax.pmean, leaves, axis_name)",
    "",
    (FL + "::test_value_and_grad_axis_name_skips_on_every_device", MD),
    "axis_name ignored: devices disagree on the skip",
  ),
  Mutant(
    "flax-apply-in-half",
    FLAX,
    "return (p.astype(dt) + jnp.asarray(u).astype(dt)).astype(p.dtype)",
    "return (p + jnp.asarray(u).astype(p.dtype)).astype(p.dtype)",
    (COMP + "::test_trainstate_adds_float32_updates_to_float16_params_once", FL, SK),
    "float16 params updated in float16 arithmetic (the update rounded twice)",
  ),
  Mutant(
    "flax-finite-default-true",
    FLAX,
    "      finite = all_finite(gradient_leaves(grads))\n",
    "      finite = jnp.asarray(True)\n",
    (FL + "::test_trainstate_computes_finite_when_not_given", MET),
    "apply_gradients without finite= applies non-finite steps",
  ),
  Mutant(
    "flax-tx-init-unpromoted",
    FLAX,
    "opt_state = place_like_params(tx.init(promote_floats(params_with_opt)), params_with_opt)",
    "opt_state = place_like_params(tx.init(params_with_opt), params_with_opt)",
    (FL, NNX),
    "TrainState's optimizer state is float16 for float16 params",
  ),
  # --- accumulation -----------------------------------------------------------------
  Mutant(
    "accumulation-stock-multisteps",
    ACCUMULATION,
    "lambda a: jnp.where(fresh, jnp.zeros_like(a), a), state.acc_grads",
    "lambda a: a, state.acc_grads",
    (COMP, "--doctest-modules", ACCUMULATION),
    "NaN stays in the accumulator after an overflow (stock optax.MultiSteps)",
  ),
  Mutant(
    "accumulation-reset-wrong-step",
    ACCUMULATION,
    "fresh = state.mini_step == 0",
    "fresh = state.mini_step == 1",
    (COMP, "--doctest-modules", ACCUMULATION),
    "the accumulator is zeroed in the middle of an accumulation",
  ),
  # --- issue 19: the gaps an outside reviewer's mutants found ---------------------------
  Mutant(
    "static-ignores-axis-name",
    TRANSFORM,
    'config = DynamicScaleConfig(init_scale=check_init_scale(scale, "scale"), dynamic=False)\n'
    "  return _loss_scale_transform(inner, config, axis_name)",
    'config = DynamicScaleConfig(init_scale=check_init_scale(scale, "scale"), dynamic=False)\n'
    "  return _loss_scale_transform(inner, config, None)",
    (ONE,),
    "static_loss_scale / no_loss_scale under pmap/shard_map: each device skips alone",
  ),
  Mutant(
    "no-loss-scale-drops-axis-name",
    TRANSFORM,
    "return static_loss_scale(inner, 1.0, axis_name=axis_name)",
    "return static_loss_scale(inner, 1.0)",
    (ONE + "::test_every_device_skips_together_with_axis_name",),
    "no_loss_scale ignores axis_name",
  ),
  Mutant(
    "trainstate-vag-drops-axis-name",
    FLAX,
    "fun, self.dynamic_scale, argnums=argnums, has_aux=has_aux, axis_name=axis_name",
    "fun, self.dynamic_scale, argnums=argnums, has_aux=has_aux",
    (ONE + "::test_every_device_skips_together_with_axis_name",),
    "TrainState.value_and_grad ignores axis_name: no pmean, each device decides alone",
  ),
  Mutant(
    "trainstate-tx-sees-half-params",
    FLAX,
    "promote_floats(grads_with_opt), self.opt_state, promote_floats(params_with_opt)",
    "promote_floats(grads_with_opt), self.opt_state, params_with_opt",
    (COMP + "::test_trainstate_hands_tx_float32_params",),
    "TrainState.apply_gradients hands tx float16 params (weight decay in float16)",
  ),
  Mutant(
    "check-state-torch-fields-only",
    TRANSFORM,
    'if name != "init_scale" or not config.dynamic',
    'if name in ("growth_factor", "backoff_factor", "growth_interval", "dynamic")',
    ("tests/test_config_fields.py::test_a_state_differing_in_any_one_field_is_refused_naming_it",),
    "a state with another hysteresis, min_scale or max_scale is used silently",
  ),
  Mutant(
    "check-state-revalidates",
    TRANSFORM,
    "held = state.loss_scale.config\n",
    "held = dataclasses.replace(state.loss_scale.config, init_scale=config.init_scale)\n",
    (CFG + "::test_a_state_whose_min_scale_is_above_this_init_scale_names_both_configs",),
    "the state's config re-validated with this init_scale: a misleading init_scale error",
  ),
  Mutant(
    "pinned-band-rejected",
    STATE,
    "if not self.min_scale <= float(np.float32(self.init_scale)) <= self.max_scale:",
    "if not self.min_scale < float(np.float32(self.init_scale)) < self.max_scale:",
    (CFG + "::test_a_pinned_band_is_accepted_and_holds_the_scale",),
    "min_scale == max_scale == init_scale rejected",
  ),
  Mutant(
    "check-int-unbounded",
    STATE,
    "if value < minimum or value > np.iinfo(np.int32).max:",
    "if value < minimum:",
    (CFG + "::test_integer_fields_stop_at_int32_max",),
    "growth_interval=2**31 passes validation and overflows int32 later",
  ),
  Mutant(
    "metadata-missing-field-is-unchanged",
    CHECKPOINT,
    "      if name not in saved[path]:\n"
    '        raise ValueError(f"metadata for {path!r} lacks the config field {name!r}.")\n'
    "      was = saved[path][name]\n",
    "      was = saved[path].get(name, now[name])\n",
    (CKPT + "::test_config_metadata_round_trips_json_exactly",),
    "check_scale_config treats a field missing from the metadata as unchanged",
  ),
  Mutant(
    "inner-state-first-of-many",
    FIND,
    "  if len(found) == 1:\n    return found[0][1]",
    "  if found:\n    return found[0][1]",
    (CFG + "::test_get_inner_state_refuses_several_loss_scale_states",),
    "get_inner_state returns the first of several loss-scale states",
  ),
  Mutant(
    "scale-loss-f64-to-f32",
    LOSS,
    "  dt = compute_dtype(loss.dtype)\n  return loss.astype(dt) * scale.astype(dt)",
    "  dt = jnp.float32\n  return loss.astype(dt) * scale.astype(dt)",
    (BAD + "::test_float64_with_x64_keeps_state_dtypes",),
    "scale_loss rounds a float64 loss to float32",
  ),
  Mutant(
    "multi-steps-drops-kwargs",
    ACCUMULATION,
    "ms = optax.MultiSteps(inner, every_k_schedule, **kwargs)",
    "ms = optax.MultiSteps(inner, every_k_schedule)",
    (COMP + "::test_multi_steps_forwards_its_keyword_arguments",),
    "multi_steps drops use_grad_mean / should_skip_update_fn",
  ),
  Mutant(
    "multi-steps-init-not-placed",
    ACCUMULATION,
    "return place_like_params(MultiStepsState(*ms.init(params)), params)",
    "return MultiStepsState(*ms.init(params))",
    (SH + "::test_multi_steps_init_places_its_counters_on_the_params_mesh",),
    "multi_steps' mini_step/gradient_step stay host-local single-device arrays",
  ),
  Mutant(
    "warnings-share-a-kind",
    SIGNALS,
    '    warn_once(\n      "multisteps",',
    '    warn_once(\n      "bfloat16",',
    (CFG + "::test_the_two_warnings_are_once_only_each_on_its_own",),
    "the stock-MultiSteps warning silenced by the bfloat16 one",
  ),
  Mutant(
    "explicitly-sharded-reads-x-sharding",
    SKIP,
    "spec = jax.typeof(x).sharding.spec",
    "spec = x.sharding.spec",
    (SH + "::test_a_large_fsdp_leaf_traced_on_an_explicit_mesh_is_seen_as_sharded",),
    "under jit every leaf looks unsharded (tracers have no .sharding)",
  ),
  Mutant(
    "fp8-meta-unscaled",
    FLAX,
    "grads, finite = map_gradients(unscale, grads, meta)",
    "grads, finite = unscale(grads)",
    (FP8,),
    "fp8 meta-state divided by the loss scale (every fp8 scale 1/1024 after a step)",
  ),
  Mutant(
    "fp8-meta-checked",
    FLAX,
    "      finite = all_finite(gradient_leaves(grads))\n",
    "      finite = all_finite(grads)\n",
    (FP8 + "::test_an_inf_in_the_fp8_meta_is_not_an_overflow",),
    "an inf in an fp8 amax history skips the step",
  ),
  Mutant(
    "fp8-meta-reaches-optax",
    TRANSFORM,
    "    if has_fp8_meta(updates):\n      raise ValueError(",
    "    if False:\n      raise ValueError(",
    (FP8 + "::test_the_optax_wrappers_refuse_fp8_meta",),
    "fp8 meta handed to an Optax wrapper is unscaled and applied as a gradient",
  ),
  Mutant(
    "fp8-meta-mean-across-devices",
    FLAX,
    "meta = lambda leaves: across_axis(jax.lax.pmax, leaves, axis_name)",
    "meta = lambda leaves: across_axis(jax.lax.pmean, leaves, axis_name)",
    (FP8 + "::test_fp8_meta_is_combined_with_pmax_under_axis_name",),
    "fp8 amax averaged across devices instead of the largest",
  ),
  # --- metrics ------------------------------------------------------------------------
  Mutant(
    "metrics-host-sync",
    METRICS,
    '"scale": jnp.asarray(s.scale, jnp.float32),',
    '"scale": jnp.asarray(jax.device_get(s.scale), jnp.float32),',
    (MET + "::test_metrics_and_report_do_not_wait_for_the_device",),
    "metrics reads the scale on the host (waits for the step)",
  ),
]


#: Generated mutants (``tools/mutation/mutagen.py``) that no test can tell from the
#: original, by name, with the reason.
EQUIVALENT: dict[str, str] = {
  "_guard:check_skips:drop-kwarg:separator:a020": (
    "only the layout of a batched scale inside the LossScaleError message ('[1., 2.]' vs "
    "'[1. 2.]'); no value, no control flow"
  ),
  "_metrics:nonfinite_leaves.leaf:if-false:4dea": (
    "an integer or boolean leaf then goes through logical_not(all(isfinite(g))), which is "
    "False for every integer/bool array: the same bool scalar as the fallback's"
  ),
  "_numerics:compute_dtype:cmp-nonstrict:9f12": (
    "`itemsize <= 4` also maps 4-byte dtypes to float32; the only 4-byte float is float32"
  ),
  "_numerics:reciprocal:cmp-nonstrict:fe2b": (
    "at exactly scale == 2**126 both paths are exact: 1/2**126 is a normal float32, and "
    "2**64/2**126 then / 2**64 multiplies by the same power of two, one rounding each"
  ),
  "_numerics:combine_flags:if-false:b057": (
    "a single flag through the sum/sqrt combination gives the same bool (a fast path for one leaf)"
  ),
  "_numerics:combine_flags:reduce:sum->max:03ba": (
    "the flags are 0/1: max == 0 exactly when sum == 0, so sqrt(.) == 0 is the same AND"
  ),
  "_product:_bits:no-bound:a933": (
    "limbs are masked to _LIMB bits, so bits above a limb's width are zero: taking hi "
    "instead of the limb's end adds only zero bits"
  ),
  "_product:_bits:cmp-strict:1aa2": (
    "a == b gives an empty bit range, a piece of (1 << 0) - 1 = 0: adding it changes nothing"
  ),
  "_product:_exact_product:if-false:cdf2": "skipping zero limbs is a fast path: s * 0 adds 0 to the column",
  "_product:_exact_product:cmp-strict:2a73": (
    "out_biased == 0 means a product below 2**-126; scale_product, the only caller, returns "
    "0 there (scale < the smallest scale with a normal product), whatever this gives"
  ),
  "_product:scale_product:cmp-negate:1d25": (
    "the exact integer emulation is exact for every factor: for float32-representable "
    "factors it gives the float32 product (the fast path's result)"
  ),
  "_product:scale_product:if-false:d131": "as _product:scale_product:cmp-negate:1d25: the exact path for every factor",
  "_product:_smallest_normal_result:drop-kwarg:over:4e6a": (
    "np.errstate only silences numpy's overflow RuntimeWarning in the host-side bisection "
    "(the product of the largest float32 and a growth factor is inf either way)"
  ),
  "_product:exact_reciprocal:cmp-strict:2248": (
    "rem == m only for a power-of-two scale (m = 2**23); the strict test then produces "
    "q - 1 with a nonzero remainder (0.0111... instead of 0.1000...), which the sticky bit "
    "rounds to the same float32"
  ),
  "_product:exact_reciprocal:cmp-strict:2248#2": "as _product:exact_reciprocal:cmp-strict:2248 (the same long division, later bits)",
  # _autocast/ (_interpreter, _values, _higher_order, _api)
  "_promotion:promote:if-false:a5eb": (
    "with fewer than two float operands every declared-dtype group has one member, so the "
    "loop below skips each (fewer than two dtypes in the group) and returns the operands "
    "unchanged: a fast path"
  ),
  "_values:cast_to_declared:if-true:364f": (
    "autocast casts only floats, so a non-float value already has its declared dtype and "
    "cast returns it unchanged; every jaxpr value has a dtype (no tokens reach a loop "
    "carry or a float32 region)"
  ),
  # _diagnostics/_underflow
  "_underflow:check_underflow.to32:if-false:6286": (
    "to32 then also takes non-float leaves through jnp.asarray and casts those narrower than "
    "4 bytes (int8/int16/uint8/bool) to float32 for the reference; but check_underflow "
    "differentiates every leaf of the same variables with jax.grad in the half backwards too, "
    "which raises the same TypeError ('grad requires real- or complex-valued inputs ... got "
    "int8') for any non-inexact leaf (ints, bools, keys), only one grad call later; complex "
    "leaves (itemsize >= 8) are not cast either way and are not counted (not floats)"
  ),
  # _skip, _sharding
  "_skip:skipped_updates:drop-kwarg:is_leaf:6c50": (
    "without is_leaf a None update is an empty subtree, which tree_map keeps as None: what "
    "skip returns for it"
  ),
  "_skip:skipped_updates.skip:if-true:386f": (
    "for an integer or boolean update full_like(u, -0.0) is zeros_like(u) (-0.0 converts to "
    "0 and False); complex gradients are refused before any update exists (refuse_complex)"
  ),
  "_skip:_where:drop-kwarg:is_leaf:18fb": (
    "every caller's old tree has a None wherever new has one (old_out is skipped_updates of "
    "new_out or the params new_out was computed from; old_state has new_state's structure), "
    "so without is_leaf both are matching empty subtrees and the result keeps None"
  ),
  "_skip:_predicates:if-false:b243": (
    "with no large leaf, platform_dependent over an empty list returns an empty list and "
    "every predicate stays finite: the early return is a fast path"
  ),
  "_sharding:all_devices_finite:if-false:5b97": (
    "across_axis is the identity for axis_name=None, so the psum branch gives "
    "(~finite).astype(int32) == 0, which is finite"
  ),
  "_interpreter:Interpreter.eval_jaxpr.read:if-false:b3d8": (
    "in jax 0.10 every Literal's val has a dtype (DynamicJaxprTrace._new_const asserts its "
    "constants are canonical: TypedNdArray or Array, never Python or NumPy scalars; none of "
    "the 193 literals the autocast tests evaluate lacks one): the np.asarray branch guards "
    "jax versions whose literals hold Python scalars"
  ),
  "_interpreter:Interpreter.eval_jaxpr.read:drop-kwarg:dtype:e977": (
    "as _interpreter:Interpreter.eval_jaxpr.read:if-false:b3d8: that branch never runs in jax 0.10"
  ),
  "_interpreter:Interpreter.eval_jaxpr:if-true:3a4c": (
    "every outvar is a Var (DropVar is a subclass); a DropVar is never read (it is never an "
    "eqn invar or a jaxpr outvar), so the extra env entry is unobservable"
  ),
  "_composite:_marker_call:if-false:7ca2": (
    "rebuild puts the dynamic leaves back at dyn_idx over the template, so a template that "
    "also holds them gives the same call (it only keeps those arrays alive with the entry)"
  ),
  "_composite:_marker_call:if-true:c040": (
    "primary is None for every rule but float32_compute, and the primary position is read "
    "for that rule only (_restore_primary, _transformed); what it becomes otherwise (the "
    "position of a keyword array, or None) changes the marker's name and nothing it computes"
  ),
  "_composite:_marker_call.traced:if-true:126f": (
    "`traced` is alive while it runs (jit holds it), so its weak reference never returns None there"
  ),
  "_composite:_register.forget:if-true:6499": (
    "the guard only matters if another call were registered under the dead jaxpr's id "
    "before its callback ran; a weakref's callback runs while its referent is freed, "
    "before that memory (so that id) can be reused, so the entry found is always its own"
  ),
  "_api:_jit_arrays:if-true:cd22": (
    "nothing is ever stored under the key None (the store is guarded by key is not None), "
    "so cache.get(None) is None, as the original's fallback"
  ),
  "_custom:custom_vjp.bwd_rule:if-false:91b2": (
    "a zero or integer cotangent is then the instantiated zeros of the argument's dtype "
    "instead of None: custom_vjp treats None as zeros and turns an integer zero array for an "
    "integer argument into float0, the same cotangents (checked by experiment: float and "
    "int arguments, allow_int)"
  ),
  # _state, _transform, _integrations/_flax
  "_transform:_cast_updates:drop-kwarg:is_leaf:be56": (
    "without is_leaf a None gradient is an empty subtree that tree_map keeps as None, which "
    "is what the lambda gives it"
  ),
  "_flax:_apply_updates.apply:drop-kwarg:key:26ff": (
    "compute_dtype gives float32 or float64 only, and numpy orders those two dtypes as their "
    "itemsizes do (float64 > float32), so max picks the same dtype"
  ),
  "_flax:_apply_updates:drop-kwarg:is_leaf:816c": (
    "params is the first tree: without is_leaf a None param is an empty subtree (updates has "
    "None there too) kept as None, and a param whose update is None still reaches apply, "
    "which returns it"
  ),
  # session 10: _attention, _composite, _higher_order
  "_attention:attention.xla:drop-kwarg:implementation:78d7": (
    'this branch only sees implementation None or "xla" ("cudnn" returns before it), and jax\'s dot_product_attention makes the same XLA call for both'
  ),
  "_attention:attention.cpu:drop-kwarg:implementation:1b97": (
    'as _attention:attention.xla:drop-kwarg:implementation:78d7: None and "xla" run the same XLA implementation'
  ),
  "_composite:_marker_call:drop-kwarg:keep_unused:aaec": (
    "keep_unused only decides whether lowering drops unused arguments from a compiled call: the traced marker keeps all its invars either way, and the interpreter never lowers a marker except to evaluate it as written (the same values)"
  ),
  "_composite:_marker_call:drop-kwarg:keep_unused:d229": (
    "as _composite:_marker_call:drop-kwarg:keep_unused:aaec, and it runs only in the re-trace for a JAX that names the jit before tracing its body"
  ),
  "_composite:_marker_call:if-false:0f5f": (
    "jax 0.10 and 0.12 name a traced jit's equation after tracing its body, so fun_name is already the marker's final name and the re-trace never runs; it is there for a JAX that names the jit first (test_a_jax_that_names_the_marker_first_gets_a_marker_traced_again hides fun_name, and the first trace is right either way)"
  ),
  "_composite:_marker_call:if-true:65cc": (
    "the marker traced again under a jit named from the start has the same name and computation and is registered in its place: it costs only a second trace"
  ),
  "_composite:_marker_call:cmp-negate:7042": (
    "fun_name always equals the marker's name here, so this re-traces every marker (as _composite:_marker_call:if-true:65cc) and skips the re-trace only where the monkeypatched test hides fun_name (where the first trace is right)"
  ),
  "_loops:_scan_layout:cmp-negate:6f5f": (
    "jax 0.10's scan has num_consts, so both spellings read it; on jax 0.12 (ft_in) tests/autocast/test_rules_loops.py::test_a_scan_whose_body_holds_a_constant_takes_it_as_a_leading_const kills it"
  ),
  "_loops:_scan_layout:if-true:c455": (
    "as _loops:_scan_layout:cmp-negate:6f5f: the ft_in branch runs on jax >= 0.11 only, where the same test kills it"
  ),
  "_loops:_scan_with_leading_consts:cmp-negate:175b": (
    "as _loops:_scan_layout:cmp-negate:6f5f (jax >= 0.11's ft_in branch; killed there by the same test)"
  ),
  "_loops:_scan_with_leading_consts:if-true:60a7": (
    "as _loops:_scan_layout:cmp-negate:6f5f (jax >= 0.11's ft_in branch; killed there by the same test)"
  ),
  "_loops:_scan_with_leading_consts:cmp-negate:1e94": (
    "as _loops:_scan_layout:cmp-negate:6f5f (jax >= 0.11's ft_in branch; killed there by the same test)"
  ),
  "_loops:_scan_with_leading_consts:drop-kwarg:ft_in:ec62": (
    "as _loops:_scan_layout:cmp-negate:6f5f (jax >= 0.11's ft_in branch; killed there by the same test)"
  ),
  "_loops:_scan_with_leading_consts:if-false:7d01": (
    "with k == 0 the jax 0.10 branch adds 0 consts and an empty linear prefix, the same params; on jax 0.12 tests/autocast/test_rules_loops.py::test_a_rebound_scan_keeps_its_parameters kills it"
  ),
  "_custom:custom_vjp.bwd_rule.flat_bwd:if-false:b469": (
    "the logs branch runs on jax >= 0.11 only (custom_vjp.defvjp_with_logs); tests/autocast/test_rules_custom.py::test_a_custom_vjps_backward_rule_runs_under_the_policy kills it there"
  ),
  "_custom:custom_vjp.bwd_rule.flat_bwd:raise-to-pass:da9a": (
    "as _custom:custom_vjp.bwd_rule.flat_bwd:if-false:b469; tests/autocast/test_rules_custom.py::test_a_custom_vjp_whose_backward_rule_returns_logs_is_refused kills it on jax >= 0.11"
  ),
  "_loops:_scan_with_leading_consts:if-false:e518": (
    "scan has no `linear` parameter in jax 0.10 or 0.12 (0.12 takes the ft_in branch), so that line never runs"
  ),
  "_calls:jit:if-true:040b": (
    "with no constants, k = 0 and every parameter is rebuilt as an equal tuple"
  ),
  "_calls:jit:if-true:1007": ("jit's equation always has in_layouts (jax 0.10 and 0.12)"),
  "_calls:jit:if-true:ab19": ("jit's equation always has donated_invars (jax 0.10 and 0.12)"),
  "_calls:_unspecified:if-true:9db6": (
    "UNSPECIFIED is JAX's only UnspecifiedValue instance, so the one found is the one imported"
  ),
  "_loops:scan:if-false:aeef": (
    "the body gives its carries as Val(c), so their facts are NO_FACTS either way"
  ),
  "_branches:_common_consts:if-false:6da5": (
    "with no constants, re-tracing each branch through jaxpr_as_fun gives the same jaxpr (compared, with the HLO names, under nested scopes, jit and checkpoint on jax 0.10 and 0.12)"
  ),
  # session 10: _policy, _primitives, _registrations
  "_policy:nearest:drop-kwarg:cutoff:cbd9": ("0.6 is difflib.get_close_matches' default cutoff"),
  "_policy:nearest:drop-kwarg:n:aaba": ("3 is difflib.get_close_matches' default n"),
  "_registry:_exported:if-false:7962": (
    "no registry name ending in _p (mosaic_gpu_p, reduced_vary_cast_p, vary_unreduced_cast_p) is exported by jax.lax or jax.extend.core.primitives, and a user key such as exp_p fails the prim.name == name check either way"
  ),
  "_registry:by_name:if-true:4088": (
    "stand-ins are only ever looked up by name (kind() through _BY_NAME, the interpreter through the policy by name), never by identity, so a fresh stand-in per call changes nothing"
  ),
  "_registrations:_method.make:if-false:7102": (
    "only the float32_compute registration (Equinox BatchNorm) uses primary, and it passes primary=1; op_wrapper ignores primary for every other rule"
  ),
  "_registrations:_nnx.make.split_call:if-true:727f": (
    "`before` is used only when stats is True, and `if not stats: return out` comes first"
  ),
  "_registrations:_nnx.make.split_call:reduce:any->all:9135": (
    "NNX BatchNorm, the only stats=True registration, writes both of its BatchStat leaves (mean, var) in training and neither in evaluation, so any and all agree"
  ),
  "_registrations:_nnx.make.method:if-false:a28a": (
    "with autocast off (inside an op) the op calls split_call directly: split, merge, the same call, the statistics written back with nnx.update; the same output and module state"
  ),
  "_registrations:_Static.__eq__:cmp-negate:2fe5": (
    "a _Static is only a static leaf of an op's template, held in its marker's closure; nothing compares two of them (each call makes a new marker jit, and autocast's own cache never sees one)"
  ),
  "_registrations:_linen.make.apply_call:drop-kwarg:method:301a": (
    "every linen registration is __call__, which is apply's default method, and the installed wrapper calls the original with autocast off inside the op"
  ),
  "_registrations:_linen.make.method:drop-kwarg:parent:08be": (
    "Module.apply re-parents the module it runs (module.clone(parent=scope, _deep_clone=True)), so the clone's parent is never used"
  ),
  "_registrations:_resolve:if-false:e726": (
    "when the module is None, getattr(None, p, None) and hasattr(None, attr) find nothing, so it still returns None"
  ),
  # session 10: _interpreter
  "_loops:_scan_with_trailing_xs:if-false:d425": (
    "with m == 0 the jax 0.10 branch appends no linear flags, the same params; on jax 0.12 (ft_in) tests/autocast/test_rules_loops.py::test_a_rebound_scan_keeps_its_parameters kills it (an empty pack nested into the scan's flat tree)"
  ),
  "_loops:_scan_with_trailing_xs:if-true:8441": (
    "on jax 0.10 scan has no `linear` parameter, so both branches return its params unchanged (no ft_in either); on jax 0.12 (ft_in) tests/test_underflow_scan.py::test_each_iteration_is_checked_as_its_unrolled_block kills it (the taps are missing from the scan's flat tree)"
  ),
  "_loops:_scan_with_trailing_xs:cmp-negate:175b": (
    "as _loops:_scan_with_trailing_xs:if-true:8441"
  ),
  "_loops:_scan_with_trailing_xs:if-true:60a7": ("as _loops:_scan_with_trailing_xs:if-true:8441"),
  "_loops:_scan_with_trailing_xs:cmp-negate:1e94": (
    "as _loops:_scan_with_trailing_xs:if-true:8441"
  ),
  "_loops:_scan_with_trailing_xs:drop-kwarg:ft_in:8665": (
    "as _loops:_scan_with_trailing_xs:if-true:8441"
  ),
  "_loops:_scan_with_trailing_xs:cmp-negate:f078": (
    "scan has no `linear` parameter in jax 0.10 or 0.12 (0.12 takes the ft_in branch), so the line never changes what runs"
  ),
  "_loops:_scan_with_trailing_xs:if-false:e518": (
    "scan has no `linear` parameter in jax 0.10 or 0.12 (0.12 takes the ft_in branch), so the line never changes what runs"
  ),
  "_loops:_scan_with_trailing_xs:if-true:fd3c": (
    "scan has no `linear` parameter in jax 0.10 or 0.12 (0.12 takes the ft_in branch), so the line never changes what runs"
  ),
  "_loops:_scan_with_trailing_xs:drop-kwarg:linear:b8eb": (
    "scan has no `linear` parameter in jax 0.10 or 0.12 (0.12 takes the ft_in branch), so the line never changes what runs"
  ),
  "_underflow:_half_compute_outputs:reduce:sum->max:6fff": (
    "dot_general and conv_general_dilated have one output each: the max of its one flag is the flag"
  ),
  "_taps:Taps.add:if-true:b682": (
    "a tap outside every scan gets loops[name] = (), and each reader treats () as no entry: Taps.loop's `(k, length) in loops.get(n, ())` is False either way, and per_iteration(name, ()) gives [(name, ())], the rows of an unlooped tap"
  ),
  "_taps:_in_loops:if-false:211d": (
    "with no frames the loop adds nothing and the stack comes back as it is: `_scopes` joins scope names with '/', so it neither starts nor ends with one for strip('/') to remove"
  ),
  "_taps:_in_loops:if-false:bdda": (
    "every scan the interpreter taps is entered with an empty scope (it traces each body again without the scopes around it: tap names inside jit, checkpoint and scan lose their outer scopes, a known issue), so `outer` is '' and the branch appends nothing; it matters once outer scopes are kept"
  ),
  "_promotion:keep_lowp:if-false:b125": (
    "lowp is read only by _bias_target and by cond's output rule, and both check dtype == interp.dtype themselves: a value that kept lowp wrongly is never the half side of a mixed-dtype bias add"
  ),
  "_registry:lookup:if-true:a651": (
    "_BY_NAME holds only the names JAX exports no object for and _NAMED_OBJECTS only the names it does: a namesake of an exported primitive (a kernel's `gather`) finds nothing in _BY_NAME either way and gets the unknown rule"
  ),
  "_registry:defined_in:if-false:6e6c": (
    "defined_in is only asked about declared names (table_names, the drift tests, the guide's tables), for which `found` is never None"
  ),
  "_layout:zeros_like:drop-kwarg:follows:1e52": (
    "JAX's zeros_like primitive (ad_util.zeros_like_p) has no abstract-evaluation rule in jax 0.10 or 0.12 (binding it raises NotImplementedError), so no jaxpr holds it and its rule never runs"
  ),
  "_layout:zeros_like:drop-kwarg:keeps_rank:5263": (
    "as _layout:zeros_like:drop-kwarg:follows:1e52"
  ),
  "_promotion:keep_lowp:drop-kwarg:lowp:a1de": (
    "as _interpreter:Interpreter._keep_lowp:if-false:366d"
  ),
  "_promotion:promote:if-false:9187": (
    "a declared-dtype group whose members already share one actual dtype gets that dtype from both _bias_target and _torch_promotion, and cast does nothing to a value already in it: a fast path"
  ),
  # session 10: _api
  "_api:_interpret.flat_fun:if-false:4c1e": (
    "a dynamic leaf is a tracer, never a registered function, so registered() returns it unchanged: every leaf then goes through registered(), to the same effect"
  ),
  "_api:_interpret:if-true:3d51": (
    "only check_underflow passes `follows`, and it always installs taps; without it no input has the follows fact, so the loop marks nothing"
  ),
  # session 10: _registrations (installing)
  "_registrations:_resolve:if-false:e68b": (
    "as _registrations:_resolve:if-false:e726: getattr(None, p, None) and hasattr(None, attr) find nothing, so it still returns None"
  ),
  "_registrations:_resolve:if-false:6f2a": (
    "every registered attribute exists in the jax, flax and equinox releases installed (the guard is for a release without one), so hasattr is always True here"
  ),
  "_registrations:tracing:if-false:a98d": (
    "every registered class attribute is a plain function defined on that class, for which the class's __dict__ entry and getattr give the same object"
  ),
  "_registrations:tracing:if-true:f184": (
    "a module's __dict__ holds its functions, so __dict__.get gives the same object as getattr for the module-level registrations"
  ),
  "_registrations:tracing:if-true:f4d8": (
    "a registered method is reached through its class, never held by an argument as the class's own function object, so mapping it by id too changes nothing"
  ),
  # session 10: _values
  "_values:at:if-false:519c": (
    "every equation of jax 0.10 and 0.12 has a context whose manager is set (JaxprEqnContext.manager), so `with manager` is entered either way"
  ),
  "_values:bind:if-false:ea98": (
    "jax 0.10 and later give a primitive's subfuns inside its params (get_bind_params returns a dict); the tuple branch runs only on jax 0.9 (make test-compat COMPAT=oldest)"
  ),
  "_values:bind:drop-kwarg:**:1727": (
    "as _values:bind:if-false:ea98: the line runs only on jax 0.9"
  ),
  "_values:hoist:if-false:7249": (
    "with no consts the opened jaxpr has the same invars and equations (constvars empty): an equal copy"
  ),
  # session 10: _taps, _underflow
  "_taps:_scopes:if-false:d478": (
    "on every supported JAX the name stack is a NameStack with .stack, so the `stack is None` fallback never runs"
  ),
  "_underflow:_walk_taps:if-true:6d7a": (
    "taps reach a staged region only through its inputs, so walking a region with no tap among them finds nothing to refuse"
  ),
  "_underflow:check_underflow:if-true:129d": (
    "without activations= the forced branch is tree_map(..., None), which is None, as the else branch gives"
  ),
  # session 11: the scaler's modules and the renamed mutants of the fixed code
  "_flax:TrainState.apply_gradients:if-true:af8a": (
    "split_variables(self.params)[0] is self.params unless the params themselves hold fp8 meta, and params holding fp8 meta given gradients without it fail either way, with the same pytree-structure ValueError"
  ),
  "_shared_scale:_on_floats:if-false:af19": (
    "with no floating leaf the forced path runs _scaled_backward on an empty list (the identity, a zero cotangent for the scale) and unflattens the same leaves: equal outputs and gradients"
  ),
  "_branches:_common_float:reduce:all->any:ebf5": (
    "a cond output has one declared dtype in every branch and autocast moves floats only among float16, bfloat16 and float32, so its branch dtypes are all eligible or none is, and any equals all"
  ),
  "_branches:_cast_outputs:if-false:6c4c": (
    "a fast path: when every output is already in its target dtype the re-traced branch casts nothing and computes the same outputs, so skipping the early return costs only a trace"
  ),
  "_calls:shard_map:cmp-negate:6299": (
    "with no traced equation selected the fallback runs, which evaluates the same shard_map the public constructor just traced (the fast path only swaps that body into the original equation): the same outputs and facts"
  ),
  "_calls:shard_map:cmp-negate:16a9": (
    "as _calls:shard_map:cmp-negate:6299: the outer trace is one shard_map equation, and the negated test only forces the fallback, which evaluates that same shard_map"
  ),
  "_calls:shard_map:if-true:5eae": (
    "as _calls:shard_map:cmp-negate:6299: always taking the fallback evaluates the traced shard_map, the computation the fast path binds, losing only the reuse of the original equation"
  ),
  "_calls:shard_map:cmp-negate:717e": (
    "as _calls:shard_map:cmp-negate:6299: with exactly one traced shard_map the negated test only forces the fallback, which evaluates that same shard_map"
  ),
  "_underflow:_arrays_only:if-false:302e": (
    "with no static leaf the wrapper's combine rebuilds the tree it is given (same treedef, same leaves): the loss sees equal params and the report is the same, at the cost of a re-flatten"
  ),
  "_underflow:check_underflow:if-true:40bd": (
    "without taps (no activations= and no top-level 'activations' key of a Mapping) the walk has no tap to follow and cannot raise, so forcing it only traces the loss once more"
  ),
  "_find:find_one:if-false:892f": (
    "a fast path: find_all flattens with is_leaf=is_kind, so a tree that is itself of the kind is its own one leaf and find_one returns it all the same"
  ),
  "_shared_metrics:LossScaleHooks._copy:cmp-nonstrict:46e5": (
    "_copy returns two lines above when step == self._step, so `>=` and `>` see only unequal steps"
  ),
}


#: Generated mutants whose killing test the coverage selection does not pick (their line
#: runs in hundreds of tests): these tests run first, before the selected ones.
PINNED: dict[str, tuple[str, ...]] = {
  # check_underflow's count of a hand-cast model's unchecked matmuls
  "_underflow:check_underflow:if-true:52d7": (
    "tests/test_diagnostics.py::test_flax_perturbations_count_as_activations",
  ),
  "_underflow:check_underflow:if-true:4fe6": (
    "tests/test_diagnostics.py::test_a_half_model_without_matmuls_or_convolutions_has_nothing_unchecked",
  ),
  "_underflow:UnderflowReport.verdict:if-false:5e0b": (
    "tests/test_diagnostics.py::test_known_answer_both_ways",
  ),
  # the registry's declarations run when the rooms are imported, before any test: the
  # drift tests see what they declared
  "_registry:_exported:if-true:40a8": ("tests/autocast/test_registry.py",),
  "_registry:_exported:if-false:7f10": ("tests/autocast/test_registry.py",),
  "_registry:_exported:cmp-negate:2104": ("tests/autocast/test_registry.py",),
  "_registry:register.declare:if-false:80b2": ("tests/autocast/test_registry.py",),
  "_registry:register.declare:if-true:e6fa": ("tests/autocast/test_registry.py",),
  "_registry:register.declare:cmp-negate:f650": ("tests/autocast/test_registry.py",),
  "_registry:register.declare:if-true:ef7d": ("tests/autocast/test_registry.py",),
  # the layout room's tap and rank flags: their lines run in hundreds of tests
  "_layout:_carry_taps:if-true:f247": (
    "tests/autocast/test_interpreter.py::test_a_users_tap_on_a_tiled_tapped_output_is_another_activation",
  ),
  "_layout:_moved:if-true:cdd3": (
    "tests/autocast/test_interpreter.py::test_a_row_gathered_from_a_parameter_table_is_not_a_bias",
  ),
  # the interpreter's counting inside the regions check_underflow does not tap
  "_interpreter:Interpreter.loop_taps:if-false:f12f": (
    "tests/autocast/test_untapped_regions.py::test_a_scan_inside_a_cond_takes_no_number_from_the_tapped_scans",
  ),
  "_interpreter:Interpreter.tap:if-true:a742": (
    "tests/autocast/test_untapped_regions.py::test_an_integer_matmul_inside_a_cond_is_counted_as_nothing",
  ),
  "_numerics:compute_dtype:if-true:b33b": (BAD + "::test_float64_in_process_under_enable_x64",),
  "_numerics:promote_floats.promote:cmp-negate:3fb2": (
    COMP + "::test_inner_transformation_sees_float32_params",
  ),
  "_numerics:promote_floats.promote:if-true:3903": (
    COMP + "::test_inner_transformation_sees_float32_params",
  ),
  "_numerics:promote_floats.promote:if-false:6286": (
    TR + "::test_inner_sees_integer_and_boolean_leaves_as_they_are",
  ),
  "_product:scale_product:if-true:aa53": ("tests/test_product.py",),
  "_product:_smallest_normal_result:cmp-nonstrict:dc8f": (
    "tests/test_product.py::test_a_factor_so_small_that_no_scale_gives_a_normal_product",
  ),
  "_product:_smallest_normal_result:if-false:a3d3": (
    "tests/test_product.py::test_a_factor_so_small_that_no_scale_gives_a_normal_product",
  ),
  "_rule:update_scale:if-false:5bed": (TR + "::test_static_and_disabled_scaling_keep_the_scale",),
  "_rule:update_scale:no-bound:926d": (ST + "::test_upward_storm_never_reaches_inf",),
  "_numerics:unscale_and_check.unscale:if-false:4dea": (
    TR + "::test_non_float_and_none_leaves_pass_through",
  ),
  "_product:_exact_product.rounded:cmp-negate:c1ad": (
    "tests/test_product.py::test_a_float64_tie_rounds_to_even_before_the_float32_rounding",
  ),
  # _autocast/ (_values, _higher_order)
  "_values:cast:if-false:e414": (
    "tests/autocast/test_edge_cases.py::test_a_value_already_in_the_target_dtype_keeps_its_weak_type",
  ),
  "_calls:_unspecified:cmp-negate:f8c4": (
    "tests/autocast/test_rules_calls.py::"
    "test_a_sharded_jit_whose_body_holds_a_constant_leaves_the_constant_unsharded[w_unspecified]",
  ),
  "_custom:_abstract:drop-kwarg:sharding:1d3d": (
    "tests/autocast/test_rules_custom.py::test_a_custom_vjp_backward_sees_its_residuals_sharding"
    "[AxisType.Explicit]",
  ),
  # jax_lossscale/__init__.py: its lazy `flax` runs in a fresh process (no coverage there)
  "__init__:__getattr__:if-false:ad62": (
    "tests/test_api.py::test_jls_flax_is_imported_on_first_use",
  ),
  "__init__:__getattr__:raise-to-pass:457c": (
    "tests/test_api.py::test_jls_flax_without_flax_says_what_to_install",
  ),
  # misc
  "_signals:check_gradient_dtypes:if-false:d69d": (
    CFG + "::test_bfloat16_gradients_warn_once_towards_no_loss_scale",
  ),
  "_transform:_loss_scale_transform.update_fn:if-false:e45b": (
    CFG + "::test_bfloat16_gradients_warn_once_towards_no_loss_scale",
  ),
  "_transform:_update_dtype:if-false:03b8": (
    CFG + "::test_updates_of_float16_gradients_come_back_in_the_wider_float32_param_dtype",
  ),
  # _diagnostics/_underflow
  "_underflow:UnderflowReport.total:if-true:e93f": (
    "tests/test_diagnostics.py::test_logit_gradients_flush_while_parameter_gradients_do_not",
  ),
  # _skip, _signals
  "_skip:_orderable:cmp-negate:9a87": (
    "tests/test_compiled.py::test_dynamic_loss_scale_step_has_no_state_copy",
  ),
  "_skip:_orderable:cmp-strict:d12b": (
    "tests/test_compiled.py::test_a_leaf_of_exactly_large_elements_is_ordered_and_one_fewer_is_not",
  ),
  "_signals:check_gradient_dtypes:cmp-negate:6382": (
    CFG + "::test_bfloat16_gradients_warn_once_towards_no_loss_scale",
  ),
  # _integrations: the tunix hooks and logits cast (tunix-free tests), Flax migration, torch export
  "_shared_metrics:_snapshot:no-bound:beb5": (
    "tests/test_loop_metrics.py::test_accumulation_steps_after_a_skip_log_no_retries",
  ),
  "_shared_metrics:LossScaleHooks._copy:if-false:0a30": (
    "tests/test_loop_metrics.py::test_one_copy_of_the_state_per_step",
  ),
  "_shared_metrics:LossScaleHooks._write:cmp-negate:1098": (
    "tests/test_loop_metrics.py::test_each_steps_values_are_written_right_after_its_loss",
  ),
  "_shared_metrics:LossScaleHooks._write:cmp-strict:e20d": (
    "tests/test_loop_metrics.py::test_each_steps_values_are_written_right_after_its_loss",
  ),
  "_shared_metrics:LossScaleHooks.on_eval_step_start:cmp-negate:c580": (
    "tests/test_loop_metrics.py::test_the_trainers_own_hooks_keep_running",
  ),
  "_shared_metrics:LossScaleHooks.on_eval_step_start:if-false:61c8": (
    "tests/test_loop_metrics.py::test_the_trainers_own_hooks_keep_running",
  ),
  "_shared_metrics:LossScaleHooks.on_eval_step_start:if-true:023e": (
    "tests/test_loop_metrics.py::test_no_hooks_of_the_trainers_own",
  ),
  "_shared_metrics:LossScaleHooks.on_eval_step_end:cmp-negate:c580": (
    "tests/test_loop_metrics.py::test_the_trainers_own_hooks_keep_running",
  ),
  "_shared_metrics:LossScaleHooks.on_eval_step_end:if-false:61c8": (
    "tests/test_loop_metrics.py::test_the_trainers_own_hooks_keep_running",
  ),
  "_shared_metrics:LossScaleHooks.on_eval_step_end:if-true:023e": (
    "tests/test_loop_metrics.py::test_no_hooks_of_the_trainers_own",
  ),
  "_shared_scale:cast_logits:if-false:23f2": (
    "tests/test_loop_you_do_not_own.py::test_output_dtype_casts_a_floating_first_output_of_any_shape_of_output",
  ),
  "_shared_scale:cast_logits:if-true:13c3": (
    "tests/test_loop_you_do_not_own.py::test_output_dtype_casts_a_floating_first_output_of_any_shape_of_output",
  ),
  "_shared_scale:cast_logits:if-true:5c3f": (
    "tests/test_loop_you_do_not_own.py::test_output_dtype_casts_a_floating_first_output_of_any_shape_of_output",
  ),
  "_shared_scale:cast_logits:if-false:f281": (
    "tests/test_loop_you_do_not_own.py::test_output_dtype_casts_a_floating_first_output_of_any_shape_of_output",
  ),
  "_shared_scale:_scaled_class:if-true:9079": (
    "tests/test_loop_you_do_not_own.py::test_one_class_per_model_class_and_output_dtype",
  ),
  "_flax_migration:_same_leaves:reduce:all->any:ebf5": (
    "tests/test_flax_migration.py::test_the_old_scale_state_with_a_field_changed_is_kept",
  ),
  "_flax_migration:checked_scale_state:reduce:all->any:801b#2": (
    "tests/test_flax_migration.py::test_stacked_scale_states_are_compared_entry_for_entry",
  ),
  "_torch_interop:to_torch_state_dict:if-true:c9c2": (
    "tests/test_config_fields.py::test_each_field_torch_lacks_is_refused_by_a_strict_export_and_dropped_otherwise",
  ),
}
