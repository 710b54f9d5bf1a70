"""The public surface: explicit exports, documented, keyword-only configuration."""

import importlib
import inspect
import pathlib
import sys
import warnings

import jax.numpy as jnp
import optax
import pytest

import jax_lossscale as jls

#: The public namespaces; ``flax`` needs Flax and is imported on demand.
NAMESPACES = ("checkpoint", "diagnostics", "flax", "torch")

#: 0.1.0's top-level names that moved, and where they live now.
MOVED = {
  "UnderflowReport": "diagnostics",
  "check_underflow": "diagnostics",
  "grad_diagnostics": "diagnostics",
  "grad_leaf_names": "diagnostics",
  "nonfinite_leaves": "diagnostics",
  "check_scale_config": "checkpoint",
  "scale_config_metadata": "checkpoint",
  "from_torch_state_dict": "torch",
  "to_torch_state_dict": "torch",
}

#: 0.1.0's top-level names that were renamed, and their new top-level names.
RENAMED = {"inner_state": "get_inner_state"}

#: What the seeds (the worked examples the project grew from) call at the top level.
SEED_NAMES = (
  "DynamicScaleState",
  "dynamic_loss_scale",
  "fp16_roundtrip",
  "get_scale_state",
  "unscale_and_check",
  "update_scale",
)


def _public_objects():
  """(qualified name, object) of every name in the package's and the namespaces' ``__all__``."""
  for name in jls.__all__:
    yield f"jax_lossscale.{name}", getattr(jls, name)
  for ns in NAMESPACES:
    module = importlib.import_module(f"jax_lossscale.{ns}")
    for name in module.__all__:
      yield f"jax_lossscale.{ns}.{name}", getattr(module, name)


def test_all_is_explicit_sorted_and_importable():
  for module in [jls] + [importlib.import_module(f"jax_lossscale.{ns}") for ns in NAMESPACES]:
    assert list(module.__all__) == sorted(module.__all__), module.__name__
    for name in module.__all__:
      assert hasattr(module, name), (module.__name__, name)
  public = {n for n in dir(jls) if not n.startswith("_")}
  assert public - set(jls.__all__) <= set(NAMESPACES)


def test_every_public_name_is_documented():
  for qualname, obj in _public_objects():
    doc = inspect.getdoc(obj)
    assert doc and len(doc.splitlines()[0]) > 10, f"{qualname} has no summary line"


def test_seed_names_stay_at_the_top_level_without_a_warning():
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for name in SEED_NAMES:
      assert name in jls.__all__
      assert callable(getattr(jls, name))


@pytest.mark.parametrize("name", sorted(MOVED))
def test_moved_names_warn_and_return_the_same_object(name):
  namespace = importlib.import_module(f"jax_lossscale.{MOVED[name]}")
  assert name in namespace.__all__ and name not in jls.__all__
  with pytest.warns(FutureWarning, match=f"jax_lossscale.{MOVED[name]}.{name}"):
    old = getattr(jls, name)
  assert old is getattr(namespace, name)
  with pytest.warns(FutureWarning, match=name):
    exec(f"from jax_lossscale import {name} as imported", scope := {})
  assert scope["imported"] is old


def test_the_removal_warning_is_shown_by_default():
  # Python's default filters hide a DeprecationWarning raised outside __main__; a
  # FutureWarning is shown (issue 33).
  import os
  import subprocess
  import sys

  name = sorted(MOVED)[0]
  env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
  out = subprocess.run(
    [sys.executable, "-c", f"import jax_lossscale; jax_lossscale.{name}"],
    capture_output=True,
    text=True,
    env=env,
    check=True,
  )
  assert "FutureWarning" in out.stderr and name in out.stderr, out.stderr


@pytest.mark.parametrize("name", sorted(RENAMED))
def test_renamed_names_warn_and_return_the_same_object(name):
  new = RENAMED[name]
  assert new in jls.__all__ and name not in jls.__all__
  with pytest.warns(FutureWarning, match=f"jax_lossscale.{name} is now jax_lossscale.{new}"):
    old = getattr(jls, name)
  assert old is getattr(jls, new)
  with pytest.warns(FutureWarning, match=new):
    exec(f"from jax_lossscale import {name} as imported", scope := {})
  assert scope["imported"] is old


def test_get_inner_state_is_named_like_get_scale_state_without_a_warning():
  state = jls.dynamic_loss_scale(optax.sgd(1.0)).init({"w": jnp.zeros(2)})
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert jls.get_inner_state(state) is state.inner_state


def test_unknown_attribute_is_an_attribute_error():
  with pytest.raises(AttributeError, match="no_such_name"):
    jls.no_such_name  # noqa: B018


def _fresh(code: str) -> str:
  """``code`` run in a fresh interpreter (nothing imported yet); its stdout."""
  import subprocess

  root = pathlib.Path(__file__).resolve().parents[1]
  done = subprocess.run(
    [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=240
  )
  assert done.returncode == 0, done.stderr[-2000:]
  return done.stdout


def test_jls_flax_is_imported_on_first_use():
  pytest.importorskip("flax")
  out = _fresh(
    "import sys, jax_lossscale as jls\n"
    "print('jax_lossscale.flax' in sys.modules)\n"
    "print(jls.flax.TrainState.__module__)\n"
  )
  assert out.split() == ["False", "jax_lossscale._integrations._flax"]


def test_jls_flax_without_flax_says_what_to_install():
  out = _fresh(
    "import sys\n"
    "sys.modules['flax'] = None  # Flax not installed\n"
    "import jax_lossscale as jls\n"
    "try:\n"
    "  jls.flax\n"
    "except AttributeError as e:\n"
    "  print(e)\n"
  )
  assert "jax_lossscale.flax is not available" in out, out
  assert "pip install 'jax-lossscale[flax]'" in out, out


def test_one_version_source():
  """pyproject.toml has no version of its own: setuptools reads ``__version__``."""
  import tomllib  # Python 3.11, the oldest that requires-python admits

  root = pathlib.Path(__file__).resolve().parents[1]
  project = tomllib.loads((root / "pyproject.toml").read_text())
  assert "version" not in project["project"]
  assert project["project"]["dynamic"] == ["version"]
  attr = project["tool"]["setuptools"]["dynamic"]["version"]["attr"]
  assert attr == "jax_lossscale.__version__"
  assert jls.__version__.count(".") == 2
  assert f"## [{jls.__version__}]" in (root / "CHANGELOG.md").read_text()


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
from helpers import import_optional

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

  for name in ("conftest.py", "helpers.py"):  # conftest imports the helpers
    shutil.copy(os.path.join(os.path.dirname(__file__), name), tmp_path / name)
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


@pytest.mark.slow
def test_wheel_holds_the_package_its_license_and_only_the_runtime_dependencies(tmp_path):
  """The wheel pip builds from this tree (offline; ``make dist-check`` installs it for real)."""
  import email
  import subprocess
  import zipfile

  root = pathlib.Path(__file__).resolve().parents[1]
  out = subprocess.run(
    [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    + ["--wheel-dir", str(tmp_path), str(root)],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert out.returncode == 0, out.stderr
  (wheel,) = tmp_path.glob("jax_lossscale-*.whl")
  with zipfile.ZipFile(wheel) as z:
    names = set(z.namelist())
    (meta_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    meta = email.message_from_bytes(z.read(meta_name))
  # Every module of the package, its subpackages' too (a flat `packages` list drops them).
  sources = {p.relative_to(root).as_posix() for p in (root / "jax_lossscale").rglob("*.py")}
  assert {
    "jax_lossscale/_scaler/_transform.py",
    "jax_lossscale/_autocast/_interpreter.py",
  } <= sources
  assert sources <= names, sorted(sources - names)
  assert "jax_lossscale/py.typed" in names
  assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
  assert not any(n.startswith(("tests/", "docs/", "examples/")) for n in names)
  assert meta["Version"] == jls.__version__
  assert meta["License-Expression"] == "Apache-2.0"
  assert meta["Requires-Python"] == ">=3.11"  # jax 0.9, the oldest allowed, needs 3.11
  assert meta.get_all("Project-URL") is None  # no project address is confirmed yet
  runtime = sorted(r.split(">")[0] for r in meta.get_all("Requires-Dist") if "extra ==" not in r)
  assert runtime == ["jax", "numpy", "optax"]
