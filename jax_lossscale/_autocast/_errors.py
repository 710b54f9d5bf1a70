"""The exceptions of ``autocast``: one type per kind of mistake.

Each error raised while interpreting an equation names the user's source line that
emitted it (``eqn.source_info``), so the message points at the model, not at JAX.
"""

from __future__ import annotations

from typing import Any

from jax.extend import source_info_util

__all__ = (
  "AutocastError",
  "ClosedOverTracerError",
  "UnsupportedPrimitiveError",
  "where",
)


class AutocastError(TypeError):
  """The base of the errors :func:`jax_lossscale.autocast` raises while interpreting."""


class UnsupportedPrimitiveError(AutocastError):
  """A higher-order primitive that autocast has no rule for (a new JAX primitive)."""


class ClosedOverTracerError(AutocastError):
  """A custom differentiation rule closes over a traced intermediate of the function."""


def where(eqn: Any) -> str:
  """``" (at file.py:12 (fn))"``: the user's source line of a jaxpr equation, or ``""``."""
  try:
    summary = source_info_util.summarize(eqn.source_info)
  except Exception:  # an equation built without source info
    return ""
  return f" (at {summary})" if summary and summary != "unknown" else ""


def unsupported(name: str, eqn: Any = None, detail: str = "") -> UnsupportedPrimitiveError:
  return UnsupportedPrimitiveError(
    f"autocast has no rule for the higher-order primitive `{name}`{where(eqn) if eqn is not None else ''}"
    f"{detail}: it does not know how to rebuild it with cast operands, and it does not fall back "
    "silently. Exclude the region that emits it by wrapping that function in "
    "`jax_lossscale.float32(fn)`: the region then runs exactly as written, on its inputs cast "
    "back to their declared dtypes."
  )
