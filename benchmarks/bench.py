"""Step-time, compile-time and memory benchmark of loss scaling in a jitted train step.

Every variant (see ``bench_variants.py``) runs the same full train step (forward +
backward + Adam update, float16 compute, float32 params, batch 32, donated
params and optimizer state) of every model (see ``bench_models.py``) in one process:

* ``baseline``: plain ``optax.adam``, no loss scaling;
* ``jax_lossscale``: ``jax_lossscale.dynamic_loss_scale(optax.adam(...))``;
* ``jls_trainstate``: ``jax_lossscale.flax.TrainState`` (scaler as a field);
* ``flax``: ``flax.training.dynamic_scale.DynamicScale`` with the
  ``jnp.where`` skip of Flax's ImageNet example;
* ``jmp``: ``jmp.DynamicLossScale`` with ``jmp.select_tree``;
* ``optax_aif``: ``optax.apply_if_finite`` with a static loss scale;
* ``cond_ref``: not a peer and not shipped: this library's scaler with the
  inner update skipped by ``lax.cond`` instead of ``jnp.where``, to show what
  the ``jnp.where`` design costs on this backend;
* ``jls_diagnostics``: ``jax_lossscale`` plus ``jax_lossscale.diagnostics.grad_diagnostics``
  on every step (only where the installed package has it);
* ``jls_autocast``: the ``jax_lossscale`` step on ``jls.autocast`` of the model written for
  float32 (its ``plain_loss_fn``), against ``jax_lossscale`` on the model cast by hand.

Compilation (``jax.jit(step).lower(...).compile()``) and warm-up happen
outside the timing; the compiled step's ``memory_analysis()`` gives its peak
temporary memory. Then, in rounds, the variants run in a shuffled order, K
steps each ending in ``block_until_ready``; reported are the median per-step
time, the median over rounds of the per-round ratio to the baseline (and its
min..max), the compile time and the temporary memory. Results go to
``<out>/<name>.json`` and ``<out>/<name>.md``.

Usage::

  python benchmarks/bench.py --out benchmarks/results           # 5 models
  python benchmarks/bench.py --quick --out benchmarks/results   # the small ones
  python benchmarks/bench.py --models deep-1m deep400-1m        # any subset
  python benchmarks/bench.py --render benchmarks/results/bench.json   # JSON -> markdown
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from typing import Any

import bench_models
from bench_models import BATCH
from bench_models import DEFAULT_MODELS
from bench_models import MODELS
from bench_models import QUICK_MODELS
import bench_report
import bench_variants
from bench_variants import INIT_SCALE
from bench_variants import LEARNING_RATE
from bench_variants import STATIC_SCALE
from bench_variants import VARIANTS
import jax
import jax.numpy as jnp
import numpy as np

# (model, variant) pairs left out of --quick: jmp's per-leaf all_finite makes
# XLA's compile time quadratic in the leaf count (~1-2 minutes at 200 leaves on
# 2 CPU cores), which alone would exceed the quick run's budget; the
# diagnostics' 800 scalars compile ~13x longer than the plain step there.
QUICK_SKIP = {("deep-1m", "jmp"), ("deep-1m", "jls_diagnostics")}
MEMORY_FIELDS = (
  "temp_size_in_bytes",
  "argument_size_in_bytes",
  "output_size_in_bytes",
  "alias_size_in_bytes",
  "generated_code_size_in_bytes",
)


# ----------------------------------------------------------------------------- timing


def memory(compiled) -> dict[str, int]:
  """The byte counts of ``compiled.memory_analysis()`` (empty where unsupported; ``bench_large``
  reads its own from these)."""
  try:
    analysis = compiled.memory_analysis()
  except Exception:
    analysis = None
  if analysis is None:
    return {}
  return {f: int(getattr(analysis, f)) for f in MEMORY_FIELDS if hasattr(analysis, f)}


def compile_variant(name: str, model: bench_models.Model, params, x, y):
  """Returns (variant, compiled step, state, lower s, compile s, compile CPU s).

  The CPU seconds (``time.process_time``, all threads of the process) are
  less sensitive than wall time to other processes on a shared machine.
  """
  variant = bench_variants.make_variant(name, model.loss_fn, model.make_tx, model.plain_loss_fn)
  state = variant.init(jax.tree_util.tree_map(jnp.copy, params))
  jitted = jax.jit(variant.step, donate_argnums=(0,))
  t0 = time.perf_counter()
  lowered = jitted.lower(state, x, y)
  t1, c1 = time.perf_counter(), time.process_time()
  compiled = lowered.compile()
  t2, c2 = time.perf_counter(), time.process_time()
  return variant, compiled, state, t1 - t0, t2 - t1, c2 - c1


def timed_steps(compiled, state, x, y, k: int):
  """``k`` steps ending in a device sync: (state, last loss, wall seconds, CPU seconds).

  The timing loop of every benchmark (``bench_large.py`` too). The CPU seconds
  (``time.process_time``, all threads of the process) count this process's work only.
  """
  t0, c0 = time.perf_counter(), time.process_time()
  for _ in range(k):
    state, loss = compiled(state, x, y)
  jax.block_until_ready((state, loss))
  cpu = time.process_time() - c0
  return state, loss, time.perf_counter() - t0, cpu


def run_steps(compiled, state, x, y, k: int, cpu: list | None = None):
  """``k`` steps: (state, wall seconds); the process's CPU seconds (all threads) are
  appended to ``cpu`` if given: on a shared machine they count this process's work only."""
  state, _, wall, cpu_s = timed_steps(compiled, state, x, y, k)
  if cpu is not None:
    cpu.append(cpu_s)
  return state, wall


def bench_model(name: str, args) -> dict[str, Any]:
  model = MODELS[name]
  names = [v for v in args.variants if not (args.quick and (name, v) in QUICK_SKIP)]
  if model.plain_loss_fn is None:  # no float32 model to autocast
    names = [v for v in names if not bench_variants.REGISTRY[v].plain]
  params = model.init_params(0)
  x, y = model.make_batch(1)
  leaves = jax.tree_util.tree_leaves(params)
  n_params = sum(int(np.prod(p.shape)) for p in leaves)
  print(f"\n== {name}: {n_params / 1e6:.2f}M params, {len(leaves)} leaves", flush=True)

  variants, compiled, states, compile_s, lower_s, mem = {}, {}, {}, {}, {}, {}
  compile_cpu_s = {}
  for v in names:
    lows, comps, cpus = [], [], []
    for _ in range(args.compile_reps):
      variant, exe, state, low, comp, cpu = compile_variant(v, model, params, x, y)
      lows.append(low)
      comps.append(comp)
      cpus.append(cpu)
    variants[v], compiled[v], states[v] = variant, exe, state
    lower_s[v], compile_s[v], mem[v] = min(lows), min(comps), memory(exe)
    compile_cpu_s[v] = min(cpus)
    temp = mem[v].get("temp_size_in_bytes", -1) / bench_report.MIB
    print(
      f"  {v:16s} lower {lower_s[v]:7.3f}s  compile {compile_s[v]:7.3f}s  temp {temp:8.1f} MiB",
      flush=True,
    )

  if args.compile_only:
    return {
      "model": name,
      "label": model.label,
      "lower_s": lower_s,
      "compile_s": compile_s,
      "memory": mem,
      "gradient_bytes": sum(int(np.prod(p.shape)) * 4 for p in leaves),
    }

  # Warm-up (also lets the dynamic scales settle after the first overflows).
  for v in names:
    states[v], _ = run_steps(compiled[v], states[v], x, y, args.warmup)
  # Steps per round: about args.round_seconds of baseline work.
  states["baseline"], dt = run_steps(compiled["baseline"], states["baseline"], x, y, 3)
  k = args.steps or max(1, round(args.round_seconds / (dt / 3)))

  times = {v: [] for v in names}
  cpu_times = {v: [] for v in names}
  order = list(names)
  rng = random.Random(args.seed)
  for _ in range(args.rounds):
    rng.shuffle(order)
    for v in order:
      states[v], dt = run_steps(compiled[v], states[v], x, y, k, cpu_times[v])
      times[v].append(dt / k)
      cpu_times[v][-1] /= k

  out = {
    "model": name,
    "label": model.label,
    **model.config,
    "params": n_params,
    "leaves": len(leaves),
    "gradient_bytes": sum(int(np.prod(p.shape)) * 4 for p in leaves),
    "steps_per_round": k,
    "rounds": args.rounds,
    "variants": {},
  }
  base_mem = mem["baseline"].get("temp_size_in_bytes")
  for v in names:
    ratios = [t / b for t, b in zip(times[v], times["baseline"])]
    total = lower_s[v] + compile_s[v]
    base_total = lower_s["baseline"] + compile_s["baseline"]
    s = out["variants"][v] = {
      "step_ms_median": 1e3 * statistics.median(times[v]),
      "step_ms_all": [1e3 * t for t in times[v]],
      "cpu_ms_all": [1e3 * t for t in cpu_times[v]],
      "ratio_median": statistics.median(ratios),
      "ratio_min": min(ratios),
      "ratio_max": max(ratios),
      "lower_s": lower_s[v],
      "compile_s": compile_s[v],
      "compile_ratio": compile_s[v] / compile_s["baseline"],
      "compile_cpu_s": compile_cpu_s[v],
      "compile_cpu_ratio": compile_cpu_s[v] / compile_cpu_s["baseline"],
      "lower_compile_ratio": total / base_total,
      "final": variants[v].describe(states[v]),
    }
    if base_mem and "temp_size_in_bytes" in mem[v]:
      s["temp_bytes"] = mem[v]["temp_size_in_bytes"]
      s["temp_ratio"] = s["temp_bytes"] / base_mem
      s["memory"] = mem[v]
    print(
      f"  {v:16s} {s['step_ms_median']:9.3f} ms/step  ratio {s['ratio_median']:.3f} "
      f"[{s['ratio_min']:.3f}..{s['ratio_max']:.3f}]  compile x{s['compile_ratio']:.2f} "
      f"(lower+compile x{s['lower_compile_ratio']:.2f})  temp x{s.get('temp_ratio', 0):.2f}  "
      f"{s['final']}",
      flush=True,
    )
  return out


# ----------------------------------------------------------------------------- main


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default=os.path.join("benchmarks", "results"))
  parser.add_argument("--quick", action="store_true", help=f"the models {QUICK_MODELS}")
  parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=None)
  parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=None)
  parser.add_argument("--rounds", type=int, default=None)
  parser.add_argument("--steps", type=int, default=0, help="steps per round (0: auto)")
  parser.add_argument("--round-seconds", type=float, default=0.25)
  parser.add_argument("--warmup", type=int, default=5)
  parser.add_argument("--compile-reps", type=int, default=1)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument(
    "--name", default=None, help="output file stem (default bench or bench-quick)"
  )
  parser.add_argument(
    "--compile-only",
    action="store_true",
    help="compile time and temporary memory only: print a table, write nothing",
  )
  parser.add_argument(
    "--render",
    metavar="JSON",
    default=None,
    help="only print the markdown of an earlier run's JSON",
  )
  args = parser.parse_args(argv)
  if args.rounds is None:
    args.rounds = 15 if args.quick else 21
  return args


def installed_variants(requested):
  """The variants to run: ``requested`` (or all), baseline first, missing peers left out.

  A variant left out for a missing package is named on stdout; one asked for
  by name is an error instead.
  """
  names = list(requested or VARIANTS)
  if "baseline" not in names:
    names = ["baseline"] + names
  for v in list(names):
    need = bench_variants.missing(v)
    if need is not None:
      if requested and v in requested:
        raise SystemExit(f"variant {v} was asked for but needs {need}, which is not installed")
      print(f"{v}: {need} is not installed, its column is left out", flush=True)
      names.remove(v)
  return names


def main(argv=None):
  args = parse_args(argv)
  if args.render:
    with open(args.render) as f:
      sys.stdout.write(bench_report.markdown(json.load(f)))
    return
  args.variants = installed_variants(args.variants)
  models = args.models or (QUICK_MODELS if args.quick else DEFAULT_MODELS)
  stem = args.name or ("bench-quick" if args.quick else "bench")

  if args.compile_only:
    results = [bench_model(m, args) for m in models]
    sys.stdout.write(bench_report.memory_markdown(results, args.variants))
    return
  info = bench_report.machine_info()
  print(json.dumps(info, indent=1), flush=True)
  t0 = time.perf_counter()
  results = [bench_model(m, args) for m in models]
  info["wall_s"] = time.perf_counter() - t0

  os.makedirs(args.out, exist_ok=True)
  payload = {
    "machine": info,
    "settings": {
      "batch": BATCH,
      "learning_rate": LEARNING_RATE,
      "init_scale": INIT_SCALE,
      "static_scale": STATIC_SCALE,
      "compute_dtype": "float16",
      "param_dtype": "float32",
      "rounds": args.rounds,
      "compile_reps": args.compile_reps,
      "warmup": args.warmup,
      "seed": args.seed,
      "variants": args.variants,
    },
    "results": results,
  }
  with open(os.path.join(args.out, f"{stem}.json"), "w") as f:
    json.dump(payload, f, indent=1)
  text = bench_report.markdown(payload)
  with open(os.path.join(args.out, f"{stem}.md"), "w") as f:
    f.write(text)
  print("\n" + text)
  print(f"wall time {info['wall_s']:.0f}s")


if __name__ == "__main__":
  main()
