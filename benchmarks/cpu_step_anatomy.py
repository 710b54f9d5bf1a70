"""Where a scaled step's extra time goes on XLA:CPU: the passes over one weight, from the program.

For one benchmark model, plain Adam's step (``baseline``) and ``dynamic_loss_scale``'s
(``jax_lossscale``) are compiled (``bench_variants``, as ``bench.py`` times them), and the
top-level instructions of the optimized program that read or write an array of the model's
largest weight's shape are listed: each is one pass over that weight's memory. Their bytes
(each array operand read once, the result written once) over the weight's element count are the
step's bytes per parameter for that weight. On a memory-bound optimizer step the ratio of the
two sums is the floor of the step-time ratio.

Usage::

  python benchmarks/cpu_step_anatomy.py --model mlp-1m --out benchmarks/results
"""

from __future__ import annotations

import argparse
import math
import os
import re

import bench_models
import bench_variants
import jax
import jax.numpy as jnp

_BYTES = {"f64": 8, "f32": 4, "s32": 4, "u32": 4, "f16": 2, "bf16": 2, "s8": 1, "u8": 1, "pred": 1}
# `%name = f32[512,1024]{1,0} fusion(%a, %b), kind=kLoop, calls=...`
_INSTR = re.compile(r"^\s+(?:ROOT\s+)?(%[\w.\-]+) = (\w+)\[([\d,]*)\]\S* ([\w\-]+)\((.*?)\)")


def _shapes(text: str) -> dict[str, tuple[str, tuple[int, ...]]]:
  """Every array instruction's and parameter's (dtype, shape), by name, in the ENTRY computation."""
  entry = text[text.index("\nENTRY") :]
  shapes = {}
  for line in entry.splitlines()[1:]:
    m = _INSTR.match(line)
    if m:
      dims = tuple(int(d) for d in m.group(3).split(",") if d)
      shapes[m.group(1)] = (m.group(2), dims)
  return shapes


def passes(text: str, size: int) -> tuple[list[dict[str, object]], int]:
  """The ENTRY instructions of a weight's gradient onwards, and how many weights they serve.

  The gradients are the ``dot`` results of ``size`` elements; every instruction that reads one,
  or reads what was computed from one, and reads or writes an array of ``size`` elements, is a
  pass of the optimizer's step over that memory.
  """
  entry = text[text.index("\nENTRY") :]
  shapes = _shapes(text)
  instrs = []
  for line in entry.splitlines()[1:]:
    m = _INSTR.match(line)
    if m:
      instrs.append((m, re.findall(r"%[\w.\-]+", m.group(5)), line))
  seeds = {
    m.group(1)
    for m, _, _ in instrs
    if m.group(4) == "dot" and math.prod(shapes[m.group(1)][1]) == size
  }
  reached, rows = set(seeds), []
  for m, operands, line in instrs:
    name = m.group(1)
    if name not in seeds and not reached.intersection(operands):
      continue
    reached.add(name)
    dtype, dims = shapes[name]
    arrays = [shapes[o] for o in operands if o in shapes]
    read = sum(_BYTES.get(d, 4) for d, s in arrays if s and math.prod(s) == size)
    written = _BYTES.get(dtype, 4) if dims and math.prod(dims) == size else 0
    if not read and not written:
      continue
    meta = re.search(r'op_name="([^"]*)"', line)
    rows.append(
      {
        "name": name,
        "opcode": m.group(4),
        "result": f"{dtype}[{','.join(map(str, dims))}]",
        "read": read,
        "written": written,
        "op": meta.group(1).split("/")[-1] if meta else "",
      }
    )
  return rows, len(seeds)


def compiled_text(variant_name: str, model: bench_models.Model) -> str:
  params = model.init_params(0)
  x, y = model.make_batch(0)
  variant = bench_variants.make_variant(variant_name, model.loss_fn, model.make_tx)
  state = variant.init(jax.tree_util.tree_map(jnp.copy, params))
  return jax.jit(variant.step, donate_argnums=(0,)).lower(state, x, y).compile().as_text()


def markdown(model: bench_models.Model, size: int, found: dict[str, tuple[list, int]]) -> str:
  lines = [
    "# A weight's passes through the optimizer step on XLA:CPU (from the compiled program)",
    "",
    f"{model.label}: its weights of {size:,} elements, from their gradients (the backward's"
    f" `dot`) to the new parameters and Adam's moments. jax {jax.__version__};"
    f" `python benchmarks/cpu_step_anatomy.py --model {model.name}`. Bytes: each operand of a"
    " weight's size read once, the result written once; per weight, the sum over the passes"
    " divided by the number of such weights.",
    "",
  ]
  per_weight = {}
  for variant, (rows, weights) in found.items():
    per_weight[variant] = sum(r["read"] + r["written"] for r in rows) / weights
    lines += [
      f"## `{variant}`: {len(rows) / weights:g} passes and {per_weight[variant]:g} bytes a"
      f" parameter per weight ({weights} weights)",
      "",
      "| instruction | opcode | result | read B | written B | from |",
      "|---|---|---|---:|---:|---|",
    ]
    lines += [
      f"| `{r['name']}` | {r['opcode']} | `{r['result']}` | {r['read']} | {r['written']} | "
      f"`{r['op']}` |"
      for r in rows
    ]
    lines.append("")
  base, scaled = per_weight["baseline"], per_weight["jax_lossscale"]
  lines.append(
    f"Bytes a parameter, `jax_lossscale` over `baseline`: {scaled:g} / {base:g} = {scaled / base:.2f}x."
  )
  return "\n".join(lines) + "\n"


def main(argv=None) -> str:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--model", default="mlp-1m", choices=sorted(bench_models.MODELS))
  p.add_argument("--out", default=None, help="a folder for cpu-step-anatomy.md")
  args = p.parse_args(argv)
  model = bench_models.MODELS[args.model]
  size = max(math.prod(w.shape) for w in jax.tree_util.tree_leaves(model.init_params(0)))
  found = {v: passes(compiled_text(v, model), size) for v in ("baseline", "jax_lossscale")}
  text = markdown(model, size, found)
  if args.out:
    with open(os.path.join(args.out, "cpu-step-anatomy.md"), "w") as f:
      f.write(text)
  print(text)
  return text


if __name__ == "__main__":
  main()
