"""The README and the docs site: every Python block runs, every public name has an API entry.

* Each ```` ```python ```` block of ``README.md`` and ``docs/**/*.md`` is executed: the blocks of
  one page in order, in one namespace, as a reader would paste them. A block whose first line is
  ``# docs: not run — <reason>`` is not executed; the reason is required.
* The blocks run with JAX's default (standard) dtype promotion, as a user's code does; the rest of
  the suite runs with strict promotion (``conftest.py``), which ``optax.adam`` does not pass.
* Every name in the ``__all__`` of ``jax_lossscale`` and of its public namespaces has an entry in
  ``docs/api/`` (the same check fails ``make docs``).
"""

import importlib.util
import json
import pathlib
import re
import sys

from helpers import REQUIRED_IN_CI
from helpers import in_ci
from helpers import python_blocks
import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]

_NOT_RUN = re.compile(r"\A# docs: not run — (\S.*)$", re.M)


def _load_hooks():
  spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _page_id(page: pathlib.Path) -> str:
  return str(page.relative_to(ROOT))


def test_block_extraction():
  text = "intro\n```python\na = 1\n```\n\n```bash\nmake\n```\n```python title='x'\nb = a\n```\n"
  assert python_blocks(text) == [(3, "a = 1\n"), (10, "b = a\n")]
  assert _NOT_RUN.match("# docs: not run — needs 2 processes\nx")
  assert not _NOT_RUN.match("# docs: not run — \nx")


def test_every_page_has_been_found():
  names = {_page_id(p) for p in PAGES}
  assert {"README.md", "docs/index.md", "docs/getting-started.md"} <= names
  assert sum(len(python_blocks(p.read_text())) for p in PAGES) > 20


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p.read_text())], ids=_page_id)
def test_python_blocks_run(page, monkeypatch):
  monkeypatch.chdir(ROOT)
  monkeypatch.setattr(sys, "argv", ["docs"])
  namespace = {"__name__": f"docs:{_page_id(page)}"}
  ran = 0
  with jax.numpy_dtype_promotion("standard"):
    for line, code in python_blocks(page.read_text()):
      if code.startswith("# docs: not run"):
        assert _NOT_RUN.match(code), f"{_page_id(page)}:{line}: a block not run needs a reason"
        continue
      try:
        exec(compile(code, f"{_page_id(page)}:{line}", "exec"), namespace)
      except ModuleNotFoundError as e:
        # A page's framework (flax, equinox, torch) is in the test extra: skipped outside CI.
        if (e.name or "").split(".")[0] in REQUIRED_IN_CI and not in_ci():
          pytest.skip(f"{_page_id(page)} needs {e.name}, which is not installed")
        raise AssertionError(f"{_page_id(page)}, block at line {line}: {e!r}") from e
      except Exception as e:
        raise AssertionError(f"{_page_id(page)}, block at line {line}: {e!r}") from e
      ran += 1
  assert ran > 0, f"{_page_id(page)}: no block ran"


def test_every_public_name_has_an_api_entry():
  hooks = _load_hooks()
  public = hooks.public_names(ROOT)
  assert "jax_lossscale.dynamic_loss_scale" in public
  assert "jax_lossscale.torch.to_torch_state_dict" in public
  assert "jax_lossscale.flax.TrainState" in public
  assert hooks.missing_api_entries(ROOT) == []


def test_a_missing_api_entry_is_found(tmp_path):
  """A name added to ``__all__`` without an entry is reported (and fails ``make docs``)."""
  hooks = _load_hooks()
  (tmp_path / "jax_lossscale").mkdir()
  (tmp_path / "jax_lossscale" / "__init__.py").write_text('__all__ = ("a", "new_name")\n')
  (tmp_path / "jax_lossscale" / "ns.py").write_text('__all__ = ("b",)\n')
  (tmp_path / "jax_lossscale" / "_private.py").write_text('__all__ = ("hidden",)\n')
  (tmp_path / "docs" / "api").mkdir(parents=True)
  (tmp_path / "docs" / "api" / "x.md").write_text(
    "# X\n\n::: jax_lossscale.a\n\n::: jax_lossscale.ns.b\n    options:\n      x: 1\n"
  )
  assert hooks.public_names(tmp_path) == [
    "jax_lossscale.a",
    "jax_lossscale.new_name",
    "jax_lossscale.ns.b",
  ]
  assert hooks.missing_api_entries(tmp_path) == ["jax_lossscale.new_name"]


def test_the_benchmarks_page_renders_every_results_file():
  hooks = _load_hooks()
  text = hooks.benchmark_tables(ROOT)
  results = sorted((ROOT / "benchmarks" / "results").glob("*.json"))
  assert results
  for path in results:
    assert f"`benchmarks/results/{path.name}`" in text
  assert text.count("| model |") >= len(results)


def test_the_benchmarks_page_shows_the_newest_results_first(tmp_path):
  hooks = _load_hooks()
  results = tmp_path / "benchmarks" / "results"
  results.mkdir(parents=True)
  dates = {"a.json": "2026-11-30 00:54 UTC", "b.json": "2026-12-04 16:42 UTC", "c.json": None}
  dates["d.json"] = "2026-12-04 16:42 UTC"  # the same date: by name
  for name, date in dates.items():
    payload = {"machine": {"date": date}} if date else {"kind": "gpu-plan"}
    (results / name).write_text(json.dumps(payload))
  assert [p.name for p, _ in hooks.results_files(tmp_path)] == [
    "d.json",
    "b.json",
    "a.json",
    "c.json",
  ]
  text = hooks.benchmark_tables(ROOT)
  order = [text.index(f"`benchmarks/results/{p.name}`") for p, _ in hooks.results_files(ROOT)]
  assert order == sorted(order)
  dated = [
    d["machine"]["date"] for _, d in hooks.results_files(ROOT) if d.get("machine", {}).get("date")
  ]
  assert dated and dated[0] == max(dated)  # the page opens with the newest measurement


def test_the_rendered_pages_leave_out_the_not_run_markers():
  """The hook drops the marker line of a block the tests do not run, and nothing else."""
  hooks = _load_hooks()
  page = "Text.\n\n```python\n# docs: not run — needs 2 processes\nx = 1\n```\n"
  assert hooks.strip_test_markers(page) == "Text.\n\n```python\nx = 1\n```\n"
  indented = "1. Step:\n\n    ```python\n    # docs: not run — needs tunix\n    y = 2\n    ```\n"
  assert hooks.strip_test_markers(indented) == "1. Step:\n\n    ```python\n    y = 2\n    ```\n"
  for page in sorted(DOCS.rglob("*.md")):
    assert "# docs: not run" not in hooks.strip_test_markers(page.read_text()), page


def _load_gallery():
  return _load_hooks().examples_gallery(ROOT)


def test_the_examples_page_has_every_example_with_its_source():
  gallery = _load_gallery()
  assert gallery.MARKER in (DOCS / "examples.md").read_text()
  text = gallery.render(ROOT)
  scripts = sorted(p.name for p in (ROOT / "examples").glob("*.py"))
  assert sorted(p.name for p in gallery.scripts(ROOT)) == scripts
  assert set(gallery.ORDER) == {name[:-3] for name in scripts}  # a new example gets a place
  for name in scripts:
    assert f"`examples/{name}`" in text
    assert f'??? example "The source of `{name}`"' in text
  assert text.index("`examples/optax_quickstart.py`") < text.index("`examples/demo_fp16.py`")
  descriptions = "".join(s.split("??? example")[0] for s in text.split("\n## "))
  assert not re.search(r"(?<!`)``(?!`)", descriptions)  # reST literals became Markdown's


def test_the_examples_page_turns_a_literal_block_into_a_fenced_one(tmp_path):
  gallery = _load_gallery()
  (tmp_path / "examples").mkdir()
  (tmp_path / "examples" / "x.py").write_text(
    '"""Title of ``x``.\n\nRun it as two processes::\n\n  python x.py --n 2\n  python x.py --n 3\n"""\n'
  )
  section = gallery.section(tmp_path / "examples" / "x.py")
  assert section.startswith("## Title of `x`\n")
  assert "Run it as two processes:\n\n```bash\npython x.py --n 2\npython x.py --n 3\n```" in section
  assert "```bash\npython examples/x.py\n```" in section  # no "Run:" line: the plain command
  (tmp_path / "examples" / "y.py").write_text('"""Y.\n\nRun: python examples/y.py [--smoke]\n"""\n')
  section = gallery.section(tmp_path / "examples" / "y.py")
  assert "```bash\npython examples/y.py [--smoke]\n```" in section
  assert "Run:" not in section.split("??? example")[0]
