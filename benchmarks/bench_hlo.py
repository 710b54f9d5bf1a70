"""The optimized HLO of the hand-cast step against the ``jls.autocast`` step, op by op.

For each model, both ``dynamic_loss_scale`` steps of ``bench.py`` (``jax_lossscale`` on the
model cast by hand, ``jls_autocast`` on ``jls.autocast`` of its float32 model) are compiled
(``jax.jit(step).lower(...).compile().as_text()``) and their instructions counted by opcode
and element type (fused computations included): where the two programs differ is where
autocast makes other casts than the hand-cast model (a policy difference) or the same casts
compiled worse (extra converts, lost fusion, layout copies). Prints the differing rows,
the converts by (from, to) and the temporary memory of each.

Usage::

  python benchmarks/bench_hlo.py                      # the quick models and rope-gpt
  python benchmarks/bench_hlo.py --models transformer --dump /tmp/hlo   # also the texts
"""

from __future__ import annotations

import argparse
import collections
import os
import re

import bench
from bench_models import MODELS
from bench_models import QUICK_MODELS

# `%name = f16[2,3]{1,0} opcode(%a, %b), ...`: an instruction with an array result.
_INSTR = re.compile(
  r"^\s+(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\w+)\[[^\]]*\](?:\{[^}]*\})?\s+([\w\-]+)\("
)
# The operand of a convert: `convert(%x)`.
_CONVERT_IN = re.compile(r"convert\(%?([\w.\-]+)\)")
# A computation's header starts in column 0: `%fused_computation.3 (...) -> ... {`, `ENTRY %main...`.
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s")


def census(text: str) -> dict[str, collections.Counter]:
  """Instruction counts of an HLO module: by (opcode, dtype), converts by (from, to), and
  the number of fusions (and other calls) in the unfused computations."""
  ops: collections.Counter = collections.Counter()
  converts: collections.Counter = collections.Counter()
  top: collections.Counter = collections.Counter()
  fused, types = False, {}
  for line in text.splitlines():
    head = _COMPUTATION.match(line)
    if head and line.rstrip().endswith("{"):
      fused = "fused" in head.group(1) or "wrapped" in head.group(1)
      types = {}
      continue
    m = _INSTR.match(line)
    if not m:
      continue
    name, dtype, op = m.groups()
    types[name] = dtype
    ops[(op, dtype)] += 1
    if not fused:
      top[op] += 1
    if op == "convert":
      src = _CONVERT_IN.search(line)
      converts[(types.get(src.group(1), "?") if src else "?", dtype)] += 1
  return {"ops": ops, "converts": converts, "top": top}


def compile_pair(name: str):
  """(hand-cast compiled step, autocast compiled step) of model ``name``."""
  model = MODELS[name]
  params = model.init_params(0)
  x, y = model.make_batch(1)
  out = []
  for v in ("jax_lossscale", "jls_autocast"):
    _, compiled, _, _, _, _ = bench.compile_variant(v, model, params, x, y)
    out.append(compiled)
  return out


def report(name: str, dump: str | None = None) -> None:
  hand, auto = compile_pair(name)
  texts = [hand.as_text(), auto.as_text()]
  if dump:
    os.makedirs(dump, exist_ok=True)
    for tag, t in zip(("hand", "autocast"), texts):
      with open(os.path.join(dump, f"{name}.{tag}.hlo.txt"), "w") as f:
        f.write(t)
  h, a = (census(t) for t in texts)
  mem = [bench.memory(c).get("temp_size_in_bytes", 0) / 2**20 for c in (hand, auto)]
  print(f"\n== {name}: temp MiB hand {mem[0]:.2f}, autocast {mem[1]:.2f}")
  print(
    f"  converts (from->to)   hand {dict(h['converts'])}\n  {'':22s}autocast {dict(a['converts'])}"
  )
  print(
    f"  unfused computations: hand {sum(h['top'].values())} instructions, "
    f"autocast {sum(a['top'].values())}; fusions {h['top']['fusion']} / {a['top']['fusion']}, "
    f"copies {h['top']['copy']} / {a['top']['copy']}"
  )
  keys = sorted(set(h["ops"]) | set(a["ops"]))
  diff = [(k, h["ops"][k], a["ops"][k]) for k in keys if h["ops"][k] != a["ops"][k]]
  print(f"  differing (opcode, dtype) rows: {len(diff)} of {len(keys)}")
  for (op, dt), nh, na in diff:
    print(f"    {op:24s} {dt:5s} hand {nh:4d}  autocast {na:4d}")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=None)
  p.add_argument("--dump", default=None, help="also write both HLO texts to this folder")
  args = p.parse_args(argv)
  for name in args.models or [*QUICK_MODELS, "rope-gpt"]:
    if MODELS[name].plain_loss_fn is None:
      continue
    report(name, args.dump)


if __name__ == "__main__":
  main()
