"""One source of truth: defaults, state/config agreement, the update dtype rule, trace-time warnings."""

import subprocess
import sys
import warnings

from helpers import standard_promotion
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_lossscale as jls
from jax_lossscale._scaler import _signals
from jax_lossscale._scaler._state import DEFAULT_CONFIG

# ----------------------------------------------------------------------------- defaults

TORCH_DEFAULTS = {
  "init_scale": 2.0**16,
  "growth_factor": 2.0,
  "backoff_factor": 0.5,
  "growth_interval": 2000,
}


def test_default_config_is_torchs():
  for name, value in TORCH_DEFAULTS.items():
    assert getattr(DEFAULT_CONFIG, name) == value
  assert DEFAULT_CONFIG.hysteresis == 1 and DEFAULT_CONFIG.dynamic is True
  assert DEFAULT_CONFIG.min_scale == 2.0**-126
  assert DEFAULT_CONFIG.max_scale == float(np.finfo(np.float32).max)


def test_a_default_built_state_and_transformation_agree():
  tx = jls.dynamic_loss_scale(optax.sgd(1.0))
  assert tx.init({"w": jnp.zeros(1)}).loss_scale.config == DEFAULT_CONFIG
  assert jls.DynamicScaleState.create().config == DEFAULT_CONFIG


# ----------------------------------------------------------------------------- state/config agreement


def test_state_of_another_config_is_refused_naming_both(maybe_jit):
  params = {"w": jnp.zeros(2)}
  state = jls.dynamic_loss_scale(optax.sgd(1.0)).init(params)
  other = jls.dynamic_loss_scale(optax.sgd(1.0), init_scale=8.0, growth_interval=2)
  with pytest.raises(ValueError, match=r"growth_interval=2000.*growth_interval=2\b"):
    maybe_jit(other.update)({"w": jnp.ones(2)}, state, params)


def test_a_state_whose_min_scale_is_above_this_init_scale_names_both_configs():
  # Comparing the configs must not re-validate the state's with this init_scale.
  params = {"w": jnp.zeros(2)}
  state = jls.dynamic_loss_scale(optax.sgd(1.0), init_scale=8.0, min_scale=4.0).init(params)
  tx = jls.dynamic_loss_scale(optax.sgd(1.0), init_scale=0.5)
  with pytest.raises(ValueError, match=r"another configuration.*min_scale=4\.0.*min_scale=1\.17"):
    tx.update({"w": jnp.ones(2)}, state, params)


def test_a_pinned_band_is_accepted_and_holds_the_scale():
  tx = jls.dynamic_loss_scale(
    optax.sgd(1.0), init_scale=8.0, min_scale=8.0, max_scale=8.0, growth_interval=1
  )
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  for g in (1.0, jnp.inf, 1.0, 1.0):  # growth and backoff both clamp to 8
    _, state = tx.update({"w": jnp.full(2, g, jnp.float32)}, state, params)
    assert float(state.loss_scale.scale) == 8.0
  assert jls.DynamicScaleState.create(init_scale=2.0, min_scale=2.0, max_scale=2.0).scale == 2.0


@pytest.mark.parametrize("field", ["growth_interval", "hysteresis"])
def test_integer_fields_stop_at_int32_max(field):
  assert getattr(jls.DynamicScaleState.create(**{field: 2**31 - 1}).config, field) == 2**31 - 1
  with pytest.raises(ValueError, match=rf"{field} must be an integer in \[1, 2\*\*31 - 1\]"):
    jls.DynamicScaleState.create(**{field: 2**31})
  with pytest.raises(ValueError, match=field):
    jls.dynamic_loss_scale(optax.sgd(1.0), **{field: 2**31})


def test_the_scale_band_is_validated_naming_its_ends():
  with pytest.raises(ValueError, match=r"max_scale must be <= the largest float32, got 1e\+39"):
    jls.DynamicScaleConfig(max_scale=1e39)
  with pytest.raises(ValueError, match=r"min_scale \(4\.0\) must be <= max_scale \(2\.0\)"):
    jls.DynamicScaleConfig(init_scale=2.0, min_scale=4.0, max_scale=2.0)


def test_init_scale_may_be_the_smallest_normal_or_the_largest_float32():
  tiny, huge = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)
  assert jls.DynamicScaleConfig(init_scale=tiny, min_scale=tiny).init_scale == tiny
  assert jls.DynamicScaleConfig(init_scale=huge).init_scale == huge
  with pytest.raises(ValueError, match="init_scale must be a normal float32"):
    jls.DynamicScaleConfig(init_scale=tiny / 2)


def test_from_config_refuses_anything_but_a_config():
  with pytest.raises(TypeError, match="config must be a DynamicScaleConfig, got dict"):
    jls.DynamicScaleState.from_config({"init_scale": 2.0})


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_dynamic_must_be_a_bool(value):
  with pytest.raises(TypeError, match=r"dynamic must be a bool, got"):
    jls.DynamicScaleConfig(dynamic=value)
  assert jls.DynamicScaleConfig(dynamic=np.bool_(False)).dynamic == np.bool_(False)


def test_static_state_given_to_a_dynamic_scaler_is_refused(maybe_jit):
  params = {"w": jnp.zeros(2)}
  state = jls.no_loss_scale(optax.sgd(1.0)).init(params)
  with pytest.raises(ValueError, match=r"dynamic=False.*dynamic=True"):
    maybe_jit(jls.dynamic_loss_scale(optax.sgd(1.0)).update)({"w": jnp.ones(2)}, state, params)


def test_a_state_restored_from_torch_with_the_same_settings_is_accepted():
  tx = jls.dynamic_loss_scale(optax.sgd(1.0), growth_interval=3)
  state = tx.init({"w": jnp.zeros(1)})
  sd = {
    "scale": 64.0,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 3,
    "_growth_tracker": 2,
  }
  state = state._replace(loss_scale=jls.torch.from_torch_state_dict(sd))
  _, state = tx.update({"w": jnp.ones(1)}, state)
  assert float(state.loss_scale.scale) == 128.0  # the third clean step grows


@pytest.mark.parametrize(
  "key, value, message",
  [
    ("scale", 0.0, r"state_dict\['scale'\] must be positive"),
    ("scale", 1e-39, r"state_dict\['scale'\] must be a normal float32"),
    ("growth_factor", 1.0, r"state_dict\['growth_factor'\] must be > 1"),
    ("backoff_factor", 1.5, r"state_dict\['backoff_factor'\] must be in \(0, 1\)"),
    ("growth_interval", 0, r"state_dict\['growth_interval'\] must be an integer in \[1"),
  ],
)
def test_torch_keys_are_validated_under_their_own_names(key, value, message):
  sd = {
    "scale": 64.0,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 3,
    "_growth_tracker": 0,
  }
  sd[key] = value
  with pytest.raises(ValueError, match=message):
    jls.torch.from_torch_state_dict(sd)


# ----------------------------------------------------------------------------- update dtypes


def test_half_gradients_of_float32_params_give_float32_updates(maybe_jit):
  """The issue's case: 1e-6 gradients, lr 1e-3: a float16 update of 1e-9 would be 0."""
  params = {"w": jnp.full((3,), 1e-4, jnp.float32)}
  tx = jls.dynamic_loss_scale(optax.sgd(1e-3), init_scale=1024.0)
  state = tx.init(params)
  g16 = {"w": jnp.full((3,), 1e-6 * 1024.0, jnp.float16)}
  updates, _ = maybe_jit(tx.update)(g16, state, params)
  assert updates["w"].dtype == jnp.float32
  expected = -np.float32(1e-3) * (np.float32(np.float16(1e-6 * 1024.0)) * np.float32(1 / 1024))
  np.testing.assert_array_equal(np.asarray(updates["w"]), np.full(3, expected, np.float32))
  moved = optax.apply_updates(params, updates)["w"]
  assert bool(jnp.all(moved < params["w"]))


def test_adam_at_tiny_lr_loses_no_update(maybe_jit):
  params = {"w": jnp.full((2,), 1e-4, jnp.float32)}
  tx = jls.dynamic_loss_scale(optax.adam(1e-8), init_scale=1024.0)
  with standard_promotion():
    updates, _ = maybe_jit(tx.update)(
      {"w": jnp.full((2,), 1.0, jnp.float16)}, tx.init(params), params
    )
  assert updates["w"].dtype == jnp.float32 and bool(jnp.all(updates["w"] < 0))


@pytest.mark.parametrize("with_params", [True, False])
def test_half_gradients_keep_their_dtype_without_wider_params(maybe_jit, with_params):
  params = {"w": jnp.ones(2, jnp.float16), "b": jnp.ones(2, jnp.bfloat16)}
  tx = jls.dynamic_loss_scale(optax.sgd(0.5), init_scale=4.0)
  grads = {"w": jnp.full((2,), 4.0, jnp.float16), "b": jnp.full((2,), 8.0, jnp.bfloat16)}
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", jls.LossScaleWarning)
    updates, _ = maybe_jit(tx.update)(grads, tx.init(params), params if with_params else None)
  assert updates["w"].dtype == jnp.float16 and updates["b"].dtype == jnp.bfloat16
  assert float(updates["w"][0]) == -0.5 and float(updates["b"][0]) == -1.0


def test_a_frozen_param_without_a_gradient_gets_no_update(maybe_jit):
  # A gradient of None (a frozen param) is an update of None, next to float16 gradients
  # of float32 params that come back float32.
  params = {"w": jnp.ones(2), "frozen": jnp.ones(3)}
  grads = {"w": jnp.full((2,), 4.0, jnp.float16), "frozen": None}
  tx = jls.dynamic_loss_scale(optax.sgd(0.5), init_scale=4.0)
  updates, state = maybe_jit(tx.update)(grads, tx.init(params), params)
  assert updates["frozen"] is None
  assert updates["w"].dtype == jnp.float32 and float(updates["w"][0]) == -0.5
  assert int(state.loss_scale.skipped_steps) == 0


def test_float16_gradients_of_bfloat16_params_stay_float16(maybe_jit):
  # The param's dtype wins only when it is wider: bfloat16 is as wide as float16.
  params = {"w": jnp.ones(2, jnp.bfloat16)}
  tx = jls.dynamic_loss_scale(optax.sgd(0.5), init_scale=4.0)
  updates, _ = maybe_jit(tx.update)(
    {"w": jnp.full((2,), 4.0, jnp.float16)}, tx.init(params), params
  )
  assert updates["w"].dtype == jnp.float16 and float(updates["w"][0]) == -0.5


def test_float32_gradients_of_float16_params_stay_float32(maybe_jit):
  params = {"w": jnp.ones(2, jnp.float16)}
  tx = jls.dynamic_loss_scale(optax.sgd(0.5), init_scale=4.0)
  updates, _ = maybe_jit(tx.update)({"w": jnp.full((2,), 4.0)}, tx.init(params), params)
  assert updates["w"].dtype == jnp.float32


def test_skipped_step_updates_take_the_same_dtype(maybe_jit):
  params = {"w": jnp.array([-0.0, 1.0], jnp.float32)}
  tx = jls.dynamic_loss_scale(optax.sgd(0.5))
  updates, _ = maybe_jit(tx.update)(
    {"w": jnp.array([jnp.inf, 1.0], jnp.float16)}, tx.init(params), params
  )
  assert updates["w"].dtype == jnp.float32 and bool(jnp.all(jnp.signbit(updates["w"])))
  new = optax.apply_updates(params, updates)["w"]
  assert bool(jnp.signbit(new[0])) and float(new[1]) == 1.0


def test_multi_steps_with_half_gradients_of_float32_params(maybe_jit):
  params = {"w": jnp.full((2,), 1e-4, jnp.float32)}
  tx = jls.multi_steps(jls.dynamic_loss_scale(optax.sgd(1e-3), init_scale=1024.0), 2)
  state = tx.init(params)
  step = maybe_jit(tx.update)
  micro = [jnp.full((2,), v * 1024.0, jnp.float16) for v in (1e-6, 3e-6)]
  with standard_promotion():  # optax.MultiSteps mixes int32 and floats
    u0, state = step({"w": micro[0]}, state, params)
    u1, state = step({"w": micro[1]}, state, params)
  assert u0["w"].dtype == u1["w"].dtype == jnp.float32
  assert bool(jnp.all(u0["w"] == 0))
  mean = (np.float32(micro[0][0]) + np.float32(micro[1][0])) / 2  # accumulated in float32
  expected = -np.float32(1e-3) * (np.float32(np.float16(mean)) * np.float32(1 / 1024))
  np.testing.assert_array_equal(np.asarray(u1["w"]), np.full(2, expected, np.float32))


# ----------------------------------------------------------------------------- get_inner_state


def test_get_inner_state_serves_schedule_free_eval_params():
  params = {"w": jnp.array([1.0, -2.0])}
  inner = optax.contrib.schedule_free_sgd(0.1)
  tx, ref = jls.dynamic_loss_scale(inner, init_scale=8.0), inner
  state, ref_state = tx.init(params), ref.init(params)
  grads = {"w": jnp.array([0.5, 0.25])}
  with standard_promotion():
    _, state = tx.update(jax.tree_util.tree_map(lambda g: g * 8.0, grads), state, params)
    _, ref_state = ref.update(grads, ref_state, params)
  with pytest.raises(AttributeError):
    optax.contrib.schedule_free_eval_params(state, params)  # the wrapper's state: no b1
  got = optax.contrib.schedule_free_eval_params(jls.get_inner_state(state), params)
  want = optax.contrib.schedule_free_eval_params(ref_state, params)
  np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(want["w"]))


def test_get_inner_state_through_chain_and_multi_steps():
  params = {"w": jnp.zeros(2)}
  tx = optax.chain(optax.clip(1.0), jls.multi_steps(jls.dynamic_loss_scale(optax.adam(1e-3)), 2))
  assert type(jls.get_inner_state(tx.init(params))[0]).__name__ == "ScaleByAdamState"
  with pytest.raises(ValueError, match="exactly one LossScaleState, found 0"):
    jls.get_inner_state(optax.adam(1e-3).init(params))


def test_get_inner_state_refuses_several_loss_scale_states():
  params = {"a": jnp.zeros(2), "b": jnp.zeros(2)}
  tx = optax.partition(
    {"a": jls.dynamic_loss_scale(optax.sgd(1.0)), "b": jls.no_loss_scale(optax.adam(1e-3))},
    {"a": "a", "b": "b"},
  )
  with pytest.raises(ValueError, match="exactly one LossScaleState, found 2"):
    jls.get_inner_state(tx.init(params))


# ----------------------------------------------------------------------------- warnings


def test_bfloat16_gradients_warn_once_towards_no_loss_scale(fresh_warnings):
  params = {"w": jnp.ones(2, jnp.bfloat16)}
  tx = jls.dynamic_loss_scale(optax.sgd(0.1))
  state = tx.init(params)
  with pytest.warns(jls.LossScaleWarning, match="no_loss_scale"):
    tx.update({"w": jnp.ones(2, jnp.bfloat16)}, state, params)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    tx.update({"w": jnp.ones(2, jnp.bfloat16)}, state, params)  # once only
    jax.jit(tx.update)({"w": jnp.ones(2, jnp.bfloat16)}, state, params)


def test_no_warning_for_float16_or_float32_gradients_or_static_scaling(fresh_warnings):
  params = {"w": jnp.ones(2), "b": jnp.ones(2, jnp.bfloat16)}
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    tx = jls.dynamic_loss_scale(optax.sgd(0.1))
    tx.update(
      {"w": jnp.ones(2, jnp.float16), "b": jnp.ones(2, jnp.bfloat16)}, tx.init(params), params
    )
    tx.update(
      {"w": jnp.ones(2), "b": jnp.ones(2)}, tx.init(params), params
    )  # float16 inside the loss
    tx = jls.no_loss_scale(optax.sgd(0.1))
    tx.update({"w": jnp.ones(2), "b": jnp.ones(2, jnp.bfloat16)}, tx.init(params), params)


def test_bfloat16_warning_can_be_silenced(fresh_warnings):
  params = {"w": jnp.ones(2, jnp.bfloat16)}
  tx = jls.dynamic_loss_scale(optax.sgd(0.1))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    warnings.filterwarnings("ignore", category=jls.LossScaleWarning)
    tx.update({"w": jnp.ones(2, jnp.bfloat16)}, tx.init(params), params)


def test_stock_multisteps_warns_once_towards_multi_steps(fresh_warnings):
  params = {"w": jnp.zeros(2)}
  stock = optax.MultiSteps(jls.dynamic_loss_scale(optax.sgd(1.0)), 2)
  state = stock.init(params)
  with pytest.warns(jls.LossScaleWarning, match="jax_lossscale.multi_steps"):
    jax.jit(jls.scale_loss)(jnp.float32(1.0), state)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    jls.scale_loss(jnp.float32(1.0), state)  # once only
    ours = jls.multi_steps(jls.dynamic_loss_scale(optax.sgd(1.0)), 2)
    _signals._WARNED.clear()
    jls.scale_loss(jnp.float32(1.0), ours.init(params))  # never for multi_steps
    assert isinstance(ours.init(params), optax.MultiStepsState)


def test_the_two_warnings_are_once_only_each_on_its_own(fresh_warnings):
  # One warning having fired must not silence the other (separate once-only kinds).
  params = {"w": jnp.ones(2, jnp.bfloat16)}
  stock = optax.MultiSteps(jls.dynamic_loss_scale(optax.sgd(1.0)), 2)
  tx = jls.dynamic_loss_scale(optax.sgd(0.1))
  with pytest.warns(jls.LossScaleWarning, match="bfloat16 gradients"):
    tx.update({"w": jnp.ones(2, jnp.bfloat16)}, tx.init(params), params)
  with pytest.warns(jls.LossScaleWarning, match="inside optax.MultiSteps"):
    jls.scale_loss(jnp.float32(1.0), stock.init(params))
  _signals._WARNED.clear()
  with pytest.warns(jls.LossScaleWarning, match="inside optax.MultiSteps"):
    jls.scale_loss(jnp.float32(1.0), stock.init(params))
  with pytest.warns(jls.LossScaleWarning, match="bfloat16 gradients"):
    tx.update({"w": jnp.ones(2, jnp.bfloat16)}, tx.init(params), params)


def test_stock_multisteps_warns_from_retry_on_overflow_too(fresh_warnings):
  state = optax.MultiSteps(jls.dynamic_loss_scale(optax.sgd(1.0)), 2).init(jnp.zeros(2))
  with pytest.warns(jls.LossScaleWarning, match="jax_lossscale.multi_steps"):
    jls.retry_on_overflow(jnp.sum, state)


def test_no_warning_for_a_stock_multisteps_inside_the_scaler(fresh_warnings):
  # Unscaled, checked and skipped before it accumulates: nothing non-finite reaches it.
  stock = optax.MultiSteps(optax.sgd(1.0), 2).gradient_transformation()
  state = jls.dynamic_loss_scale(stock).init(jnp.zeros(2))
  assert type(jls.get_inner_state(state)) is optax.MultiStepsState
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    jls.scale_loss(jnp.float32(1.0), state)
    jls.retry_on_overflow(jnp.sum, state)


def test_stock_multisteps_warning_can_be_silenced(fresh_warnings):
  state = optax.MultiSteps(jls.dynamic_loss_scale(optax.sgd(1.0)), 2).init({"w": jnp.zeros(2)})
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    warnings.filterwarnings("ignore", category=jls.LossScaleWarning)
    jls.scale_loss(jnp.float32(1.0), state)


# ----------------------------------------------------------------------------- the flax extra


def test_core_imports_without_flax_and_the_flax_module_names_the_extra():
  code = """
import sys
class Block:
  def find_spec(self, name, path=None, target=None):
    if name == "flax" or name.startswith("flax."):
      raise ImportError("No module named 'flax' (blocked)")
sys.meta_path.insert(0, Block())
import jax.numpy as jnp, optax
import jax_lossscale as jls
tx = jls.dynamic_loss_scale(optax.sgd(0.1))
tx.update({"w": jnp.ones(2)}, tx.init({"w": jnp.zeros(2)}))
assert not any(m == "flax" or m.startswith("flax.") for m in sys.modules), "core imported flax"
try:
  import jax_lossscale.flax
except ImportError as e:
  print("IMPORT-ERROR:", e)
"""
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  assert "IMPORT-ERROR:" in out.stdout and "jax-lossscale[flax]" in out.stdout


def test_dynamic_loss_scale_honours_max_scale():
  params = {"w": jnp.ones(2)}
  tx = jls.dynamic_loss_scale(optax.sgd(0.1), init_scale=4.0, growth_interval=1, max_scale=8.0)
  state = tx.init(params)
  scales = []
  for _ in range(3):
    _, state = tx.update({"w": jnp.ones(2)}, state, params)
    scales.append(float(state.loss_scale.scale))
  assert scales == [8.0, 8.0, 8.0]
  assert state.loss_scale.config.max_scale == 8.0


def test_updates_of_float16_gradients_come_back_in_the_wider_float32_param_dtype():
  params = {"w": jnp.ones(2, jnp.float32)}
  tx = jls.dynamic_loss_scale(optax.sgd(0.5), init_scale=4.0)
  updates, _ = tx.update({"w": jnp.full(2, 4.0, jnp.float16)}, tx.init(params), params)
  assert updates["w"].dtype == jnp.float32
  np.testing.assert_array_equal(updates["w"], np.full(2, -0.5, np.float32))
