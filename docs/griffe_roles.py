"""griffe extensions of the docs build: Sphinx roles as links, the config defaults as values.

The docstrings are Google style and read well as plain text and in ``help()``; they name other
objects with a Sphinx role. mkdocstrings does not interpret roles, so each becomes an autorefs
cross-reference (``[`name`][jax_lossscale.name]``) when it names a public object the API
reference documents, and inline code otherwise (a private module, a JAX function). An
unresolved reference fails the strict build, so a rename that breaks a link is caught there.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:func|class|meth|mod|data|attr|exc|obj):`(~?)([^`]+)`")

#: The public namespaces whose ``__all__`` the API reference documents.
_NAMESPACES = ("", ".flax", ".diagnostics", ".torch", ".checkpoint")


def _static_all(ns: str) -> list[str]:
  """The literal ``__all__`` of a public namespace, read without importing it."""
  import ast
  import pathlib

  path = pathlib.Path(__file__).resolve().parents[1] / "jax_lossscale" / f"{ns.lstrip('.')}.py"
  for node in ast.parse(path.read_text()).body:
    if isinstance(node, ast.Assign) and any(
      getattr(t, "id", "") == "__all__" for t in node.targets
    ):
      return list(ast.literal_eval(node.value))
  return []


def _documented() -> dict[str, str]:
  """Every documented identifier, and each short name that names exactly one of them."""
  import importlib

  full: set[str] = set()
  for ns in _NAMESPACES:
    full.add(f"jax_lossscale{ns}")
    try:
      module = importlib.import_module(f"jax_lossscale{ns}")
    except ImportError:  # an optional namespace (flax) without its dependency: names only
      for name in _static_all(ns):
        full.add(f"jax_lossscale{ns}.{name}")
      continue
    for name in getattr(module, "__all__", ()):
      obj = getattr(module, name)
      ident = f"jax_lossscale{ns}.{name}"
      full.add(ident)
      for member in vars(obj) if isinstance(obj, type) else ():
        if not member.startswith("_") and callable(getattr(obj, member, None)):
          full.add(f"{ident}.{member}")
  targets = {ident: ident for ident in full}
  short: dict[str, list[str]] = {}
  for ident in full:
    for k in range(1, 3):
      short.setdefault(".".join(ident.split(".")[-k:]), []).append(ident)
  for name, idents in short.items():
    if len(idents) == 1:
      targets.setdefault(name, idents[0])
  return targets


class SphinxRolesAsCode(griffe.Extension):
  """Rewrites ``:role:`target``` as a link to the documented object, else as ```target```."""

  def __init__(self) -> None:
    super().__init__()
    self._targets: dict[str, str] | None = None

  def _link(self, match: re.Match[str]) -> str:
    if self._targets is None:
      self._targets = _documented()
    tilde, target = match.group(1), match.group(2)
    shown = target.split(".")[-1] if tilde else target
    ident = self._targets.get(target) or self._targets.get(target.removeprefix("jax_lossscale."))
    return f"[`{shown}`][{ident}]" if ident else f"`{shown}`"

  def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
    if obj.docstring is not None:
      obj.docstring.value = _ROLE.sub(self._link, obj.docstring.value)


class ConfigDefaultsAsValues(griffe.Extension):
  """Shows ``DEFAULT_CONFIG.x`` defaults of signatures as their values (``65536.0``).

  The public signatures take their defaults from the one ``DynamicScaleConfig``
  (``jax_lossscale._scaler._state.DEFAULT_CONFIG``); a reader of the reference wants the numbers.
  """

  def on_function_instance(self, *, func: griffe.Function, **kwargs: Any) -> None:
    from jax_lossscale._scaler._state import DEFAULT_CONFIG

    for param in func.parameters:
      default = str(param.default) if param.default is not None else ""
      if default.startswith("DEFAULT_CONFIG."):
        param.default = repr(getattr(DEFAULT_CONFIG, default.split(".", 1)[1]))
