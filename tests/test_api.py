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


_MISSING_DEPENDENCY_TESTS = """
import pytest
from conftest import import_optional

def test_import_optional():
  import_optional("chex.no_such_module")

def test_importorskip_inside_a_test():
  pytest.importorskip("sklearn.no_such_module")

def test_importorskip_of_a_module_outside_the_test_extra():
  pytest.importorskip("not_in_the_test_extra")
"""


def _run_missing_dependency_tests(tmp_path, ci):
  import os
  import shutil
  import subprocess
  import sys

  shutil.copy(os.path.join(os.path.dirname(__file__), "conftest.py"), tmp_path / "conftest.py")
  (tmp_path / "test_missing.py").write_text(_MISSING_DEPENDENCY_TESTS)
  (tmp_path / "test_missing_module.py").write_text(
    "import pytest\npytest.importorskip('hypothesis.no_such_module')\n"
    "def test_never_collected():\n  pass\n"
  )
  env = {k: v for k, v in os.environ.items() if k != "CI"}
  if ci:
    env["CI"] = "true"
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "pytest",
      "-q",
      "-rA",
      "-p",
      "no:cacheprovider",
      "--continue-on-collection-errors",
      str(tmp_path),
    ],
    cwd=tmp_path,
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
  )
  return out.stdout


def test_missing_test_dependencies_fail_in_ci_and_skip_elsewhere(tmp_path):
  """Under CI=true a missing dependency of the test extra fails; any other module skips."""
  ci = _run_missing_dependency_tests(tmp_path, ci=True)
  assert "FAILED test_missing.py::test_import_optional" in ci, ci
  assert "FAILED test_missing.py::test_importorskip_inside_a_test" in ci, ci
  assert "ERROR test_missing_module.py" in ci, ci
  assert "SKIPPED [1] test_missing.py" in ci and "not_in_the_test_extra" in ci, ci
  assert "2 failed, 1 skipped, 1 error" in ci, ci
  local = _run_missing_dependency_tests(tmp_path, ci=False)
  assert "4 skipped" in local and "failed" not in local and "error" not in local, local
