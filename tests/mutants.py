"""The semantic mutants ``tests/mutate.py`` runs (``make mutate``).

Each :class:`Mutant` is one realistic bug: ``old`` must occur exactly once in
``file`` (the runner stops when it does not: re-sync the snippet after a
refactor), ``new`` replaces it, and ``tests`` are the pytest paths or node ids
that should catch it. ``equivalent`` is set only for a mutant that cannot
change any observable value, with the reason.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple


@dataclasses.dataclass(frozen=True)
class Mutant:
  name: str
  file: str
  old: str
  new: str
  tests: Tuple[str, ...]
  why: str
  equivalent: Optional[str] = None


T = "tests/"
RULE_TESTS = (T + "test_transform.py", T + "test_storms.py", T + "test_properties.py",
              T + "test_hysteresis.py", T + "test_seeds.py")
CONFORMANCE = (T + "test_torch_conformance.py",)
INTEROP_TESTS = (T + "test_torch_interop.py",)

RULE = "jax_lossscale/_rule.py"
INTEROP = "jax_lossscale/_torch_interop.py"

MUTANTS = [
    # --- the rule -----------------------------------------------------------------
    Mutant("rule-grow-eq", RULE,
           "grow = tracker >= c.growth_interval", "grow = tracker == c.growth_interval",
           RULE_TESTS, "torch's `==`: a tracker loaded past the interval never grows"),
    Mutant("rule-grow-gt", RULE,
           "grow = tracker >= c.growth_interval", "grow = tracker > c.growth_interval",
           RULE_TESTS, "growth one clean step late"),
    Mutant("rule-growth-capped-not-blocked", RULE,
           "grown = jnp.where(jnp.isfinite(grown), jnp.minimum(grown, np.float32(c.max_scale)), scale)",
           "grown = jnp.minimum(grown, np.float32(c.max_scale))",
           RULE_TESTS, "growth past float32 capped at max_scale instead of blocked (torch keeps the scale)"),
    Mutant("rule-no-max-cap", RULE,
           "jnp.minimum(grown, np.float32(c.max_scale))", "grown",
           RULE_TESTS, "max_scale ignored"),
    Mutant("rule-growth-f32-product", RULE,
           "grown = scale_product(scale, c.growth_factor)",
           "grown = scale * np.float32(c.growth_factor)",
           RULE_TESTS + CONFORMANCE, "growth in float32, not float64 rounded once (torch)"),
    Mutant("rule-backoff-f32-product", RULE,
           "scale_product(scale, c.backoff_factor)", "scale * np.float32(c.backoff_factor)",
           RULE_TESTS + CONFORMANCE, "backoff in float32, not float64 rounded once (torch)"),
    Mutant("rule-tracker-not-reset-on-growth", RULE,
           "clean_tracker = jnp.where(grow, jnp.zeros_like(tracker), tracker)",
           "clean_tracker = tracker", RULE_TESTS, "tracker keeps counting after growth"),
    Mutant("rule-tracker-not-reset-on-overflow", RULE,
           "growth_tracker=jnp.where(finite, clean_tracker, jnp.zeros_like(tracker))",
           "growth_tracker=jnp.where(finite, clean_tracker, state.growth_tracker)",
           RULE_TESTS, "an overflow does not restart the clean run"),
    Mutant("rule-no-increment", RULE,
           "tracker = state.growth_tracker + one", "tracker = state.growth_tracker + one * 2",
           RULE_TESTS, "tracker counts two per clean step"),
    Mutant("rule-hysteresis-not-refilled", RULE,
           "clean_hysteresis = jnp.where(grow, full, state.hysteresis_tracker)",
           "clean_hysteresis = state.hysteresis_tracker",
           RULE_TESTS, "hysteresis budget never refilled at growth (Megatron refills it)"),
    Mutant("rule-hysteresis-off-by-one", RULE,
           "overflow_scale = jnp.where(hysteresis <= 0, backed, scale)",
           "overflow_scale = jnp.where(hysteresis < 0, backed, scale)",
           RULE_TESTS, "hysteresis=N absorbs N overflows instead of N-1"),
    Mutant("rule-hysteresis-unfloored", RULE,
           "hysteresis = jnp.maximum(state.hysteresis_tracker - one, jnp.zeros_like(one))",
           "hysteresis = state.hysteresis_tracker - one",
           RULE_TESTS, "hysteresis tracker goes negative in a storm"),
    Mutant("rule-no-floor", RULE,
           "backed = jnp.maximum(scale_product(scale, c.backoff_factor), np.float32(c.min_scale))",
           "backed = scale_product(scale, c.backoff_factor)",
           RULE_TESTS, "min_scale ignored: the scale reaches 0"),
    Mutant("rule-skipped-swapped", RULE,
           "skipped_steps=jnp.where(finite, state.skipped_steps, skipped)",
           "skipped_steps=jnp.where(finite, skipped, state.skipped_steps)",
           RULE_TESTS, "clean steps counted as skipped"),
    Mutant("rule-consecutive-not-reset", RULE,
           "consecutive_skips=jnp.where(finite, jnp.zeros_like(consecutive), consecutive)",
           "consecutive_skips=jnp.where(finite, state.consecutive_skips, consecutive)",
           RULE_TESTS, "a clean step does not end the run of skips"),
    Mutant("rule-counters-wrap", RULE,
           "return jnp.where(x < _INT32_MAX, x + 1, x)", "return x + 1",
           RULE_TESTS, "counters wrap to negative at 2**31"),
    Mutant("rule-static-scale-moves", RULE,
           "  if not c.dynamic:\n    return new\n", "",
           RULE_TESTS, "static_loss_scale / no_loss_scale change their scale"),
    Mutant("rule-flag-unchecked", RULE,
           "if finite.dtype != jnp.bool_ or finite.shape != ():",
           "if finite.shape != ():",
           RULE_TESTS + (T + "test_bad_input.py",), "a float flag (1.0) accepted as finite"),
    # --- torch interop --------------------------------------------------------------
    Mutant("interop-drop-tracker", INTEROP,
           "return state.replace(growth_tracker=jnp.asarray(tracker, jnp.int32))",
           "return state",
           INTEROP_TESTS, "from_torch_state_dict loses _growth_tracker"),
    Mutant("interop-export-tracker-zero", INTEROP,
           '"_growth_tracker": int(_host_scalar("growth_tracker", s.growth_tracker)),',
           '"_growth_tracker": 0,',
           INTEROP_TESTS, "to_torch_state_dict loses the growth tracker"),
    Mutant("interop-export-scale-f32-rounded-wrong", INTEROP,
           '"scale": float(_host_scalar("scale", s.scale)),',
           '"scale": float(_host_scalar("scale", s.scale)) * 1.0000001,',
           INTEROP_TESTS, "exported scale differs from the state's"),
    Mutant("interop-strict-min-scale", INTEROP,
           "if c.min_scale != MIN_NORMAL_F32:", "if False:",
           INTEROP_TESTS, "strict does not refuse a min_scale torch cannot hold"),
    Mutant("interop-strict-max-scale", INTEROP,
           "if c.max_scale != MAX_F32:", "if False:",
           INTEROP_TESTS, "strict does not refuse a max_scale torch cannot hold"),
    Mutant("interop-strict-hysteresis", INTEROP,
           "if c.hysteresis != 1:", "if False:",
           INTEROP_TESTS, "strict does not refuse hysteresis"),
    Mutant("interop-strict-static", INTEROP,
           "if not c.dynamic:", "if False:",
           INTEROP_TESTS, "strict does not refuse a static scale"),
    Mutant("interop-strict-ignored", INTEROP,
           "  if strict:\n    lost = []", "  if False:\n    lost = []",
           INTEROP_TESTS, "strict=True never refuses anything"),
    Mutant("interop-reject-0d-arrays", INTEROP,
           'hasattr(x, "__float__") and getattr(x, "ndim", None) == 0',
           "False",
           INTEROP_TESTS, "0-d torch tensors and numpy arrays rejected (torch may store tensors)"),
    Mutant("interop-0d-int-not-unwrapped", INTEROP,
           'value = x.item() if hasattr(x, "item") else x', "value = x",
           INTEROP_TESTS, "a 0-d integer tensor/array rejected as growth_interval/_growth_tracker"),
    Mutant("interop-accept-bool", INTEROP,
           "  if isinstance(x, (bool, np.bool_)):\n    return False\n", "",
           INTEROP_TESTS, "True accepted as a scale"),
    Mutant("interop-accept-nonfinite", INTEROP,
           "  if not math.isfinite(value):\n    raise", "  if False:\n    raise",
           INTEROP_TESTS, "a NaN/inf scale from a corrupt dict accepted"),
    Mutant("interop-accept-negative-tracker", INTEROP,
           "if not 0 <= tracker <= np.iinfo(np.int32).max:", "if tracker > np.iinfo(np.int32).max:",
           INTEROP_TESTS, "a negative _growth_tracker accepted"),
    Mutant("interop-unknown-keys-ignored", INTEROP,
           "  if unknown:\n    raise", "  if False:\n    raise",
           INTEROP_TESTS, "a dict with unknown keys (not a GradScaler's) accepted"),
]
