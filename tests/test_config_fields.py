"""The scaler's settings are written once (``CONFIG_FIELDS``): every entry point takes,
forwards and documents each setting it does not fix, and the torch conversions carry each one.

A setting added to ``CONFIG_FIELDS`` and forgotten in a signature, a docstring or a forwarding
fails here (the bug class of a ``tree_unflatten`` that drops ``min_scale``).
"""

import dataclasses
import inspect
import re

from helpers import TORCH_DEFAULTS
import jax.numpy as jnp
import optax
import pytest

import jax_lossscale as jls
from jax_lossscale._scaler._state import CONFIG_FIELDS
from jax_lossscale._scaler._state import DEFAULT_CONFIG
from jax_lossscale._scaler._state import config_from

FIELDS = list(CONFIG_FIELDS)
TORCH_KEY = {name: f.torch_key for name, f in CONFIG_FIELDS.items() if f.torch_key is not None}
NOT_IN_TORCH = [name for name, f in CONFIG_FIELDS.items() if f.torch_key is None]

#: A distinctive value for each field, none of them the default: each is valid alone and all
#: of them together, and no two are equal, so a value forwarded to another field is seen.
DISTINCT = {
  "init_scale": 1027.0,  # not a power of two
  "growth_factor": 2.5,
  "backoff_factor": 0.375,
  "growth_interval": 7,
  "min_scale": 0.125,
  "max_scale": 2.0**20,
  "hysteresis": 3,
  "dynamic": False,
}


def _transform_config(**settings):
  tx = jls.dynamic_loss_scale(optax.sgd(1.0), **settings)
  return tx.init({"w": jnp.zeros(1)}).loss_scale.config


def _torch_config(**settings):
  return jls.torch.from_torch_state_dict(TORCH_DEFAULTS, **settings).config


@dataclasses.dataclass(frozen=True)
class EntryPoint:
  """A public function that takes scaler settings as keywords."""

  fn: object  # whose signature is checked
  build: object  # settings -> the DynamicScaleConfig it makes
  fixed: dict  # the fields it does not take, and the values it gives them
  others: tuple = ()  # its parameters that are no setting
  doc: object = None  # whose docstring documents its settings (default: fn)


ENTRY_POINTS = {
  "DynamicScaleConfig": EntryPoint(jls.DynamicScaleConfig, jls.DynamicScaleConfig, {}),
  "DynamicScaleState.create": EntryPoint(
    jls.DynamicScaleState.create,
    lambda **s: jls.DynamicScaleState.create(**s).config,
    {},
    doc=jls.DynamicScaleConfig,  # "Arguments are those of DynamicScaleConfig"
  ),
  "dynamic_loss_scale": EntryPoint(
    jls.dynamic_loss_scale, _transform_config, {"dynamic": True}, ("inner", "axis_name")
  ),
  "torch.from_torch_state_dict": EntryPoint(
    jls.torch.from_torch_state_dict,
    _torch_config,
    {**{name: getattr(DEFAULT_CONFIG, name) for name in TORCH_KEY}, "dynamic": True},
    ("sd",),
  ),
}


def _taken(entry):
  return [name for name in FIELDS if name not in entry.fixed]


def test_the_field_list_is_the_config_dataclass():
  assert [f.name for f in dataclasses.fields(jls.DynamicScaleConfig)] == FIELDS
  assert list(DISTINCT) == FIELDS, "give a new field a distinctive value above"
  for name in FIELDS:
    assert DISTINCT[name] != getattr(DEFAULT_CONFIG, name), name
  assert len({repr(v) for v in DISTINCT.values()}) == len(DISTINCT)
  assert jls.DynamicScaleConfig(**DISTINCT) == jls.DynamicScaleConfig(**DISTINCT)  # valid


def test_the_torch_keys_are_gradscalers():
  assert [*TORCH_KEY.values(), "_growth_tracker"] == list(TORCH_DEFAULTS)
  assert jls.torch.to_torch_state_dict(jls.DynamicScaleState.create()) == TORCH_DEFAULTS


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_each_signature_takes_every_field_it_does_not_fix(entry):
  ep = ENTRY_POINTS[entry]
  params = inspect.signature(ep.fn).parameters
  assert [p for p in params if p not in ep.others] == _taken(ep), "the fields, in their order"
  field_types = {f.name: f.type for f in dataclasses.fields(jls.DynamicScaleConfig)}
  for name in _taken(ep):
    p, default = params[name], getattr(DEFAULT_CONFIG, name)
    if ep.fn is not jls.DynamicScaleConfig:
      assert p.kind is inspect.Parameter.KEYWORD_ONLY, name
    assert p.default == default and type(p.default) is type(default), name
    assert str(p.annotation) == str(field_types[name]), name


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_each_docstring_documents_the_fields_it_takes(entry):
  ep = ENTRY_POINTS[entry]
  doc = inspect.getdoc(ep.doc or ep.fn)
  documented = [n for n in re.findall(r"^  (\w+): ", doc, re.M) if n in CONFIG_FIELDS]
  owner = ENTRY_POINTS["DynamicScaleConfig"] if ep.doc else ep
  assert documented == _taken(owner)
  if ep.doc is not None:
    assert ":class:`DynamicScaleConfig`" in inspect.getdoc(ep.fn)


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_each_field_arrives_in_the_config(entry, field):
  ep = ENTRY_POINTS[entry]
  if field in ep.fixed:
    with pytest.raises(TypeError, match=field):
      ep.build(**{field: DISTINCT[field]})
    return
  config = ep.build(**{field: DISTINCT[field]})
  assert config == jls.DynamicScaleConfig(**{field: DISTINCT[field], **ep.fixed})
  assert getattr(config, field) == DISTINCT[field]


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_all_fields_together_arrive_each_in_its_own_place(entry):
  ep = ENTRY_POINTS[entry]
  config = ep.build(**{name: DISTINCT[name] for name in _taken(ep)})
  assert config == jls.DynamicScaleConfig(**{**DISTINCT, **ep.fixed})


def test_config_from_fails_for_an_entry_point_that_forgets_a_field():
  def forgetful(*, init_scale=2.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=1):
    return config_from(locals(), dynamic=True)

  with pytest.raises(KeyError, match="min_scale"):
    forgetful()

  def fixes_an_unknown_field(**settings):
    return config_from(settings, scale=2.0)

  with pytest.raises(TypeError, match="scale"):
    fixes_an_unknown_field(**DISTINCT)


# ----------------------------------------------------------------------------- torch


@pytest.mark.parametrize("field", list(TORCH_KEY))
def test_each_torch_key_is_imported_as_its_field(field):
  key, value = TORCH_KEY[field], DISTINCT[field]
  state = jls.torch.from_torch_state_dict({**TORCH_DEFAULTS, key: value})
  assert state.config == jls.DynamicScaleConfig(**{field: value})
  assert type(getattr(state.config, field)) is type(getattr(DEFAULT_CONFIG, field))
  assert float(state.scale) == (value if key == "scale" else 65536.0)


@pytest.mark.parametrize("field", list(TORCH_KEY))
def test_each_field_torch_keeps_is_exported_under_its_key(field):
  key, value = TORCH_KEY[field], DISTINCT[field]
  state = jls.DynamicScaleState.create(**{field: value})
  sd = jls.torch.to_torch_state_dict(state)
  assert sd == {**TORCH_DEFAULTS, key: value}
  assert [type(v) for v in sd.values()] == [type(v) for v in TORCH_DEFAULTS.values()]
  # torch's scale is the state's current scale, not the config's first one.
  moved = state.replace(scale=jnp.float32(512.0), growth_tracker=jnp.int32(5))
  sd = jls.torch.to_torch_state_dict(moved)
  assert (sd["scale"], sd["_growth_tracker"]) == (512.0, 5)
  assert sd == {**TORCH_DEFAULTS, key: value, "scale": 512.0, "_growth_tracker": 5}


@pytest.mark.parametrize("field", NOT_IN_TORCH)
def test_each_field_torch_lacks_is_refused_by_a_strict_export_and_dropped_otherwise(field):
  value = DISTINCT[field]
  state = jls.DynamicScaleState.create(**{field: value})
  with pytest.raises(ValueError) as e:
    jls.torch.to_torch_state_dict(state)
  static = " (a static scale)" if field == "dynamic" else ""
  assert str(e.value) == (
    f"torch.amp.GradScaler cannot represent {field}={value!r}{static}; pass strict=False to "
    "drop these settings."
  )
  assert jls.torch.to_torch_state_dict(state, strict=False) == TORCH_DEFAULTS


def test_a_strict_export_names_every_setting_torch_lacks():
  state = jls.DynamicScaleState.create(**{name: DISTINCT[name] for name in NOT_IN_TORCH})
  with pytest.raises(ValueError) as e:
    jls.torch.to_torch_state_dict(state)
  lost = [f"{name}={DISTINCT[name]!r}" for name in NOT_IN_TORCH]
  lost = [x + " (a static scale)" if x.startswith("dynamic=") else x for x in lost]
  assert str(e.value).startswith(f"torch.amp.GradScaler cannot represent {', '.join(lost)}; ")


def test_a_round_trip_through_torch_keeps_every_field_it_can():
  state = jls.DynamicScaleState.create(**{**DISTINCT, "dynamic": True})
  state = state.replace(scale=jnp.float32(2048.0), growth_tracker=jnp.int32(4))
  sd = jls.torch.to_torch_state_dict(state, strict=False)
  back = jls.torch.from_torch_state_dict(
    sd, **{name: DISTINCT[name] for name in NOT_IN_TORCH if name != "dynamic"}
  )
  assert back.config == jls.DynamicScaleConfig(
    **{**DISTINCT, "dynamic": True, "init_scale": 2048.0}
  )
  assert (float(back.scale), int(back.growth_tracker)) == (2048.0, 4)
  assert int(back.hysteresis_tracker) == DISTINCT["hysteresis"]


# ----------------------------------------------------------------------------- the state check


@pytest.mark.parametrize("field", [name for name in FIELDS if name != "init_scale"])
def test_a_state_differing_in_any_one_field_is_refused_naming_it(field):
  params = {"w": jnp.zeros(2)}
  if field == "dynamic":
    state = jls.static_loss_scale(optax.sgd(1.0), 65536.0).init(params)
  else:
    state = jls.dynamic_loss_scale(optax.sgd(1.0), **{field: DISTINCT[field]}).init(params)
  tx = jls.dynamic_loss_scale(optax.sgd(1.0))
  mine = f"{field}={getattr(DEFAULT_CONFIG, field)!r}"
  theirs = f"{field}={getattr(state.loss_scale.config, field)!r}"
  with pytest.raises(
    ValueError, match=f"another configuration.*{re.escape(theirs)}.*{re.escape(mine)}"
  ):
    tx.update({"w": jnp.ones(2)}, state, params)


def test_only_init_scale_may_differ_and_only_for_a_dynamic_scaler():
  # A dynamic scaler's init_scale sets its first scale only (a state restored mid-run has
  # another); a static scaler's init_scale is its scale.
  params, grads = {"w": jnp.zeros(2)}, {"w": jnp.ones(2)}
  settings = {name: DISTINCT[name] for name in FIELDS if name != "dynamic"}
  state = jls.dynamic_loss_scale(optax.sgd(1.0), **settings).init(params)
  other_start = jls.dynamic_loss_scale(optax.sgd(1.0), **{**settings, "init_scale": 8.0})
  _, new_state = other_start.update(grads, state, params)
  assert new_state.loss_scale.config == state.loss_scale.config
  assert float(new_state.loss_scale.scale) == DISTINCT["init_scale"]
  static = jls.static_loss_scale(optax.sgd(1.0), 4.0).init(params)
  with pytest.raises(ValueError, match=r"another configuration.*init_scale=4\.0.*init_scale=8\.0"):
    jls.static_loss_scale(optax.sgd(1.0), 8.0).update(grads, static, params)
