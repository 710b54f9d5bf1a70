"""The object inventories that link the API reference to JAX, Optax, Flax and NumPy.

``docs/inventories/*.inv`` are written by ``docs/inventories/make_inventories.py`` and read
by mkdocstrings (``mkdocs.yml``) with no network: each parses, the committed files are what
the script writes, ``mkdocs.yml`` loads each one with its project's docs root, and every
name of those projects in the API reference's signatures is in one of them.
"""

import importlib.util
import pathlib
import zlib

from helpers import import_optional
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "docs" / "inventories" / "make_inventories.py"


def _script():
  spec = importlib.util.spec_from_file_location("make_inventories", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


inv = _script()


@pytest.mark.parametrize("stem", sorted(inv.INVENTORIES))
def test_the_committed_inventory_parses_and_is_what_the_script_writes(stem):
  project, _, names = inv.INVENTORIES[stem]
  committed = inv.path(stem).read_bytes()
  assert inv.parse(committed) == (project, names)
  # The header byte for byte; the compressed body by its text (zlib builds may compress
  # the same text to other bytes).
  written = inv.render(project, names)
  header = committed[: committed.index(b"compressed using zlib.\n") + 23]
  assert written.startswith(header)
  assert zlib.decompress(written[len(header) :]) == zlib.decompress(committed[len(header) :])


def test_the_inventories_list_the_linked_names():
  entries = {stem: inv.parse(inv.path(stem).read_bytes())[1] for stem in inv.INVENTORIES}
  assert entries["jax"]["jax.Array"] == ("py:class", "_autosummary/jax.Array.html")
  assert entries["optax"]["optax.GradientTransformation"] == (
    "py:class",
    "api/transformations.html#optax.GradientTransformation",
  )
  assert entries["flax"]["flax.training.train_state.TrainState"] == (
    "py:class",
    "api_reference/flax.training.html#flax.training.train_state.TrainState",
  )
  assert entries["numpy"]["numpy.ndarray"] == (
    "py:class",
    "reference/generated/numpy.ndarray.html",
  )
  for stem, names in entries.items():
    assert all(name.split(".")[0] == stem for name in names), stem


def test_a_malformed_inventory_is_refused():
  with pytest.raises(ValueError, match="data: not a Sphinx v2 inventory"):
    inv.parse(b"# Sphinx inventory version 1\n# Project: X\n# Version: 1\nx mod x.html\n")
  bad = inv.render("X", {}).replace(zlib.compress(b"", 9), zlib.compress(b"no role here\n", 9))
  with pytest.raises(ValueError, match="data: malformed inventory line 'no role here'"):
    inv.parse(bad)


def test_mkdocs_loads_each_inventory_with_its_docs_root():
  yaml = import_optional("yaml")
  config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
  (mkdocstrings,) = [p["mkdocstrings"] for p in config["plugins"] if "mkdocstrings" in p]
  loaded = mkdocstrings["handlers"]["python"]["inventories"]
  assert loaded == [
    {"url": f"file:docs/inventories/{stem}.inv", "base_url": base_url}
    for stem, (_, base_url, _) in inv.INVENTORIES.items()
  ]
  assert all(
    base_url.startswith("https://") and base_url.endswith("/")
    for _, base_url, _ in inv.INVENTORIES.values()
  )
  assert "inventories/" in config["exclude_docs"].split()


def test_every_linked_name_in_the_api_reference_is_in_an_inventory():
  pytest.importorskip("griffe", reason="the docs extra installs griffe")
  referenced = inv.referenced_names(ROOT)
  # The names the signatures use today: the walk finds them (it is not vacuous).
  assert {
    "jax.Array",
    "jax.numpy.float16",
    "optax.GradientTransformation",
    "optax.GradientTransformationExtraArgs",
    "flax.nnx.Module",
    "flax.training.train_state.TrainState",
  } <= referenced
  listed = {name for stem in inv.INVENTORIES for name in inv.parse(inv.path(stem).read_bytes())[1]}
  assert sorted(referenced - listed) == []


def test_a_name_missing_from_the_inventories_fails_the_script(monkeypatch, capsys):
  pytest.importorskip("griffe", reason="the docs extra installs griffe")
  project, base_url, names = inv.INVENTORIES["optax"]
  smaller = {k: v for k, v in names.items() if k != "optax.OptState"}
  monkeypatch.setitem(inv.INVENTORIES, "optax", (project, base_url, smaller))
  monkeypatch.setattr(inv, "path", lambda stem: pytest.fail("wrote an inventory"))
  assert inv.main() == 1
  assert capsys.readouterr().err == f"add to INVENTORIES in {SCRIPT}: optax.OptState\n"
