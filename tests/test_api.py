"""The public surface: explicit exports, documented, keyword-only configuration."""

import inspect

import jax_lossscale as jls


def test_all_is_explicit_sorted_and_importable():
  assert list(jls.__all__) == sorted(jls.__all__)
  for name in jls.__all__:
    assert hasattr(jls, name), name
  public = {n for n in dir(jls) if not n.startswith("_")}
  assert public - set(jls.__all__) <= {"flax"}  # the optional submodule, imported on demand


def test_every_public_name_is_documented():
  for name in jls.__all__:
    obj = getattr(jls, name)
    doc = inspect.getdoc(obj)
    assert doc and len(doc.splitlines()[0]) > 10, f"{name} has no summary line"


def test_transformation_factories_take_configuration_by_keyword():
  for factory in (jls.dynamic_loss_scale, jls.no_loss_scale):
    params = list(inspect.signature(factory).parameters.values())
    assert params[0].name == "inner"
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[1:]), factory.__name__
  params = list(inspect.signature(jls.static_loss_scale).parameters.values())
  assert [p.name for p in params[:2]] == ["inner", "scale"]
  assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[2:])


def test_defaults_match_torch_gradscaler_signature():
  sig = inspect.signature(jls.dynamic_loss_scale).parameters
  assert sig["init_scale"].default == 2.0**16
  assert sig["growth_factor"].default == 2.0
  assert sig["backoff_factor"].default == 0.5
  assert sig["growth_interval"].default == 2000
