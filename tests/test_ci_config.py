"""The hosted CI workflow (``.github/workflows/ci.yml``) runs what ``.ci/run`` runs.

* a push and a pull request trigger it;
* its Python matrix is every version that ``requires-python`` admits among 3.11, 3.12
  and 3.13, less the ones listed in :data:`UNCLAIMED` (admitted but not run in CI), so
  raising or lowering ``requires-python`` without the matrix fails here;
* each job sets up the matrix's Python, has a timeout, and runs the commands of
  ``.ci/run`` (read from that script, so the two cannot drift), in its order.
"""

import pathlib
import re
import tomllib

from helpers import import_optional
from packaging.specifiers import SpecifierSet

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / ".github" / "workflows" / "ci.yml"
CANDIDATES = ("3.11", "3.12", "3.13")
#: Versions requires-python admits that the workflow does not claim, with the reason.
UNCLAIMED = {
  "3.13": "the pinned test extra (torch, jmp, jraph, jax-resnet, transformers) has not been "
  "run on it",
}


def _workflow() -> dict:
  yaml = import_optional("yaml")
  return yaml.safe_load(WORKFLOW.read_text())


def _ci_run_commands() -> list[str]:
  """The commands of ``.ci/run``: its lines that are not comments, ``set``, ``cd`` or the shebang."""
  lines = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
  skip = re.compile(r"^(#|set |cd |$)")
  return [ln for ln in lines if not skip.match(ln)]


def _run_lines(job: dict) -> list[str]:
  return [ln.strip() for step in job["steps"] if "run" in step for ln in step["run"].splitlines()]


def test_the_commands_of_ci_run_are_read():
  assert _ci_run_commands() == ["make lint", "make docs", "make test", "make test-newest"]


def test_a_push_and_a_pull_request_trigger_it():
  workflow = _workflow()
  # YAML 1.1 (PyYAML) reads the bare key ``on`` as the boolean True.
  triggers = workflow.get("on", workflow.get(True))
  names = set(triggers) if not isinstance(triggers, str) else {triggers}
  assert {"push", "pull_request"} <= names, triggers


def test_the_python_matrix_is_every_version_requires_python_admits():
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  spec = SpecifierSet(project["requires-python"])
  assert set(UNCLAIMED) <= set(CANDIDATES)
  expected = [v for v in CANDIDATES if v in spec and v not in UNCLAIMED]
  assert expected, f"requires-python {spec} admits none of {CANDIDATES} that CI claims"
  for name, job in _workflow()["jobs"].items():
    matrix = job["strategy"]["matrix"]["python-version"]
    assert [str(v) for v in matrix] == expected, (name, matrix, str(spec))
    assert all(isinstance(v, str) for v in matrix), "quote the versions (3.10 is not 3.1)"


def test_each_job_sets_up_its_python_has_a_timeout_and_runs_ci_run():
  commands = _ci_run_commands()
  jobs = _workflow()["jobs"]
  assert jobs
  for name, job in jobs.items():
    assert 0 < job["timeout-minutes"] <= 360, name  # GitHub's own limit is 360
    setup = [s for s in job["steps"] if str(s.get("uses", "")).startswith("actions/setup-python")]
    assert [s["with"]["python-version"] for s in setup] == ["${{ matrix.python-version }}"], name
    lines = _run_lines(job)
    positions = [lines.index(c) if c in lines else -1 for c in commands]
    assert -1 not in positions, f"{name} does not run {commands} (it runs {lines})"
    assert positions == sorted(positions), f"{name} runs {commands} out of order: {lines}"
