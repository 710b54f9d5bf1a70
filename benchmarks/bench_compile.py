"""What the XLA:CPU ordering flags of ``jax_lossscale._scaler._skip`` cost in compile time and save in memory.

In one process, interleaved (the order reversed every other repetition),
``--reps`` times each, it compiles the same full train step of a benchmark
model as:

* ``baseline``: plain Adam, no loss scaling;
* ``dynamic_loss_scale``: the shipped code (flags on leaves of at least
  ``_skip.LARGE`` elements);
* ``no_flags``: the same with no ordering flag at all (plain ``jnp.where``s);
* ``all_flags``: a flag on every float leaf, however small.

Reported per variant: the median over repetitions of the per-repetition
ratio to the baseline, of the compile's CPU time (``time.process_time``:
less sensitive than wall time to other processes) and of its wall time, the
optimized HLO's line count and the step's temporary memory.

Usage::

  python benchmarks/bench_compile.py --models deep-1m deep-30m --reps 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import bench_models
import bench_variants
import jax
import jax.numpy as jnp

from jax_lossscale._scaler import _skip

_ORDERABLE = _skip._orderable
MODES = {
  "baseline": ("baseline", _ORDERABLE),
  "dynamic_loss_scale": ("jax_lossscale", _ORDERABLE),
  "no_flags": ("jax_lossscale", lambda x: False),
  "all_flags": ("jax_lossscale", lambda x: _ORDERABLE(x) or _skip.is_float(x)),
}


def compile_once(mode: str, model: bench_models.Model, params, x, y) -> dict[str, float]:
  variant_name, orderable = MODES[mode]
  _skip._orderable = orderable
  try:
    variant = bench_variants.make_variant(variant_name, model.loss_fn, model.make_tx)
    state = variant.init(jax.tree_util.tree_map(jnp.copy, params))
    lowered = jax.jit(variant.step, donate_argnums=(0,)).lower(state, x, y)
    c0, t0 = time.process_time(), time.perf_counter()
    compiled = lowered.compile()
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
  finally:
    _skip._orderable = _ORDERABLE
  return {
    "cpu": cpu,
    "wall": wall,
    "hlo_lines": len(compiled.as_text().splitlines()),
    "temp_mib": compiled.memory_analysis().temp_size_in_bytes / 2**20,
  }


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--models", nargs="+", default=["deep-1m", "deep-30m"])
  p.add_argument("--reps", type=int, default=5)
  args = p.parse_args(argv)
  modes = list(MODES)
  print("| model | variant | compile CPU ratio [min..max] | wall ratio | HLO lines | temp MiB |")
  print("|---|---|---|---|---|---|")
  for name in args.models:
    model = bench_models.MODELS[name]
    params = model.init_params(0)
    x, y = model.make_batch(1)
    runs = {m: [] for m in modes}
    for r in range(args.reps):
      for m in modes if r % 2 == 0 else modes[::-1]:
        runs[m].append(compile_once(m, model, params, x, y))
    base = runs["baseline"]
    for m in modes:
      cpu = [a["cpu"] / b["cpu"] for a, b in zip(runs[m], base)]
      wall = [a["wall"] / b["wall"] for a, b in zip(runs[m], base)]
      last = runs[m][-1]
      print(
        f"| {name} | {m} | {statistics.median(cpu):.2f} [{min(cpu):.2f}..{max(cpu):.2f}] | "
        f"{statistics.median(wall):.2f} | {last['hlo_lines']} | {last['temp_mib']:.1f} |",
        flush=True,
      )


if __name__ == "__main__":
  main()
