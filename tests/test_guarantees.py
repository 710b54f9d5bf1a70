"""The guarantee tables cite tests that exist: every node id, every test file.

``tests/GUARANTEES.md`` (included in ``docs/guarantees.md``) and ``docs/guarantees.md``
itself name the test behind each promise, as pytest node ids relative to the repository
root (``tests/test_x.py::test_y[param]``; a name without ``[...]`` means every
parametrization) or as whole files. A renamed or deleted test would leave a promise
citing nothing, so each id is checked against what pytest collects.

Why ``pytest --collect-only`` in a subprocess rather than an ``ast`` walk: the cited
parametrize ids are built at run time (``sorted(WRAPPERS)``, ``list(ENTRIES)``, the
product of two ``parametrize`` decorators, ``ids=``), which an ``ast`` walk could only
guess at; collecting gives pytest's own ids, exactly. It collects only the cited files
(no test runs); a cited file that collects nothing because an optional dependency is
missing is skipped outside CI (in CI that is a collection failure).
"""

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = (ROOT / "tests" / "GUARANTEES.md", ROOT / "docs" / "guarantees.md")

# A cited test, in backticks: a file, optionally a test (class::test) and a parametrization.
_CITED = re.compile(r"`(tests/[\w/]+\.py(?:::\w+)*(?:\[[^\]`]+\])?)`")


def cited(page: pathlib.Path) -> list[str]:
  return _CITED.findall(page.read_text())


def test_the_pattern_reads_the_forms_the_pages_use():
  text = (
    "`tests/test_a.py`, `tests/test_a.py::test_b`, `tests/test_a.py::TestC::test_d`, "
    "`tests/test_a.py::test_e[flax.TrainState.value_and_grad]`, `tests/test_a.py::test_f[x-y]`"
    " and not `test_g[...]` nor `tests/GUARANTEES.md`"
  )
  assert _CITED.findall(text) == [
    "tests/test_a.py",
    "tests/test_a.py::test_b",
    "tests/test_a.py::TestC::test_d",
    "tests/test_a.py::test_e[flax.TrainState.value_and_grad]",
    "tests/test_a.py::test_f[x-y]",
  ]


def test_each_page_cites_tests():
  for page in PAGES:
    assert len(cited(page)) >= 20, f"{page.relative_to(ROOT)}: the pattern finds too few ids"


def _collected(files: list[str]) -> set[str]:
  cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
  cmd += ["-o", "addopts=", *files]
  out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, f"collecting {files} failed:\n{(out.stdout + out.stderr)[-4000:]}"
  return {line for line in out.stdout.splitlines() if "::" in line and " " not in line}


def _found(nodeid: str, collected: set[str]) -> bool:
  if "::" not in nodeid:
    return any(c.startswith(nodeid + "::") for c in collected)
  if "[" in nodeid:
    return nodeid in collected
  return any(c == nodeid or c.startswith(nodeid + "[") for c in collected)


def test_every_cited_test_exists():
  ids = sorted({nodeid for page in PAGES for nodeid in cited(page)})
  files = sorted({nodeid.split("::")[0] for nodeid in ids})
  missing_files = [f for f in files if not (ROOT / f).is_file()]
  assert not missing_files, f"cited test files that do not exist: {missing_files}"
  collected = _collected(files)
  empty = [f for f in files if not any(c.startswith(f + "::") for c in collected)]
  if empty:  # only where a module-level skip (a missing optional dependency) left it empty
    pytest.skip(f"collected nothing from {empty} (an optional dependency is missing?)")
  missing = [nodeid for nodeid in ids if not _found(nodeid, collected)]
  assert not missing, "cited in the guarantees but not collected by pytest:\n" + "\n".join(missing)
