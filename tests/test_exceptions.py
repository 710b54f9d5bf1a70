"""One exception rule at every public entry point: TypeError for a wrong type, ValueError for
a wrong value, each naming the argument.

A wrong *type* is a Python object of a kind the argument never takes (a string for a number,
a number for a callable or a state). A wrong *value* is the right kind out of range (a
negative interval, a scale of 0), or an array of the wrong dtype or shape.
"""

import jax.numpy as jnp
import optax
import pytest

import jax_lossscale as jls
from jax_lossscale.diagnostics import check_underflow
from jax_lossscale.diagnostics import grad_diagnostics
import jax_lossscale.flax as jflax

G = {"w": jnp.ones(2)}
STATE = jls.DynamicScaleState.create()
SGD = optax.sgd(1.0)

#: (entry point and argument, call with a wrong type, call with a wrong value, the name)
CASES = {
  "dynamic_loss_scale(inner)": (
    lambda: jls.dynamic_loss_scale(lambda g: g),
    None,
    "inner",
  ),
  "dynamic_loss_scale(init_scale)": (
    lambda: jls.dynamic_loss_scale(SGD, init_scale="8"),
    lambda: jls.dynamic_loss_scale(SGD, init_scale=0.0),
    "init_scale",
  ),
  "dynamic_loss_scale(growth_interval)": (
    lambda: jls.dynamic_loss_scale(SGD, growth_interval=2.5),
    lambda: jls.dynamic_loss_scale(SGD, growth_interval=0),
    "growth_interval",
  ),
  "static_loss_scale(scale)": (
    lambda: jls.static_loss_scale(SGD, "2"),
    lambda: jls.static_loss_scale(SGD, -2.0),
    "scale",
  ),
  "no_loss_scale(inner)": (lambda: jls.no_loss_scale(3), None, "inner"),
  "DynamicScaleConfig(dynamic)": (lambda: jls.DynamicScaleConfig(dynamic="yes"), None, "dynamic"),
  "DynamicScaleConfig(backoff_factor)": (
    lambda: jls.DynamicScaleConfig(backoff_factor="0.5"),
    lambda: jls.DynamicScaleConfig(backoff_factor=2.0),
    "backoff_factor",
  ),
  "DynamicScaleState.create(hysteresis)": (
    lambda: jls.DynamicScaleState.create(hysteresis=None),
    lambda: jls.DynamicScaleState.create(hysteresis=0),
    "hysteresis",
  ),
  "DynamicScaleState.from_config(config)": (
    lambda: jls.DynamicScaleState.from_config({}),
    None,
    "config",
  ),
  "update_scale(state, grads_finite)": (
    lambda: jls.update_scale({"scale": 1.0}, True),
    lambda: jls.update_scale(STATE, jnp.ones(2, bool)),
    "state|grads_finite",
  ),
  "unscale_and_check(scale)": (
    lambda: jls.unscale_and_check(G, "2"),
    lambda: jls.unscale_and_check(G, SGD.init(G)),
    "scale|DynamicScaleState",
  ),
  "scale_loss(state)": (
    lambda: jls.scale_loss(jnp.float32(1.0), None),
    lambda: jls.scale_loss(jnp.int32(1), STATE),
    "scale|loss",
  ),
  "check_skips(max_consecutive_skips)": (
    lambda: jls.check_skips(STATE, max_consecutive_skips="3"),
    lambda: jls.check_skips(STATE, max_consecutive_skips=-1),
    "max_consecutive_skips",
  ),
  "autocast(fun, dtype)": (
    lambda: jls.autocast(3),
    lambda: jls.autocast(jnp.exp, jnp.int32),
    "fun|dtype",
  ),
  "autocast(policy)": (
    lambda: jls.autocast(jnp.exp, policy=["exp"]),
    lambda: jls.autocast(jnp.exp, policy={"exxp": "lower"}),
    "policy",
  ),
  "float32(fun)": (lambda: jls.float32(3), None, "fun"),
  "autocast_op(rule, primary)": (
    lambda: jls.autocast_op(jnp.exp, "float32_compute", primary="0"),
    lambda: jls.autocast_op(jnp.exp, "half"),
    "primary|rule",
  ),
  "check_underflow(scale)": (
    lambda: check_underflow(lambda p, b, d: jnp.sum(p["w"]), G, None, scale="big"),
    lambda: check_underflow(lambda p, b, d: jnp.sum(p["w"]), G, None, scale=SGD.init(G)),
    "scale|DynamicScaleState",
  ),
  "grad_diagnostics(scale)": (
    lambda: grad_diagnostics(G, None),
    lambda: grad_diagnostics(G, SGD.init(G)),
    "scale|DynamicScaleState",
  ),
  "torch.from_torch_state_dict(sd)": (
    lambda: jls.torch.from_torch_state_dict([("scale", 1.0)]),
    lambda: jls.torch.from_torch_state_dict({}),
    "sd|disabled",
  ),
  "flax.value_and_grad(fun)": (lambda: jflax.value_and_grad(3, STATE), None, "fun"),
  "retry_on_overflow(fun)": (lambda: jls.retry_on_overflow(3, STATE), None, "fun"),
  "retry_on_overflow(max_retries)": (
    lambda: jls.retry_on_overflow(jnp.sum, STATE, max_retries="3"),
    lambda: jls.retry_on_overflow(jnp.sum, STATE, max_retries=-1),
    "max_retries",
  ),
  "retry_on_overflow(state)": (
    lambda: jls.retry_on_overflow(jnp.sum, None),
    lambda: jls.retry_on_overflow(jnp.sum, G),
    "state|DynamicScaleState",
  ),
  "flax.TrainState.retry_value_and_grad(max_retries)": (
    lambda: jflax.TrainState.create(apply_fn=None, params=G, tx=SGD).retry_value_and_grad(
      jnp.sum, max_retries=1.5
    ),
    lambda: jflax.TrainState.create(apply_fn=None, params=G, tx=SGD).retry_value_and_grad(
      jnp.sum, max_retries=-1
    ),
    "max_retries",
  ),
  "flax.TrainState.create(dynamic_scale)": (
    lambda: jflax.TrainState.create(apply_fn=None, params=G, tx=SGD, dynamic_scale=1.0),
    lambda: jflax.TrainState.create(apply_fn=None, params=G, tx=jls.dynamic_loss_scale(SGD)),
    "dynamic_scale|already holds",
  ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_wrong_type_raises_type_error_naming_the_argument(case):
  wrong_type, _, name = CASES[case]
  with pytest.raises(TypeError, match=name) as e:
    wrong_type()
  assert not isinstance(e.value, ValueError)


@pytest.mark.parametrize("case", [c for c, (_, v, _) in CASES.items() if v is not None])
def test_a_wrong_value_raises_value_error_naming_the_argument(case):
  _, wrong_value, name = CASES[case]
  with pytest.raises(ValueError, match=name) as e:
    wrong_value()
  assert not isinstance(e.value, TypeError)
