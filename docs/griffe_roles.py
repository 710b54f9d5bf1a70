"""A griffe extension: Sphinx roles in docstrings (``:func:`name```) rendered as code.

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
