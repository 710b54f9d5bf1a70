"""griffe extensions of the docs build: Sphinx roles as code, the config defaults as values.

The docstrings are Google style and read well as plain text and in ``help()``; a few name
other objects with a Sphinx role. mkdocstrings does not interpret roles, so they become inline
code (``name``) instead of showing the role's markup.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:func|class|meth|mod|data|attr|exc|obj):`~?([^`]+)`")


class SphinxRolesAsCode(griffe.Extension):
  """Rewrites ``:role:`target``` to ```target``` in every docstring griffe loads."""

  def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
    if obj.docstring is not None:
      obj.docstring.value = _ROLE.sub(r"`\1`", obj.docstring.value)


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
