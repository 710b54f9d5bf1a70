"""Step-time and compile-time benchmark of loss scaling in a jitted train step.

Every variant runs the same full train step (forward + backward + Adam update,
float16 compute, float32 params, batch 32, donated params and optimizer
state) in one process:

* ``baseline``: plain ``optax.adam``, no loss scaling;
* ``jax_lossscale``: ``jax_lossscale.dynamic_loss_scale(optax.adam(...))``;
* ``jls_trainstate``: ``jax_lossscale.flax.TrainState`` (scaler as a field);
* ``flax``: ``flax.training.dynamic_scale.DynamicScale`` with the
  ``jnp.where`` skip of Flax's ImageNet example;
* ``jmp``: ``jmp.DynamicLossScale`` with ``jmp.select_tree``;
* ``optax_aif``: ``optax.apply_if_finite`` with a static loss scale;
* ``cond_ref``: not a peer and not shipped: this library's scaler with the
  inner update skipped by ``lax.cond`` instead of ``jnp.where``, to show what
  the ``jnp.where`` design costs on this backend.

Compilation (``jax.jit(step).lower(...).compile()``) and warm-up happen
outside the timing. Then, in rounds, the variants run in a shuffled order, K
steps each ending in ``block_until_ready``; reported are the median per-step
time, the median over rounds of the per-round ratio to the baseline (and its
min..max), and the compile time. Results go to ``<out>/bench.json`` and
``<out>/bench.md``.

Usage::

  python benchmarks/bench.py --out benchmarks/results           # 4 models
  python benchmarks/bench.py --quick --out benchmarks/results   # ~1M models
  python benchmarks/bench.py --models deep-1m deep400-1m        # any subset
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, NamedTuple, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax_lossscale as jls  # noqa: E402

BATCH = 32
LEARNING_RATE = 1e-4
INIT_SCALE = 2.0**16
STATIC_SCALE = 2.0**10  # optax.apply_if_finite: a static scale that never overflows here
COMPUTE = jnp.float16

# name -> layer widths [d_in, d_1, ..., d_out]; one (w, b) pair per layer.
MODELS: Dict[str, List[int]] = {
    "mlp-1m": [512, 1024, 512, 10],  # 1.06M params, 6 leaves
    "deep-1m": [100] * 101,  # 1.01M params, 200 leaves
    "mlp-30m": [2048, 4096, 4096, 1024],  # 29.4M params, 6 leaves
    "deep-30m": [548] * 101,  # 30.1M params, 200 leaves
    # Not in the default set: more leaves, for compile-time scaling.
    "deep400-1m": [50] * 401,  # 1.02M params, 800 leaves
}
DEFAULT_MODELS = ["mlp-1m", "deep-1m", "mlp-30m", "deep-30m"]
QUICK_MODELS = ["mlp-1m", "deep-1m"]
LABELS = {
    "mlp-1m": "MLP ~1M params, 6 leaves",
    "deep-1m": "100 layers ~1M params, 200 leaves",
    "mlp-30m": "MLP ~30M params, 6 leaves",
    "deep-30m": "100 layers ~30M params, 200 leaves",
    "deep400-1m": "400 layers ~1M params, 800 leaves",
}
VARIANTS = ["baseline", "jax_lossscale", "jls_trainstate", "flax", "jmp", "optax_aif", "cond_ref"]
PEERS = ["flax", "jmp", "optax_aif"]
# (model, variant) pairs left out of --quick: jmp's per-leaf all_finite makes
# XLA's compile time quadratic in the leaf count (~2 minutes at 200 leaves on
# 2 CPU cores), which alone would exceed the quick run's budget.
QUICK_SKIP = {("deep-1m", "jmp")}
VARIANT_LABELS = {
    "baseline": "plain optax.adam",
    "jax_lossscale": "jax_lossscale.dynamic_loss_scale",
    "jls_trainstate": "jax_lossscale.flax.TrainState",
    "flax": "Flax DynamicScale + where",
    "jmp": "jmp DynamicLossScale + select_tree",
    "optax_aif": "optax.apply_if_finite (static scale)",
    "cond_ref": "reference: same scaler, lax.cond skip (not shipped)",
}


# ----------------------------------------------------------------------------- model


def init_params(widths: List[int], seed: int = 0) -> Dict[str, Any]:
  rng = np.random.default_rng(seed)
  params = {}
  for i, (d_in, d_out) in enumerate(zip(widths[:-1], widths[1:])):
    w = rng.standard_normal((d_in, d_out), dtype=np.float32) / np.float32(np.sqrt(d_in))
    params[f"layer_{i:03d}"] = {
        "w": jnp.asarray(w, jnp.float32),
        "b": jnp.zeros((d_out,), jnp.float32),
    }
  return params


def make_batch(widths: List[int], seed: int = 1) -> Tuple[jax.Array, jax.Array]:
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((BATCH, widths[0]), dtype=np.float32), COMPUTE)
  y = jnp.asarray(rng.integers(0, widths[-1], size=(BATCH,)), jnp.int32)
  return x, y


def loss_fn(params, x, y):
  """Cross-entropy of a tanh MLP computed in float16 (float32 loss)."""
  h = x
  names = sorted(params)
  for i, name in enumerate(names):
    layer = params[name]
    h = h @ layer["w"].astype(COMPUTE) + layer["b"].astype(COMPUTE)
    if i + 1 < len(names):
      h = jnp.tanh(h)
  logits = h.astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def scaled_loss_fn(scale_state, x, y):
  """``p -> (jax_lossscale.scale_loss(loss), loss)``, for ``jax.grad(..., has_aux=True)``."""

  def scaled(p):
    loss = loss_fn(p, x, y)
    return jls.scale_loss(loss, scale_state), loss

  return scaled


# ----------------------------------------------------------------------------- variants


class Variant(NamedTuple):
  init: Callable[[Any], Any]  # params -> train state (a pytree, donated)
  step: Callable[..., Any]  # (state, x, y) -> (state, loss)
  describe: Callable[[Any], Dict[str, Any]]  # final state -> notes


def make_variant(name: str) -> Variant:
  """Builds a fresh variant (fresh closures, so nothing is cached across builds)."""
  tx = optax.adam(LEARNING_RATE)

  if name == "baseline":

    def step(state, x, y):
      params, opt_state = state
      loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
      updates, opt_state = tx.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state), loss

    return Variant(lambda p: (p, tx.init(p)), step, lambda s: {})

  if name == "jax_lossscale":
    stx = jls.dynamic_loss_scale(tx, init_scale=INIT_SCALE)

    def step(state, x, y):
      params, opt_state = state

      grads, loss = jax.grad(scaled_loss_fn(opt_state, x, y), has_aux=True)(params)
      updates, opt_state = stx.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state), loss

    def describe(state):
      s = jls.get_scale_state(state[1])
      return {"scale": float(s.scale), "skipped_steps": int(s.skipped_steps)}

    return Variant(lambda p: (p, stx.init(p)), step, describe)

  if name == "flax":
    from flax.training import dynamic_scale as flax_ds

    def init(p):
      ds = flax_ds.DynamicScale(
          scale=jnp.asarray(INIT_SCALE, jnp.float32), fin_steps=jnp.zeros([], jnp.int32)
      )
      return (p, tx.init(p), ds)

    def step(state, x, y):
      params, opt_state, ds = state
      grad_fn = ds.value_and_grad(loss_fn)
      ds, is_fin, loss, grads = grad_fn(params, x, y)
      updates, new_opt_state = tx.update(grads, opt_state, params)
      new_params = optax.apply_updates(params, updates)
      # As flax/examples/imagenet/train.py.
      new_opt_state = jax.tree_util.tree_map(
          lambda a, b: jnp.where(is_fin, a, b), new_opt_state, opt_state
      )
      new_params = jax.tree_util.tree_map(
          lambda a, b: jnp.where(is_fin, a, b), new_params, params
      )
      return (new_params, new_opt_state, ds), loss

    return Variant(init, step, lambda s: {"scale": float(s[2].scale)})

  if name == "jmp":
    import jmp

    # jmp 0.0.4's DynamicLossScale cannot be a `jit(...).lower` argument on
    # current JAX (its __post_init__ calls eval_shape on the ArgInfo
    # placeholders that lower() unflattens), so the train state carries its
    # two arrays and the step rebuilds it, as one would with a checkpoint.
    def init(p):
      ls = jmp.DynamicLossScale(jnp.asarray(INIT_SCALE, jnp.float32))
      return (p, tx.init(p), (ls.loss_scale, ls.counter))

    def step(state, x, y):
      params, opt_state, (scale, counter) = state
      loss_scale = jmp.DynamicLossScale(scale, counter)

      def scaled(p):
        loss = loss_fn(p, x, y)
        return loss_scale.scale(loss), loss

      grads, loss = jax.grad(scaled, has_aux=True)(params)
      grads = loss_scale.unscale(grads)
      grads_finite = jmp.all_finite(grads)
      loss_scale = loss_scale.adjust(grads_finite)
      updates, new_opt_state = tx.update(grads, opt_state, params)
      new_params = optax.apply_updates(params, updates)
      params, opt_state = jmp.select_tree(
          grads_finite, (new_params, new_opt_state), (params, opt_state)
      )
      return (params, opt_state, (loss_scale.loss_scale, loss_scale.counter)), loss

    return Variant(init, step, lambda s: {"scale": float(s[2][0])})

  if name == "optax_aif":
    atx = optax.apply_if_finite(tx, max_consecutive_errors=1_000_000)
    inv = np.float32(1.0 / STATIC_SCALE)

    def step(state, x, y):
      params, opt_state = state

      def scaled(p):
        loss = loss_fn(p, x, y)
        return loss * np.float32(STATIC_SCALE), loss

      grads, loss = jax.grad(scaled, has_aux=True)(params)
      grads = jax.tree_util.tree_map(lambda g: g * inv, grads)
      updates, opt_state = atx.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state), loss

    return Variant(
        lambda p: (p, atx.init(p)),
        step,
        lambda s: {"skipped_steps": int(s[1].total_notfinite), "scale": STATIC_SCALE},
    )

  if name == "jls_trainstate":
    from jax_lossscale import flax as jls_flax

    def init(p):
      return jls_flax.TrainState.create(
          apply_fn=None, params=p, tx=tx,
          dynamic_scale=jls.DynamicScaleState.create(init_scale=INIT_SCALE),
      )

    def step(state, x, y):
      out = state.value_and_grad(loss_fn)(state.params, x, y)
      return state.apply_gradients(grads=out.grads, finite=out.finite), out.value

    return Variant(init, step, lambda s: {"scale": float(s.dynamic_scale.scale)})

  if name == "cond_ref":

    def init(p):
      return (p, tx.init(p), jls.DynamicScaleState.create(init_scale=INIT_SCALE))

    def step(state, x, y):
      params, opt_state, ds = state

      grads, loss = jax.grad(scaled_loss_fn(ds, x, y), has_aux=True)(params)
      grads, finite = jls.unscale_and_check(grads, ds)

      def apply(operands):
        params, opt_state = operands
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

      params, opt_state = jax.lax.cond(finite, apply, lambda o: o, (params, opt_state))
      return (params, opt_state, jls.update_scale(ds, finite)), loss

    return Variant(init, step, lambda s: {"scale": float(s[2].scale), "skipped_steps": int(s[2].skipped_steps)})

  raise ValueError(f"variant must be one of {VARIANTS}, got {name!r}.")


# ----------------------------------------------------------------------------- timing


def compile_variant(name: str, params, x, y):
  """Returns (compiled step, state, lower seconds, compile seconds)."""
  variant = make_variant(name)
  state = variant.init(jax.tree_util.tree_map(jnp.copy, params))
  jitted = jax.jit(variant.step, donate_argnums=(0,))
  t0 = time.perf_counter()
  lowered = jitted.lower(state, x, y)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  return variant, compiled, state, t1 - t0, t2 - t1


def run_steps(compiled, state, x, y, k: int):
  t0 = time.perf_counter()
  for _ in range(k):
    state, loss = compiled(state, x, y)
  jax.block_until_ready((state, loss))
  return state, time.perf_counter() - t0


def bench_model(model: str, args) -> Dict[str, Any]:
  names = [v for v in args.variants if not (args.quick and (model, v) in QUICK_SKIP)]
  widths = MODELS[model]
  params = init_params(widths)
  x, y = make_batch(widths)
  n_params = sum(int(np.prod(p.shape)) for p in jax.tree_util.tree_leaves(params))
  n_leaves = len(jax.tree_util.tree_leaves(params))
  print(f"\n== {model}: {n_params / 1e6:.2f}M params, {n_leaves} leaves", flush=True)

  variants, compiled, states, compile_s, lower_s = {}, {}, {}, {}, {}
  for name in names:
    lows, comps = [], []
    for _ in range(args.compile_reps):
      variant, exe, state, low, comp = compile_variant(name, params, x, y)
      lows.append(low)
      comps.append(comp)
    variants[name], compiled[name], states[name] = variant, exe, state
    lower_s[name], compile_s[name] = min(lows), min(comps)
    print(
        f"  {name:14s} lower {lower_s[name]:7.3f}s  compile {compile_s[name]:7.3f}s",
        flush=True,
    )

  # Warm-up (also lets the dynamic scales settle after the first overflows).
  for name in names:
    states[name], _ = run_steps(compiled[name], states[name], x, y, args.warmup)
  # Steps per round: about args.round_seconds of baseline work.
  states["baseline"], dt = run_steps(compiled["baseline"], states["baseline"], x, y, 3)
  k = args.steps or max(1, int(round(args.round_seconds / (dt / 3))))

  times = {name: [] for name in names}
  order = list(names)
  rng = random.Random(args.seed)
  for _ in range(args.rounds):
    rng.shuffle(order)
    for name in order:
      states[name], dt = run_steps(compiled[name], states[name], x, y, k)
      times[name].append(dt / k)

  base = times["baseline"]
  out = {
      "model": model,
      "label": LABELS[model],
      "widths": widths,
      "params": n_params,
      "leaves": n_leaves,
      "steps_per_round": k,
      "rounds": args.rounds,
      "variants": {},
  }
  for name in names:
    ratios = [t / b for t, b in zip(times[name], base)]
    total = lower_s[name] + compile_s[name]
    base_total = lower_s["baseline"] + compile_s["baseline"]
    out["variants"][name] = {
        "step_ms_median": 1e3 * statistics.median(times[name]),
        "step_ms_all": [1e3 * t for t in times[name]],
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "lower_s": lower_s[name],
        "compile_s": compile_s[name],
        "compile_ratio": compile_s[name] / compile_s["baseline"],
        "lower_compile_ratio": total / base_total,
        "final": variants[name].describe(states[name]),
    }
    v = out["variants"][name]
    print(
        f"  {name:14s} {v['step_ms_median']:9.3f} ms/step  ratio {v['ratio_median']:.3f} "
        f"[{v['ratio_min']:.3f}..{v['ratio_max']:.3f}]  compile x{v['compile_ratio']:.2f} "
        f"(lower+compile x{v['lower_compile_ratio']:.2f})  {v['final']}",
        flush=True,
    )
  return out


# ----------------------------------------------------------------------------- report


def machine_info() -> Dict[str, Any]:
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          cpu = line.split(":", 1)[1].strip()
          break
  except OSError:
    pass
  versions = {"python": platform.python_version()}
  for mod in ("jax", "jaxlib", "numpy", "optax", "flax", "jmp", "jax_lossscale"):
    try:
      versions[mod] = __import__(mod).__version__
    except Exception:  # noqa: BLE001 (a peer may be missing)
      versions[mod] = None
  try:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.abspath(__file__)),
        check=False,
    ).stdout.strip()
  except OSError:
    commit = ""
  dev = jax.devices()[0]
  return {
      "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
      "platform": platform.platform(),
      "cpu": cpu,
      "cpu_count": os.cpu_count(),
      "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
      "backend": jax.default_backend(),
      "device": f"{dev.platform}: {dev.device_kind}",
      "device_count": jax.device_count(),
      "versions": versions,
      "git_commit": commit,
  }


def _ratio_table(results, variants, last_header, cell, last_cell) -> List[str]:
  """A markdown table: one row per model, one column per non-baseline variant."""
  shown = [v for v in variants if v != "baseline"]
  lines = [
      "| model | " + " | ".join(VARIANT_LABELS[v] for v in shown) + f" | {last_header} |",
      "|---|" + "---|" * len(variants),
  ]
  for r in results:
    cells = [cell(r["variants"][v]) if v in r["variants"] else "not run" for v in shown]
    last = last_cell(r["variants"]["baseline"])
    lines.append(f"| {r['label']} | " + " | ".join(cells) + f" | {last} |")
  return lines


def markdown(results: List[Dict[str, Any]], info: Dict[str, Any], args) -> str:
  lines = [
      "# Loss-scaling overhead in a jitted train step",
      "",
      f"{info['date']}; {info['device']} ({info['cpu']}, {info['affinity']} cores); "
      + ", ".join(f"{k} {v}" for k, v in info["versions"].items() if v)
      + f"; git {info['git_commit'] or '?'}.",
      "",
      "Full train step (forward + backward + Adam), float16 compute, float32 params, "
      f"batch {BATCH}, donated buffers. Median over {args.rounds} rounds (shuffled "
      "order) of the per-round step-time ratio to plain `optax.adam`; min..max in brackets.",
      "",
  ]
  lines += _ratio_table(
      results, args.variants, "baseline ms/step",
      lambda s: f"{s['ratio_median']:.2f} [{s['ratio_min']:.2f}..{s['ratio_max']:.2f}]",
      lambda b: f"{b['step_ms_median']:.2f}",
  )
  lines += [
      "",
      "Compile time (`jax.jit(step).lower(...).compile()`), ratio to the baseline's "
      "(XLA compile only / trace+lower+compile); baseline seconds in the last column:",
      "",
  ]
  lines += _ratio_table(
      results, args.variants, "baseline s",
      lambda s: f"{s['compile_ratio']:.2f} / {s['lower_compile_ratio']:.2f}",
      lambda b: f"{b['compile_s']:.2f} / {b['lower_s'] + b['compile_s']:.2f}",
  )
  lines += ["", "Per-variant detail:", ""]
  lines += [
      "| model | variant | ms/step (median) | ratio median [min..max] | compile s | lower s | final state |",
      "|---|---|---|---|---|---|---|",
  ]
  for r in results:
    for v in args.variants:
      s = r["variants"].get(v)
      if s is None:
        continue
      lines.append(
          f"| {r['model']} | {v} | {s['step_ms_median']:.3f} | {s['ratio_median']:.3f} "
          f"[{s['ratio_min']:.3f}..{s['ratio_max']:.3f}] | {s['compile_s']:.3f} | "
          f"{s['lower_s']:.3f} | {json.dumps(s['final'])} |"
      )
  return "\n".join(lines) + "\n"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default=os.path.join("benchmarks", "results"))
  parser.add_argument("--quick", action="store_true", help="the two ~1M-parameter models")
  parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=None)
  parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=VARIANTS)
  parser.add_argument("--rounds", type=int, default=None)
  parser.add_argument("--steps", type=int, default=0, help="steps per round (0: auto)")
  parser.add_argument("--round-seconds", type=float, default=0.25)
  parser.add_argument("--warmup", type=int, default=5)
  parser.add_argument("--compile-reps", type=int, default=None)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--name", default=None, help="output file stem (default bench or bench-quick)")
  args = parser.parse_args(argv)
  if "baseline" not in args.variants:
    args.variants = ["baseline"] + list(args.variants)
  if "jmp" in args.variants and importlib.util.find_spec("jmp") is None:
    print("jmp is not installed (pip install -e '.[bench]'): its column is left out", flush=True)
    args.variants = [v for v in args.variants if v != "jmp"]
  models = args.models or (QUICK_MODELS if args.quick else DEFAULT_MODELS)
  if args.rounds is None:
    args.rounds = 15 if args.quick else 21
  if args.compile_reps is None:
    args.compile_reps = 1
  stem = args.name or ("bench-quick" if args.quick else "bench")

  info = machine_info()
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
      },
      "results": results,
  }
  with open(os.path.join(args.out, f"{stem}.json"), "w") as f:
    json.dump(payload, f, indent=1)
  text = markdown(results, info, args)
  with open(os.path.join(args.out, f"{stem}.md"), "w") as f:
    f.write(text)
  print("\n" + text)
  print(f"wall time {info['wall_s']:.0f}s")


if __name__ == "__main__":
  main()
