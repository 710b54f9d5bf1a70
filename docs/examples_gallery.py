"""The examples page (``docs/examples.md``): one section per ``examples/*.py``, from its docstring.

The docs hook replaces :data:`MARKER` with :func:`render`'s Markdown: each script's title (its
docstring's first line), the rest of its docstring, the command that runs it, and its source in a
collapsed block. A new example shows up on the next build with no edit here; the scripts are run
by ``tests/test_examples.py``, not by the docs tests.
"""

from __future__ import annotations

import ast
import pathlib
import re

MARKER = "<!-- examples-gallery -->"

#: The order of the page: first steps, then frameworks, then scale-out, then the demos.
ORDER = (
  "optax_quickstart",
  "flax_linen_trainstate",
  "flax_nnx",
  "equinox_mlp",
  "autocast_equinox",
  "gradient_accumulation",
  "data_parallel",
  "multi_host",
  "transformer_lm",
  "demo_fp16",
  "autocast_trace_cost",
)

_RUN_LINE = re.compile(r"^Run(?::|::)\s*(.*)$")


def _rst_to_markdown(text: str) -> str:
  """The docstrings' reStructuredText, as far as the examples use it, in Markdown.

  ````` ``code`` ````` becomes ``` `code` ```; a paragraph ending in ``::`` is followed by an
  indented literal block, which becomes a fenced ``bash`` block.
  """
  out: list[str] = []
  lines = text.replace("``", "`").splitlines()
  i = 0
  while i < len(lines):
    line = lines[i]
    if line.rstrip().endswith("::"):
      out.append(line.rstrip()[:-1].rstrip(":") + ":" if line.strip() != "::" else "")
      block: list[str] = []
      i += 1
      while i < len(lines) and (not lines[i].strip() or lines[i].startswith(" ")):
        block.append(lines[i])
        i += 1
      code = [b for b in block if b.strip()]
      indent = min(len(b) - len(b.lstrip()) for b in code) if code else 0
      out += ["", "```bash", *[b[indent:] for b in code], "```", ""]
      continue
    out.append(line)
    i += 1
  return "\n".join(out).strip()


def section(path: pathlib.Path) -> str:
  """The Markdown section of one example script."""
  source = path.read_text()
  doc = ast.get_docstring(ast.parse(source)) or path.stem
  title, _, body = doc.partition("\n")
  body_lines = [ln for ln in body.strip().splitlines()]
  run = [m.group(1) for ln in body_lines if (m := _RUN_LINE.match(ln.strip()))]
  body_lines = [ln for ln in body_lines if not _RUN_LINE.match(ln.strip())]
  command = run[0] if run and run[0] else f"python examples/{path.name}"
  parts = [
    f"## {_rst_to_markdown(title.strip().rstrip('.'))}",
    "",
    f"`examples/{path.name}`",
    "",
    _rst_to_markdown("\n".join(body_lines)),
    "",
  ]
  if not (run and not run[0]):  # "Run::" introduces its own literal block in the body
    parts += ["```bash", command, "```", ""]
  fence = "````" if "```" in source else "```"
  parts += [f'??? example "The source of `{path.name}`"', ""]
  parts += ["    " + ln if ln else "" for ln in [f"{fence}python", *source.splitlines(), fence]]
  return "\n".join(parts) + "\n"


def scripts(root: pathlib.Path) -> list[pathlib.Path]:
  """``examples/*.py`` in the page's order (:data:`ORDER`, then any other by name)."""
  found = {p.stem: p for p in (root / "examples").glob("*.py")}
  ordered = [found.pop(name) for name in ORDER if name in found]
  return ordered + [found[name] for name in sorted(found)]


def render(root: pathlib.Path) -> str:
  """The gallery's Markdown: one :func:`section` per example script."""
  return "\n".join(section(p) for p in scripts(root))
