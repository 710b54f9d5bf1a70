"""Every refusal of the scaler's settings, at every entry point, and what is accepted at the edges.

Each setting is refused with the same message wherever it is given (``DynamicScaleConfig``,
``DynamicScaleState.create``, ``dynamic_loss_scale``, ``from_torch_state_dict``): a
``TypeError`` for a wrong type, a ``ValueError`` for a wrong value, naming the argument (the
state-dict key for a setting read from torch's dict). What is accepted:

* ``init_scale`` may equal ``min_scale`` or ``max_scale``; it is compared as the float32 it
  becomes (the first scale), and kept as given.
* No setting needs to be a power of two (torch's ``GradScaler`` takes any): ``min_scale`` and
  ``max_scale`` are stored as the float32 values the scale is compared against.
* ``growth_factor`` is any finite real above 1, ``backoff_factor`` any real in (0, 1).
* ``growth_interval`` and ``hysteresis`` are Python or NumPy integers in [1, 2**31 - 1], never
  a bool or a float that holds an integer.
"""

import math
import re

from helpers import TORCH_DEFAULTS
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_lossscale as jls
from jax_lossscale._scaler._state import CONFIG_FIELDS

TINY = float(np.finfo(np.float32).tiny)
HUGE = float(np.finfo(np.float32).max)


def _real(name):
  return f"{name} must be a Python or NumPy real number, got"


def _positive(name):
  return f"{name} must be positive and finite, got"


def _integer_type(name):
  return f"{name} must be an integer >= 1, got"


def _integer_range(name):
  return f"{name} must be an integer in [1, 2**31 - 1], got"


def _integer_cases(name):
  return [
    (name, 0, ValueError, _integer_range(name)),
    (name, -1, ValueError, _integer_range(name)),
    (name, 2**31, ValueError, _integer_range(name)),
    (name, np.int64(-3), ValueError, _integer_range(name)),
    (name, True, TypeError, _integer_type(name)),
    (name, np.bool_(True), TypeError, _integer_type(name)),
    (name, 2.0, TypeError, _integer_type(name)),
    (name, np.float32(5), TypeError, _integer_type(name)),
    (name, "5", TypeError, _integer_type(name)),
    (name, None, TypeError, _integer_type(name)),
  ]


#: (field, value, error, the start of its message): every refusal of one setting on its own.
REFUSED = [
  ("init_scale", "8", TypeError, _real("init_scale")),
  ("init_scale", None, TypeError, _real("init_scale")),
  ("init_scale", True, TypeError, _real("init_scale")),
  ("init_scale", np.bool_(False), TypeError, _real("init_scale")),
  ("init_scale", 1j, TypeError, _real("init_scale")),
  ("init_scale", 0.0, ValueError, _positive("init_scale")),
  ("init_scale", -8.0, ValueError, _positive("init_scale")),
  ("init_scale", math.inf, ValueError, _positive("init_scale")),
  ("init_scale", math.nan, ValueError, _positive("init_scale")),
  ("init_scale", TINY / 2, ValueError, "init_scale must be a normal float32"),
  ("init_scale", 1e39, ValueError, "init_scale must be a normal float32"),
  ("growth_factor", 1.0, ValueError, "growth_factor must be > 1, got 1.0."),
  ("growth_factor", 0.5, ValueError, "growth_factor must be > 1, got 0.5."),
  ("growth_factor", np.nextafter(1.0, 0.0), ValueError, "growth_factor must be > 1"),
  ("growth_factor", 0.0, ValueError, _positive("growth_factor")),
  ("growth_factor", math.inf, ValueError, _positive("growth_factor")),
  ("growth_factor", math.nan, ValueError, _positive("growth_factor")),
  ("growth_factor", True, TypeError, _real("growth_factor")),
  ("growth_factor", "2", TypeError, _real("growth_factor")),
  ("backoff_factor", 1.0, ValueError, "backoff_factor must be in (0, 1), got 1.0."),
  ("backoff_factor", 1.5, ValueError, "backoff_factor must be in (0, 1), got 1.5."),
  ("backoff_factor", 0.0, ValueError, _positive("backoff_factor")),
  ("backoff_factor", -0.5, ValueError, _positive("backoff_factor")),
  ("backoff_factor", math.nan, ValueError, _positive("backoff_factor")),
  ("backoff_factor", False, TypeError, _real("backoff_factor")),
  ("backoff_factor", "0.5", TypeError, _real("backoff_factor")),
  *_integer_cases("growth_interval"),
  *_integer_cases("hysteresis"),
  ("min_scale", TINY / 2, ValueError, "min_scale must be >= the smallest normal float32"),
  ("min_scale", 0.0, ValueError, _positive("min_scale")),
  ("min_scale", -1.0, ValueError, _positive("min_scale")),
  ("min_scale", math.inf, ValueError, _positive("min_scale")),
  ("min_scale", "1", TypeError, _real("min_scale")),
  ("min_scale", True, TypeError, _real("min_scale")),
  ("max_scale", 1e39, ValueError, "max_scale must be <= the largest float32, got 1e+39."),
  ("max_scale", math.inf, ValueError, _positive("max_scale")),
  ("max_scale", 0.0, ValueError, _positive("max_scale")),
  ("max_scale", "1", TypeError, _real("max_scale")),
  ("max_scale", True, TypeError, _real("max_scale")),
  ("dynamic", 1, TypeError, "dynamic must be a bool, got 1."),
  ("dynamic", "yes", TypeError, "dynamic must be a bool, got 'yes'."),
  ("dynamic", None, TypeError, "dynamic must be a bool, got None."),
  ("dynamic", np.int64(0), TypeError, "dynamic must be a bool, got"),
]


def _id(case):
  field, value = case[:2]
  return f"{field}={value!r}"


def _keyword_entry_points(field):
  """Every entry point that takes ``field`` as a keyword, as ``settings -> config``."""
  points = {
    "DynamicScaleConfig": jls.DynamicScaleConfig,
    "DynamicScaleState.create": jls.DynamicScaleState.create,
    "dynamic_loss_scale": lambda **s: jls.dynamic_loss_scale(optax.sgd(1.0), **s),
    "from_torch_state_dict": lambda **s: jls.torch.from_torch_state_dict(TORCH_DEFAULTS, **s),
  }
  if field == "dynamic":
    del points["dynamic_loss_scale"]  # static_loss_scale and no_loss_scale are the others
  if CONFIG_FIELDS[field].torch_key is not None or field == "dynamic":
    del points["from_torch_state_dict"]  # read from torch's dict (below)
  return points


def test_every_field_has_refusals():
  assert {case[0] for case in REFUSED} == set(CONFIG_FIELDS)


@pytest.mark.parametrize("field, value, error, message", REFUSED, ids=[_id(c) for c in REFUSED])
def test_each_refusal_names_the_argument_at_every_entry_point(field, value, error, message):
  for point, make in _keyword_entry_points(field).items():
    with pytest.raises(error) as e:
      make(**{field: value})
    assert type(e.value) is error, point
    assert str(e.value).startswith(message), (point, str(e.value))
    assert str(e.value).endswith("."), point


@pytest.mark.parametrize(
  "field, value, error, message",
  [c for c in REFUSED if CONFIG_FIELDS[c[0]].torch_key is not None],
  ids=[_id(c) for c in REFUSED if CONFIG_FIELDS[c[0]].torch_key is not None],
)
def test_each_refusal_of_a_torch_key_names_the_key(field, value, error, message):
  key = CONFIG_FIELDS[field].torch_key
  with pytest.raises(error) as e:
    jls.torch.from_torch_state_dict({**TORCH_DEFAULTS, key: value})
  assert type(e.value) is error
  assert str(e.value).startswith(f"state_dict[{key!r}] must be "), str(e.value)


@pytest.mark.parametrize(
  "settings, message",
  [
    (
      {"init_scale": 2.0, "min_scale": 4.0, "max_scale": 2.0},
      "min_scale (4.0) must be <= max_scale (2.0).",
    ),
    (
      {"init_scale": 1.0, "min_scale": 2.0},
      "init_scale (1.0) must lie in [min_scale, max_scale] = [2.0, 3.4028234663852886e+38].",
    ),
    (
      {"init_scale": 16.0, "max_scale": 8.0},
      "init_scale (16.0) must lie in [min_scale, max_scale] = [1.1754943508222875e-38, 8.0].",
    ),
    (  # compared as the float32 it becomes: 0.99999905 is below 1
      {"init_scale": 1.0 - 2.0**-20, "min_scale": 1.0},
      "init_scale (0.9999990463256836) must lie in [min_scale, max_scale]",
    ),
  ],
)
def test_a_band_that_excludes_the_scale_is_refused_at_every_entry_point(settings, message):
  points = {
    "DynamicScaleConfig": lambda: jls.DynamicScaleConfig(**settings),
    "DynamicScaleState.create": lambda: jls.DynamicScaleState.create(**settings),
    "dynamic_loss_scale": lambda: jls.dynamic_loss_scale(optax.sgd(1.0), **settings),
    "from_torch_state_dict": lambda: jls.torch.from_torch_state_dict(
      {**TORCH_DEFAULTS, "scale": settings["init_scale"]},
      **{k: v for k, v in settings.items() if k != "init_scale"},
    ),
  }
  for make in points.values():
    with pytest.raises(ValueError, match=re.escape(message)):
      make()


# ----------------------------------------------------------------------------- accepted edges


@pytest.mark.parametrize(
  "settings, stored",
  [
    ({"init_scale": 2.0, "min_scale": 2.0}, {"init_scale": 2.0, "min_scale": 2.0}),
    ({"init_scale": 8.0, "max_scale": 8.0}, {"init_scale": 8.0, "max_scale": 8.0}),
    (
      {"init_scale": 8.0, "min_scale": 8.0, "max_scale": 8.0},
      {"init_scale": 8.0, "min_scale": 8.0, "max_scale": 8.0},
    ),
    # Compared as float32: 1 - 2**-30 becomes 1.0, the floor. Kept as given.
    ({"init_scale": 1.0 - 2.0**-30, "min_scale": 1.0}, {"init_scale": 1.0 - 2.0**-30}),
    ({"init_scale": TINY, "min_scale": TINY}, {"init_scale": TINY, "min_scale": TINY}),
    ({"init_scale": HUGE}, {"init_scale": HUGE}),
    # Not powers of two.
    ({"init_scale": 1000.0}, {"init_scale": 1000.0}),
    ({"init_scale": 0.1, "min_scale": 0.1}, {"init_scale": 0.1, "min_scale": 0.10000000149011612}),
    ({"growth_factor": 1.5, "backoff_factor": 0.3}, {"growth_factor": 1.5, "backoff_factor": 0.3}),
    ({"init_scale": 8.0, "max_scale": 1000.3}, {"max_scale": 1000.2999877929688}),
    # The open ends of the factors, and numbers of other types.
    ({"growth_factor": np.nextafter(1.0, 2.0)}, {"growth_factor": 1.0000000000000002}),
    ({"growth_factor": 1e30}, {"growth_factor": 1e30}),
    ({"backoff_factor": np.nextafter(1.0, 0.0)}, {"backoff_factor": 0.9999999999999999}),
    ({"backoff_factor": 5e-324}, {"backoff_factor": 5e-324}),
    ({"init_scale": 8, "growth_factor": 3}, {"init_scale": 8.0, "growth_factor": 3.0}),
    ({"init_scale": np.float16(8.0)}, {"init_scale": 8.0}),
    # The integer ends.
    ({"growth_interval": 1, "hysteresis": 1}, {"growth_interval": 1, "hysteresis": 1}),
    (
      {"growth_interval": 2**31 - 1, "hysteresis": 2**31 - 1},
      {"growth_interval": 2**31 - 1, "hysteresis": 2**31 - 1},
    ),
    (
      {"growth_interval": np.int64(5), "hysteresis": np.int32(2)},
      {"growth_interval": 5, "hysteresis": 2},
    ),
    ({"dynamic": np.bool_(False)}, {"dynamic": False}),
  ],
  ids=repr,
)
def test_edges_that_are_accepted_and_what_is_stored(settings, stored):
  config = jls.DynamicScaleConfig(**settings)
  for name, value in stored.items():
    got = getattr(config, name)
    assert got == value and type(got) is type(value), (name, got)
  assert jls.DynamicScaleState.create(**settings).config == config
  if "dynamic" not in settings:
    tx = jls.dynamic_loss_scale(optax.sgd(1.0), **settings)
    assert tx.init({"w": jnp.zeros(1)}).loss_scale.config == config
  state = jls.DynamicScaleState.from_config(config)
  assert state.scale.item() == float(np.float32(config.init_scale))


def test_settings_that_are_not_powers_of_two_drive_the_scale():
  tx = jls.dynamic_loss_scale(
    optax.sgd(1.0), init_scale=1000.0, growth_factor=1.5, backoff_factor=0.25, growth_interval=1
  )
  params = {"w": jnp.zeros(1)}
  state = tx.init(params)
  scales = []
  for g in (1.0, jnp.inf, 1.0):
    _, state = tx.update({"w": jnp.full(1, g, jnp.float32)}, state, params)
    scales.append(state.loss_scale.scale.item())
  assert scales == [1500.0, 375.0, 562.5]


def test_static_loss_scale_names_its_scale_argument():
  with pytest.raises(ValueError, match=r"^scale must be a normal float32"):
    jls.static_loss_scale(optax.sgd(1.0), TINY / 2)
  with pytest.raises(TypeError, match=r"^scale must be a Python or NumPy real number"):
    jls.static_loss_scale(optax.sgd(1.0), True)
  state = jls.static_loss_scale(optax.sgd(1.0), 1000.0).init({"w": jnp.zeros(1)})
  assert state.loss_scale.config == jls.DynamicScaleConfig(init_scale=1000.0, dynamic=False)
