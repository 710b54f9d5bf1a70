"""mkdocs hooks of the docs site (``mkdocs.yml``: ``hooks:``); not a page (``exclude_docs``).

* ``<!-- benchmark-tables -->`` on a page is replaced by the tables of every
  ``benchmarks/results/*.json``, rendered by ``benchmarks/bench_report.py`` (the renderer
  that writes the committed ``.md`` next to each JSON file), newest first
  (:func:`results_files`): a new results file shows up on the next build, with no edit here.
* ``<!-- policy-table -->``, ``<!-- rules-table -->`` and ``<!-- registrations-table -->``
  (``docs/guides/autocast.md``) are replaced by the autocast tables rendered from the code
  by ``docs/autocast_tables.py`` (:func:`autocast_tables`).
* ``<!-- examples-gallery -->`` (``docs/examples.md``) is replaced by a section per
  ``examples/*.py``, from its docstring and source, by ``docs/examples_gallery.py``.
* ``examples/assets/*.png`` (the demo's picture) are added to the site as ``assets/``.
* ``# docs: not run — <reason>`` lines (``tests/test_docs.py``'s marker of a code block it
  does not execute) are left out of the rendered pages (:func:`strip_test_markers`).
* The build fails if a name in the ``__all__`` of ``jax_lossscale`` or of one of its public
  namespaces (``jax_lossscale/<name>.py``) has no ``::: jax_lossscale...`` entry in ``docs/api/``.

``tests/test_docs.py`` calls :func:`public_names`, :func:`missing_api_entries` and
:func:`benchmark_tables` too; ``tests/autocast/test_guide.py`` calls :func:`autocast_tables`.
"""

from __future__ import annotations

import ast
import json
import pathlib
import re
import sys

BENCH_MARKER = "<!-- benchmark-tables -->"
_ENTRY = re.compile(r"^:::\s+(jax_lossscale(?:\.\w+)*)\s*$", re.M)


def _all_of(path: pathlib.Path) -> list[str]:
  """The names of a module's ``__all__`` (a tuple or list of strings), read without importing."""
  for node in ast.parse(path.read_text()).body:
    targets = node.targets if isinstance(node, ast.Assign) else []
    if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
      return [str(v) for v in ast.literal_eval(node.value)]
  return []


def public_names(root: pathlib.Path) -> list[str]:
  """Every public name: ``jax_lossscale.X`` and ``jax_lossscale.<namespace>.X``, sorted."""
  package = root / "jax_lossscale"
  names = [f"jax_lossscale.{n}" for n in _all_of(package / "__init__.py")]
  for module in sorted(package.glob("[!_]*.py")):
    names += [f"jax_lossscale.{module.stem}.{n}" for n in _all_of(module)]
  return sorted(names)


def api_entries(root: pathlib.Path) -> set[str]:
  """The identifiers of the ``::: identifier`` blocks of ``docs/api/*.md``."""
  entries: set[str] = set()
  for page in (root / "docs" / "api").glob("*.md"):
    entries.update(_ENTRY.findall(page.read_text()))
  return entries


def missing_api_entries(root: pathlib.Path) -> list[str]:
  """The public names without an API entry (empty when the reference is complete)."""
  entries = api_entries(root)
  return [n for n in public_names(root) if n not in entries]


def results_files(root: pathlib.Path) -> list[tuple[pathlib.Path, dict]]:
  """Each ``benchmarks/results/*.json`` and its contents, newest first.

  Ordered by the date of the machine that measured it (``machine.date``, ``YYYY-MM-DD HH:MM
  UTC``), then by name; files without a date (the GPU plans, compiled and not run) come last.
  """
  loaded = [
    (p, json.loads(p.read_text())) for p in (root / "benchmarks" / "results").glob("*.json")
  ]
  undated = sorted((p, d) for p, d in loaded if not d.get("machine", {}).get("date"))
  dated = sorted(
    ((p, d) for p, d in loaded if d.get("machine", {}).get("date")),
    key=lambda item: (item[1]["machine"]["date"], item[0].name),
    reverse=True,
  )
  return dated + undated


def benchmark_tables(root: pathlib.Path) -> str:
  """Markdown: one section per ``benchmarks/results/*.json``, newest first, by ``bench_report``."""
  bench_dir = str(root / "benchmarks")
  if bench_dir not in sys.path:
    sys.path.insert(0, bench_dir)
  import bench_report

  sections = []
  for path, payload in results_files(root):
    body = bench_report.markdown(payload).splitlines()
    if body and body[0].startswith("# "):  # the report's own title; the section names the file
      body = body[1:]
    sections.append(f"## `benchmarks/results/{path.name}`\n\n" + "\n".join(body).strip() + "\n")
  return "\n".join(sections) if sections else "No results in `benchmarks/results/` yet.\n"


def autocast_tables(root: pathlib.Path):
  """The module ``docs/autocast_tables.py``: the autocast guide's renderers and placeholders."""
  docs_dir = str(root / "docs")
  if docs_dir not in sys.path:
    sys.path.insert(0, docs_dir)
  import autocast_tables

  return autocast_tables


def examples_gallery(root: pathlib.Path):
  """The module ``docs/examples_gallery.py``: the examples page's renderer."""
  docs_dir = str(root / "docs")
  if docs_dir not in sys.path:
    sys.path.insert(0, docs_dir)
  import examples_gallery

  return examples_gallery


def _root(config) -> pathlib.Path:
  return pathlib.Path(config["config_file_path"]).resolve().parent


def on_files(files, config, **kwargs):
  """Adds the demo's pictures (``examples/assets/*.png``) to the site as ``assets/``."""
  from mkdocs.structure.files import File

  for png in sorted((_root(config) / "examples" / "assets").glob("*.png")):
    files.append(File.generated(config, f"assets/{png.name}", abs_src_path=str(png)))
  return files


#: ``tests/test_docs.py``'s marker of a code block it does not run: the first line of the block.
_NOT_RUN_LINE = re.compile(r"^([ \t]*)# docs: not run — .*\n", re.M)


def strip_test_markers(markdown: str) -> str:
  """The page without ``# docs: not run — <reason>`` lines: they are for the tests, not readers."""
  return _NOT_RUN_LINE.sub("", markdown)


def on_page_markdown(markdown, page, config, files, **kwargs):
  markdown = strip_test_markers(markdown)
  if BENCH_MARKER in markdown:
    markdown = markdown.replace(BENCH_MARKER, benchmark_tables(_root(config)))
  gallery = examples_gallery(_root(config))
  if gallery.MARKER in markdown:
    markdown = markdown.replace(gallery.MARKER, gallery.render(_root(config)))
  tables = autocast_tables(_root(config))
  if any(placeholder in markdown for placeholder in tables.PLACEHOLDERS):
    markdown = tables.render(markdown)
  return markdown


def on_pre_build(config, **kwargs):
  from mkdocs.exceptions import PluginError

  missing = missing_api_entries(_root(config))
  if missing:
    raise PluginError(
      "public names without an entry in docs/api/ (add a '::: name' block): " + ", ".join(missing)
    )
