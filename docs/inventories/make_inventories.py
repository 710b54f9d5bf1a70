"""Writes the object inventories that link the API reference to JAX, Optax, Flax and NumPy.

mkdocstrings links a name in a signature (``jax.Array``, ``optax.GradientTransformation``)
to another project's docs through that project's Sphinx ``objects.inv``. The docs build
runs offline, so the inventories live here, one per project, and list only the names the
API reference uses, each with the address of its page in that project's public docs.
``mkdocs.yml`` loads them by path, with each project's docs root as ``base_url``.

Regenerate them after adding a name to :data:`INVENTORIES`::

  python docs/inventories/make_inventories.py

mkdocs keeps what it read from an inventory's URL for a day in its cache
(``~/.cache/mkdocs/mkdocs_url_cache``, under ``XDG_CACHE_HOME`` when that is set): clear
that folder after regenerating, or the next build links with the old inventories.

:func:`referenced_names` lists the names of other projects that the API reference's
signatures use (it needs griffe, which the ``docs`` extra installs); ``tests/test_docs.py``
checks that each one is in an inventory, and that the committed files are what this
script writes.
"""

import pathlib
import re
import sys
import zlib

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]

# The projects whose names the API reference links; a name of another project is not linked.
LINKED_PROJECTS = ("jax", "optax", "flax", "numpy")

# file stem: (project, docs root, {name: (domain:role, page and anchor under the docs root)}).
INVENTORIES = {
  "jax": (
    "JAX",
    "https://docs.jax.dev/en/latest/",
    {
      "jax.Array": ("py:class", "_autosummary/jax.Array.html"),
      "jax.numpy.float16": ("py:class", "_autosummary/jax.numpy.float16.html"),
    },
  ),
  "optax": (
    "Optax",
    "https://optax.readthedocs.io/en/latest/",
    {
      name: ("py:class", f"api/transformations.html#{name}")
      for name in (
        "optax.GradientTransformation",
        "optax.GradientTransformationExtraArgs",
        "optax.OptState",
        "optax.Params",
        "optax.Updates",
      )
    },
  ),
  "flax": (
    "Flax",
    "https://flax.readthedocs.io/en/latest/",
    {
      "flax.nnx.Module": ("py:class", "api_reference/flax.nnx/module.html#flax.nnx.Module"),
      "flax.nnx.Optimizer": (
        "py:class",
        "api_reference/flax.nnx/training/optimizer.html#flax.nnx.optimizer.Optimizer",
      ),
      "flax.nnx.Variable": ("py:class", "api_reference/flax.nnx/variables.html#flax.nnx.Variable"),
      "flax.training.train_state.TrainState": (
        "py:class",
        "api_reference/flax.training.html#flax.training.train_state.TrainState",
      ),
    },
  ),
  "numpy": (
    "NumPy",
    "https://numpy.org/doc/stable/",
    {
      "numpy.dtype": ("py:class", "reference/generated/numpy.dtype.html"),
      "numpy.ndarray": ("py:class", "reference/generated/numpy.ndarray.html"),
    },
  ),
}

_HEADER = (
  "# Sphinx inventory version 2\n"
  "# Project: {project}\n"
  "# Version: \n"
  "# The remainder of this file is compressed using zlib.\n"
)
_LINE = re.compile(
  r"(?P<name>\S+)\s+(?P<role>\S+:\S+)\s+(?P<priority>-?\d+)\s+(?P<uri>\S*)\s+(?P<dispname>.+)"
)


def path(stem: str) -> pathlib.Path:
  """The inventory file of ``stem`` (a key of :data:`INVENTORIES`)."""
  return HERE / f"{stem}.inv"


def render(project: str, names: dict[str, tuple[str, str]]) -> bytes:
  """A Sphinx v2 inventory of ``names`` (name: (domain:role, uri)), sorted by name."""
  body = "".join(f"{name} {role} 1 {uri} -\n" for name, (role, uri) in sorted(names.items()))
  return _HEADER.format(project=project).encode() + zlib.compress(body.encode(), 9)


def parse(data: bytes) -> tuple[str, dict[str, tuple[str, str]]]:
  """The project and the entries (name: (domain:role, uri)) of a Sphinx v2 inventory."""
  lines = data.split(b"\n", 4)
  if lines[0] != b"# Sphinx inventory version 2" or len(lines) < 5:
    raise ValueError("data: not a Sphinx v2 inventory")
  project = lines[1].decode().removeprefix("# Project: ")
  entries = {}
  for line in zlib.decompress(lines[4]).decode().splitlines():
    match = _LINE.fullmatch(line)
    if match is None:
      raise ValueError(f"data: malformed inventory line {line!r}")
    entries[match["name"]] = (match["role"], match["uri"])
  return project, entries


def referenced_names(root: pathlib.Path = ROOT) -> set[str]:
  """The names of :data:`LINKED_PROJECTS` in the signatures of ``docs/api``'s entries.

  Read statically, with griffe: the annotations, default values and return types of the
  functions, the annotations of the attributes and the bases of the classes of each
  ``::: jax_lossscale...`` entry and of its public members.
  """
  import griffe  # here: only the docs extra installs it

  package = griffe.load("jax_lossscale", search_paths=[str(root)], docstring_parser="google")
  names: set[str] = set()

  def add(expr: object) -> None:
    if isinstance(expr, griffe.ExprAttribute | griffe.ExprName):
      names.add(expr.canonical_path)
    elif isinstance(expr, griffe.Expr):
      for part in expr.iterate(flat=False):
        add(part)

  def visit(obj: griffe.Object | griffe.Alias) -> None:
    if obj.is_alias:
      if not obj.target_path.startswith("jax_lossscale."):
        return  # an import of another project's name, not a documented object
      obj = obj.final_target
    if obj.is_function:
      for parameter in obj.parameters:
        add(parameter.annotation)
        add(parameter.default)
      add(obj.returns)
    elif obj.is_attribute:
      add(obj.annotation)
    elif obj.is_class:
      for base in obj.bases:
        add(base)
    if obj.is_class or obj.is_module:
      for name, member in obj.members.items():
        if not name.startswith("_") or name == "__init__":
          visit(member)

  for page in sorted((root / "docs" / "api").glob("*.md")):
    for ident in re.findall(r"^::: (\S+)", page.read_text(), re.M):
      visit(package[ident.removeprefix("jax_lossscale.")])
  return {name for name in names if name.split(".")[0] in LINKED_PROJECTS}


def main() -> int:
  listed = {name for _, _, names in INVENTORIES.values() for name in names}
  missing = sorted(referenced_names() - listed)
  if missing:
    print(f"add to INVENTORIES in {__file__}: {', '.join(missing)}", file=sys.stderr)
    return 1
  for stem, (project, _, names) in INVENTORIES.items():
    path(stem).write_bytes(render(project, names))
  return 0


if __name__ == "__main__":
  sys.exit(main())
