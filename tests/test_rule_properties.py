"""Property tests (hypothesis): random configs and sequences against a reference.

The reference is the rule written in plain Python, with numpy float64 for the
factor products rounded once to float32 (as torch's ``_amp_update_scale_``).
Each example runs one jitted ``lax.scan`` over a fixed-length sequence.
"""

from helpers import import_optional
import jax
import jax.numpy as jnp
import numpy as np
import optax

hypothesis = import_optional("hypothesis")
from hypothesis import example  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import jax_lossscale as jls  # noqa: E402

T = 48  # steps per example (static, so the scan shape never changes)
TINY = np.float32(np.finfo(np.float32).tiny)
F32_MAX = float(np.finfo(np.float32).max)
SETTINGS = settings(max_examples=25, deadline=None, database=None, derandomize=True)


def reference(config, flags):
  """Plain-Python rule: returns the per-step (scale, tracker, hysteresis, skipped, consecutive)."""
  scale = np.float32(config.init_scale)
  tracker, hyst, skipped, consecutive = 0, config.hysteresis, 0, 0
  out = []
  for finite in flags:
    if finite:
      consecutive = 0
      tracker += 1
      if config.dynamic and tracker >= config.growth_interval:
        with np.errstate(over="ignore"):
          grown = np.float32(np.float64(scale) * np.float64(config.growth_factor))
        if np.isfinite(grown):
          scale = min(grown, np.float32(config.max_scale))
        tracker, hyst = 0, config.hysteresis
    else:
      skipped += 1
      consecutive += 1
      tracker = 0
      hyst = max(hyst - 1, 0)
      if config.dynamic and hyst <= 0:
        with np.errstate(under="ignore"):
          backed = np.float32(np.float64(scale) * np.float64(config.backoff_factor))
        scale = max(backed, np.float32(config.min_scale))
    if not config.dynamic:
      tracker, hyst = 0, config.hysteresis
    out.append((scale, tracker, hyst, skipped, consecutive))
  return out


@jax.jit
def _run_rule(state, flags):
  def step(s, finite):
    s = jls.update_scale(s, finite)
    return s, (
      s.scale,
      s.growth_tracker,
      s.hysteresis_tracker,
      s.skipped_steps,
      s.consecutive_skips,
    )

  return jax.lax.scan(step, state, flags)[1]


_pow2 = st.integers(-20, 60).map(lambda e: 2.0**e)
_any_scale = st.floats(1e-3, 1e12, allow_nan=False, allow_infinity=False)
configs = st.fixed_dictionaries(
  {
    "init_scale": st.one_of(_pow2, _any_scale),
    "growth_factor": st.one_of(st.sampled_from([2.0, 4.0, 1.5]), st.floats(1.0001, 10.0)),
    "backoff_factor": st.one_of(st.sampled_from([0.5, 0.25]), st.floats(0.01, 0.999)),
    "growth_interval": st.integers(1, 6),
    "hysteresis": st.integers(1, 4),
    "min_scale": st.sampled_from([float(TINY), 1e-30, 1.0]),
    "max_scale": st.sampled_from([F32_MAX, 2.0**64, 1e13]),
    "dynamic": st.booleans(),
  }
)


# float32 scale and float64 factor whose exact product has its 24 bits below
# float64's last bit equal to 100...0 and its 29 bits below float32's last
# bit (after the first rounding) equal to 100...0: found by search over
# factors of 30 significant bits.
DOUBLE_TIE = (1.9148098230361938, 1.2342685852199793)


def test_double_tie_is_one():
  """The example above really is a double tie: rounding the float64 tie away
  from zero instead of to even changes the float32 result."""
  s, f = DOUBLE_TIE
  assert float(np.float32(s)) == s
  p = int(s * 2**23) * int(f * 2**52)  # the exact product of the significands
  n = p.bit_length()
  assert p % 2 ** (n - 53) == 2 ** (n - 54)  # a tie in the float64 rounding
  q = p >> (n - 53)  # ties to even: q is even, so it stays (no increment)
  assert q % 2 == 0 and q % 2**29 == 2**28  # then a tie in the float32 rounding
  with np.errstate(all="ignore"):
    correct = np.float32(np.float64(s) * f)
  away = np.float32(np.float64(q + 1) * 2.0 ** (n - 53 - 75))  # float64 tie rounded away
  assert away != correct


def _config(**kwargs):
  base = dict(
    init_scale=1.0,
    growth_factor=2.0,
    backoff_factor=0.5,
    growth_interval=1,
    hysteresis=1,
    min_scale=float(TINY),
    max_scale=F32_MAX,
    dynamic=True,
  )
  return {**base, **kwargs}


# Examples that reach a blocked growth (the product would overflow float32, so
# the scale is kept, not capped), next to ones that reach max_scale exactly.
@example(config=_config(init_scale=2.0**120), flags=[True] * 10 + [False] + [True] * (T - 11))
@example(config=_config(init_scale=1e12, growth_factor=10.0), flags=[True] * T)
@example(
  config=_config(init_scale=3.0, growth_factor=9.7, growth_interval=1, hysteresis=2),
  flags=([True] * 20 + [False, True]) * 2 + [True] * (T - 44),
)
@example(config=_config(init_scale=1e12, growth_factor=10.0, max_scale=1e13), flags=[True] * T)
# Double ties: scale * factor falls exactly halfway in both roundings
# (float64, then float32), so the result depends on ties-to-even in each.
@example(config=_config(init_scale=DOUBLE_TIE[0], growth_factor=DOUBLE_TIE[1]), flags=[True] * T)
@example(
  config=_config(init_scale=DOUBLE_TIE[0], backoff_factor=DOUBLE_TIE[1] / 2), flags=[False] * T
)
@SETTINGS
@given(config=configs, flags=st.lists(st.booleans(), min_size=T, max_size=T))
def test_rule_trajectory_equals_reference(config, flags):
  state = jls.DynamicScaleState.create(**config)
  got = _run_rule(state, jnp.asarray(flags))
  got = list(zip(*[np.asarray(x).tolist() for x in got]))
  want = reference(state.config, flags)
  for i, (g, w) in enumerate(zip(got, want)):
    assert np.float32(g[0]) == w[0], (i, g, w)
    assert g[0] >= TINY and np.isfinite(g[0])
    if state.config.dynamic:
      assert tuple(g[1:]) == tuple(w[1:]), (i, g, w)
    else:  # static: trackers untouched, counters advance
      assert (g[1], g[2]) == (0, state.config.hysteresis)
      assert tuple(g[3:]) == tuple(w[3:]), (i, g, w)


_TX = jls.dynamic_loss_scale(
  optax.chain(optax.clip_by_global_norm(1e3), optax.sgd(1e-3, momentum=0.9)),
  init_scale=2.0**4,
  growth_interval=3,
  hysteresis=2,
  min_scale=2.0**-20,
)


@jax.jit
def _run_transform(params, grads_seq):
  def step(carry, scaled_grads):
    params, state = carry
    # A -0.0 param before every step: a skip must keep its sign (only -0.0 does).
    params = {"w": params["w"].at[3].set(-0.0)}
    updates, new_state = _TX.update({"w": scaled_grads}, state, params)
    new_params = optax.apply_updates(params, updates)
    return (new_params, new_state), (
      params,
      new_params,
      state.inner_state,
      new_state.inner_state,
      new_state.loss_scale,
    )

  return jax.lax.scan(step, (params, _TX.init(params)), grads_seq)[1]


_values = st.one_of(
  st.floats(-1e6, 1e6),
  st.floats(-3e38, 3e38),  # finite here, may overflow once unscaled (scale < 1)
  st.sampled_from([np.inf, -np.inf, np.nan]),
)


@SETTINGS
@given(
  st.lists(
    st.lists(st.one_of(st.floats(-1e3, 1e3), _values), min_size=4, max_size=4),
    min_size=T,
    max_size=T,
  )
)
def test_skipped_steps_change_nothing_and_params_stay_finite(grads):
  grads = np.asarray(grads, np.float32)
  params = {"w": jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32)}
  before, after, inner_before, inner_after, ls = _run_transform(params, jnp.asarray(grads))
  scales_before = np.concatenate([[np.float32(2.0**4)], np.asarray(ls.scale)[:-1]])
  flags = []
  for i in range(T):
    unscaled = grads[i].astype(np.float64) * np.float64(np.float32(1) / scales_before[i])
    with np.errstate(over="ignore"):
      finite = bool(np.all(np.isfinite(unscaled.astype(np.float32))))
    flags.append(finite)
    skipped = int(ls.skipped_steps[i]) - (int(ls.skipped_steps[i - 1]) if i else 0)
    assert skipped == (0 if finite else 1), i
    assert np.all(np.isfinite(np.asarray(after["w"][i])))
    if not finite:
      assert np.signbit(np.asarray(after["w"][i])[3]), i
      np.testing.assert_array_equal(
        np.asarray(after["w"][i]).view(np.uint32), np.asarray(before["w"][i]).view(np.uint32)
      )
      for a, b in zip(
        jax.tree_util.tree_leaves(inner_after), jax.tree_util.tree_leaves(inner_before)
      ):
        np.testing.assert_array_equal(
          np.asarray(a[i]).reshape(-1).view(np.uint8), np.asarray(b[i]).reshape(-1).view(np.uint8)
        )
  # The scale followed the reference rule on the flags the gradients imply.
  want = reference(_TX.init(params).loss_scale.config, flags)
  assert [np.float32(s) for s in np.asarray(ls.scale)] == [w[0] for w in want]
