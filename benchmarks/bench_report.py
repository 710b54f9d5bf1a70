"""The benchmark's report: machine description and the markdown tables.

:func:`markdown` renders a results payload (what ``bench.json`` holds) and
nothing else, so a committed ``bench.json`` re-renders to its ``bench.md``
(``python benchmarks/bench.py --render benchmarks/results/bench.json``).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
from typing import Any

from bench_variants import REGISTRY
import jax

MIB = 2.0**20


def machine_info() -> dict[str, Any]:
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
  for mod in ("jax", "jaxlib", "numpy", "optax", "flax", "jmp", "torch", "jax_lossscale"):
    try:
      versions[mod] = __import__(mod).__version__
    except Exception:
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
    "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
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


def label(name: str) -> str:
  return REGISTRY[name].label if name in REGISTRY else name


def shown_variants(payload: dict[str, Any]) -> list[str]:
  """The variants of a payload in report order (registry order; baseline first)."""
  recorded = payload["settings"].get("variants")
  if recorded:
    return list(recorded)
  present = {v for r in payload["results"] for v in r["variants"]}
  order = [v for v in REGISTRY if v in present]
  return order + sorted(present - set(order))


def _ratio_table(results, variants, last_header, cell, last_cell) -> list[str]:
  """A markdown table: one row per model, one column per non-baseline variant."""
  shown = [v for v in variants if v != "baseline"]
  lines = [
    "| model | " + " | ".join(label(v) for v in shown) + f" | {last_header} |",
    "|---|" + "---|" * len(variants),
  ]
  for r in results:
    cells = [cell(r, r["variants"][v]) if v in r["variants"] else "not run" for v in shown]
    last = last_cell(r, r["variants"]["baseline"])
    lines.append(f"| {r['label']} | " + " | ".join(cells) + f" | {last} |")
  return lines


def _memory_cell(r, s) -> str:
  return f"{s['temp_bytes'] / MIB:.1f} ({s['temp_ratio']:.2f})"


def _memory_last(r, b) -> str:
  grads = r["gradient_bytes"]
  goal = (b["temp_bytes"] + grads) / b["temp_bytes"]
  return f"{b['temp_bytes'] / MIB:.1f} / {grads / MIB:.1f} / {goal:.2f}"


# The goals of issue 18: compile time of dynamic_loss_scale at most 1.5x the
# plain step's (at 200 leaves), grad_diagnostics at most +0.05 of a plain step.
COMPILE_GOAL = 1.5
DIAGNOSTICS_GOAL = 0.05


def _machine_line(info: dict[str, Any]) -> str:
  return (
    f"{info['date']}; {info['device']} ({info['cpu']}, {info['affinity']} cores); "
    + ", ".join(f"{k} {v}" for k, v in info["versions"].items() if v)
    + f"; git {info['git_commit'] or '?'}."
  )


def _diagnostics_extra(r: dict[str, Any]) -> float | None:
  """Median over rounds of (diagnostics step - dynamic_loss_scale step) / baseline step."""
  v = r["variants"]
  if not {"jls_diagnostics", "jax_lossscale"} <= set(v):
    return None
  rounds = zip(
    v["jls_diagnostics"]["step_ms_all"],
    v["jax_lossscale"]["step_ms_all"],
    v["baseline"]["step_ms_all"],
  )
  return statistics.median((d - j) / b for d, j, b in rounds)


def summary_lines(results: list[dict[str, Any]]) -> list[str]:
  """One row per model: step ratio, compile-time ratios, what diagnostics add, against the goals."""
  lines = [
    "Summary: `dynamic_loss_scale` against the plain step. Compile time: XLA compile seconds "
    "(wall / CPU time of the process, the latter less sensitive to a shared machine), goal "
    f"<= {COMPILE_GOAL}x. Diagnostics: what `grad_diagnostics` on every step adds, in plain "
    f"steps (median over rounds of the paired difference), goal <= +{DIAGNOSTICS_GOAL}.",
    "",
    "| model | step ratio | compile ratio (wall / CPU) | diagnostics add |",
    "|---|---|---|---|",
  ]
  for r in results:
    s = r["variants"].get("jax_lossscale")
    if s is None:
      continue
    cpu = f" / {s['compile_cpu_ratio']:.2f}" if "compile_cpu_ratio" in s else ""
    extra = _diagnostics_extra(r)
    diag = "not run" if extra is None else f"{extra:+.3f}"
    lines.append(
      f"| {r['label']} | {s['ratio_median']:.2f} | {s['compile_ratio']:.2f}{cpu} | {diag} |"
    )
  return lines + [""]


def _paired(a: list[float], h: list[float]) -> tuple[float, float, float]:
  """Median, min and max over rounds of the paired ratio ``a / h``."""
  ratios = [x / y for x, y in zip(a, h)]
  return statistics.median(ratios), min(ratios), max(ratios)


def autocast_lines(results: list[dict[str, Any]]) -> list[str]:
  """``jls.autocast`` of the float32 model against the same step on the model cast by hand.

  Empty (nothing rendered) unless some result has both ``jls_autocast`` and ``jax_lossscale``.
  Where every such result has the CPU seconds of each round (``cpu_ms_all``), the table
  gives the paired ratio of both (wall and process CPU time) with its min..max.
  """
  pairs = [
    (r, r["variants"]["jls_autocast"], r["variants"]["jax_lossscale"])
    for r in results
    if {"jls_autocast", "jax_lossscale"} <= set(r["variants"])
  ]
  if not pairs:
    return []
  cpu = all("cpu_ms_all" in a and "cpu_ms_all" in h for _, a, h in pairs)
  rows = []
  for r, a, h in pairs:
    temp = (
      f"{a['temp_bytes'] / h['temp_bytes']:.3f}" if "temp_bytes" in a and "temp_bytes" in h else "-"
    )
    extra = a["lower_s"] - h["lower_s"]
    trace = f"{a['lower_s'] / h['lower_s']:.2f} ({extra:+.2f} s) | {a['compile_s'] / h['compile_s']:.2f} |"
    if cpu:
      wall = "{:.3f} [{:.3f}..{:.3f}]".format(*_paired(a["step_ms_all"], h["step_ms_all"]))
      proc = "{:.3f} [{:.3f}..{:.3f}]".format(*_paired(a["cpu_ms_all"], h["cpu_ms_all"]))
      mib = f"{a['temp_bytes'] / MIB:.2f} / {h['temp_bytes'] / MIB:.2f}" if temp != "-" else "-"
      rows.append(f"| {r['label']} | {wall} | {proc} | {mib} ({temp}) | {trace}")
    else:  # as rendered before the CPU times were recorded
      step = _paired(a["step_ms_all"], h["step_ms_all"])[0]
      trace = trace.replace(f"({extra:+.2f} s)", f"(+{extra:.2f} s)")
      rows.append(f"| {r['label']} | {step:.3f} | {temp} | {trace}")
  intro = (
    "`jls.autocast` of the float32 model against the same `dynamic_loss_scale` step on the "
    "model cast by hand (`jls_autocast` / `jax_lossscale`): step time (median over rounds of "
    "the paired ratio"
  )
  if not cpu:
    return [
      intro + "), temporary memory, trace+lower time (autocast traces the model twice: "
      "once to a jaxpr, once through the policy) and XLA compile time.",
      "",
      "| model | step ratio | temp memory ratio | trace+lower ratio (extra) | compile ratio |",
      "|---|---|---|---|---|",
      *rows,
      "",
    ]
  return [
    intro + ", min..max in brackets; wall time, and the process's CPU time, which counts "
    "this process's work only and so is less sensitive to other processes on a shared "
    "machine), temporary memory (MiB autocast / hand-cast, ratio), trace+lower time "
    "(autocast traces the model twice: once to a jaxpr, once through the policy) and XLA "
    "compile time.",
    "",
    "| model | step ratio (wall) | step ratio (CPU time) | temp MiB (ratio) | "
    "trace+lower ratio (extra) | compile ratio |",
    "|---|---|---|---|---|---|",
    *rows,
    "",
  ]


def markdown(payload: dict[str, Any]) -> str:
  if payload.get("kind") == "gpu-large":
    return large_markdown(payload)
  if payload.get("kind") == "gpu-plan":
    return plan_markdown(payload)
  if payload.get("kind") == "compile-gpt":
    return compile_markdown(payload)
  if payload.get("kind") == "rl-mismatch":
    import rl_mismatch  # benchmarks/ is on the path of whoever imported this module

    return rl_mismatch.markdown(payload)
  if payload.get("kind") == "rl-grpo":
    import rl_grpo  # benchmarks/ is on the path of whoever imported this module

    return rl_grpo.markdown(payload)
  info, settings, results = payload["machine"], payload["settings"], payload["results"]
  variants = shown_variants(payload)
  lines = [
    "# Loss-scaling overhead in a jitted train step",
    "",
    _machine_line(info),
    "",
    *summary_lines(results),
    *autocast_lines(results),
    "Full train step (forward + backward + Adam), float16 compute, float32 params, "
    f"batch {settings['batch']}, donated buffers. Median over {settings['rounds']} rounds "
    "(shuffled order) of the per-round step-time ratio to plain `optax.adam`; min..max in "
    "brackets.",
    "",
  ]
  lines += _ratio_table(
    results,
    variants,
    "baseline ms/step",
    lambda r, s: f"{s['ratio_median']:.2f} [{s['ratio_min']:.2f}..{s['ratio_max']:.2f}]",
    lambda r, b: f"{b['step_ms_median']:.2f}",
  )
  lines += [
    "",
    "Compile time (`jax.jit(step).lower(...).compile()`), ratio to the baseline's "
    "(XLA compile only / trace+lower+compile); baseline seconds in the last column:",
    "",
  ]
  lines += _ratio_table(
    results,
    variants,
    "baseline s",
    lambda r, s: f"{s['compile_ratio']:.2f} / {s['lower_compile_ratio']:.2f}",
    lambda r, b: f"{b['compile_s']:.2f} / {b['lower_s'] + b['compile_s']:.2f}",
  )
  if all("temp_bytes" in s for r in results for s in r["variants"].values()):
    lines += [
      "",
      "Peak temporary memory of the compiled step (`compiled.memory_analysis()."
      "temp_size_in_bytes`: buffers that are neither arguments nor outputs), MiB and "
      "(ratio to the baseline). Last column: baseline MiB / one gradient-sized buffer "
      "(float32, all params) MiB / the goal ratio, baseline plus that buffer:",
      "",
    ]
    lines += _ratio_table(
      results, variants, "baseline / gradients / goal", _memory_cell, _memory_last
    )
  lines += ["", "Per-variant detail:", ""]
  lines += [
    "| model | variant | ms/step (median) | ratio median [min..max] | compile s | lower s | final state |",
    "|---|---|---|---|---|---|---|",
  ]
  for r in results:
    for v in variants:
      s = r["variants"].get(v)
      if s is None:
        continue
      lines.append(
        f"| {r['model']} | {v} | {s['step_ms_median']:.3f} | {s['ratio_median']:.3f} "
        f"[{s['ratio_min']:.3f}..{s['ratio_max']:.3f}] | {s['compile_s']:.3f} | "
        f"{s['lower_s']:.3f} | {json.dumps(s['final'])} |"
      )
  return "\n".join(lines) + "\n"


def memory_markdown(results: list[dict[str, Any]], variants: list[str]) -> str:
  """``--compile-only``: temporary MiB (ratio to the baseline) and compile seconds."""
  lines = [
    "| model | variant | temp MiB | temp / baseline | compile s |",
    "|---|---|---|---|---|",
  ]
  for r in results:
    base = r["memory"]["baseline"].get("temp_size_in_bytes")
    for v in variants:
      if v not in r["memory"]:
        continue
      temp = r["memory"][v].get("temp_size_in_bytes")
      ratio = f"{temp / base:.2f}" if temp and base else "n/a"
      mib = f"{temp / MIB:.1f}" if temp is not None else "n/a"
      lines.append(f"| {r['model']} | {v} | {mib} | {ratio} | {r['compile_s'][v]:.2f} |")
    lines.append(
      f"| {r['model']} | (one float32 gradient buffer) | {r['gradient_bytes'] / MIB:.1f} | "
      f"{r['gradient_bytes'] / base:.2f} | |"
    )
  return "\n".join(lines) + "\n"


def _scaler_memory_lines(results: dict[str, Any], settings: dict[str, Any]) -> list[str]:
  """The scaler's memory over the unscaled float16 step's, in gradient-sized buffers (float32
  gradients: 4 bytes a parameter), from the compiled programs' ``memory_analysis()``."""
  ref = results.get(settings["reference"], {}).get("memory", {}).get("compiled_peak_bytes")
  if ref is None or not settings.get("params"):
    return []
  grads = 4 * settings["params"]
  lines = []
  for n, r in results.items():
    peak = r["memory"].get("compiled_peak_bytes")
    if n != settings["reference"] and peak is not None:
      extra = peak - ref
      lines.append(
        f"- `{n}`: {extra / MIB:+.1f} MiB against `{settings['reference']}`'s compiled peak "
        f"({extra / grads:+.2f} gradient-sized buffers of {grads / MIB:.1f} MiB)"
      )
  if not lines:
    return []
  return ["", "Memory over the unscaled step (compiled peak):", "", *lines]


def large_markdown(payload: dict[str, Any]) -> str:
  """The report of ``bench_large.py`` (GPT-2 small on a GPU, against PyTorch AMP)."""
  info, st, results = payload["machine"], payload["settings"], payload["results"]
  m = st["model"]
  lines = [
    "# GPT-2 small: loss scaling against PyTorch AMP",
    "",
    _machine_line(info) + f" Wall time {info.get('wall_s', 0):.0f} s.",
    "",
    f"A GPT-2-style decoder: {m['layers']} layers, d_model {m['d_model']}, {m['heads']} heads, "
    f"sequence {m['seq']}, vocab {m['vocab']}, {st['params'] / 1e6:.1f}M params (float32), "
    f"batch {m['batch']} ({st['tokens_per_step']} tokens a step), AdamW (lr "
    f"{st['learning_rate']:g}, weight decay {st['weight_decay']:g}); JAX attention "
    f"`{st['attention']}`"
    + (f" (autocast: `{st['autocast_attention']}`)" if st.get("autocast_attention") else "")
    + f", torch `scaled_dot_product_attention`. Median over "
    f"{st['rounds']} rounds of {st['steps_per_round']} steps (shuffled order); the ratio is "
    f"the median per-round step time over `{st['reference']}`'s (no loss scaling), min..max "
    "in brackets. Memory: JAX, the compiled step's arguments + outputs - donated + "
    "temporaries (`memory_analysis()`), and the process's `peak_bytes_in_use` after the "
    "variant's warm-up (cumulative over the variants built before); torch, "
    "`max_memory_allocated()` over its warm-up."
    + (
      f" MFU: tokens/s x {st['flops_per_token'] / 1e9:.3f} GFLOP a token (6 N + 12 L T d) over "
      f"{st['peak_flops'] / 1e12:.0f} TFLOP/s (the H200's dense half-precision peak)."
      if "flops_per_token" in st
      else ""
    ),
    "",
    "| variant | tokens/s | MFU | step ms | ratio to float16 [min..max] | compile s | "
    "compiled peak GiB | process / torch peak GiB | final loss | final state |",
    "|---|---|---|---|---|---|---|---|---|---|",
  ]
  gib = 2.0**30
  for r in results.values():
    mem = r["memory"]
    peak = mem.get("compiled_peak_bytes")
    other = mem.get("torch_max_memory_allocated_bytes", mem.get("process_peak_bytes_after_warmup"))
    memory = (
      f"{r['compile_s']:.1f} | {'n/a' if peak is None else f'{peak / gib:.2f}'} | "
      f"{'n/a' if other is None else f'{other / gib:.2f}'}"
    )
    if "tokens_per_s" not in r:  # built, not timed (the run was cut short)
      lines.append(f"| {r['label']} | not timed | | | | {memory} | | |")
      continue
    mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else "n/a"
    lines.append(
      f"| {r['label']} | {r['tokens_per_s']:,.0f} | {mfu} | {r['step_ms_median']:.2f} | "
      f"{r['ratio_median']:.3f} [{r['ratio_min']:.3f}..{r['ratio_max']:.3f}] | "
      f"{memory} | {r['final_loss']:.4f} | {json.dumps(r['final'])} |"
    )
  lines += _scaler_memory_lines(results, st)
  if payload.get("skipped"):
    lines += ["", "Left out or changed:", ""]
    lines += [f"- `{k}`: {v}" for k, v in payload["skipped"].items()]
  return "\n".join(lines) + "\n"


def plan_markdown(payload: dict[str, Any]) -> str:
  """``make gpu-plan``'s report: the compiled program's kernels, bytes and predicted ratios."""
  t, settings, results = payload["target"], payload["settings"], payload["results"]
  m = settings["model"]
  lo, hi = (str(x) for x in settings["mfu"])
  lines = [
    f"# GPU plan: {t['label']}, predicted from the compiled program",
    "",
    f"**{payload['limits']}**",
    "",
    f"Target `{t['file']}`: {t['bandwidth'] / 1e12:.2f} TB/s, {t['half_flops'] / 1e12:.1f} "
    f"TFLOP/s half-precision dots, {t['float32_flops'] / 1e12:.1f} TFLOP/s float32 dots "
    f"(published figures). Model: GPT-2 small shapes ({m['layers']} layers, d_model "
    f"{m['d_model']}, sequence {m['seq']}, vocab {m['vocab']}, batch {m['batch']}; "
    f"{settings['params'] / 1e6:.1f}M params, {settings['tokens_per_step']} tokens a step), "
    f"AdamW, jax {settings['jax']}. Predicted step: each kernel's roofline (its dots at "
    f"{float(lo):.0%} or {float(hi):.0%} of the peak for their dtype, else its bytes at the "
    "bandwidth), summed; ratio to the float16 step's.",
    "",
    "| model | variant | attention | kernels (launches) | GB read | GB written | "
    "extra B/param read | temporaries GB | host round trips | "
    f"predicted ms ({float(lo):.0%}..{float(hi):.0%}) | predicted ratio |",
    "|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  model = f"GPT-2 small widths, {m['layers']} layers"
  for name, r in results.items():
    ms = r["predicted_ms"]
    ratio = r.get("ratio", {})
    extra = r.get("extra_bytes_per_param", {})
    host = "; ".join(r["host_round_trips"]) or "none"
    lines.append(
      f"| {model} | {name} | {r['attention']} | {r['kernels']} ({r['launches']}) | "
      f"{r['bytes_read'] / 1e9:.2f} | {r['bytes_written'] / 1e9:.2f} | "
      f"{extra.get('read', 0.0):+.2f} | {r['temp_bytes'] / 1e9:.2f} | {host} | "
      f"{ms[lo]:.1f}..{ms[hi]:.1f} | "
      + (f"{ratio[lo]:.4f}..{ratio[hi]:.4f}" if ratio else "-")
      + " |"
    )
  for name, note in payload.get("notes", {}).items():
    lines += ["", f"- {name}: {note}"]
  return "\n".join(lines) + "\n"


def compile_markdown(payload: dict[str, Any]) -> str:
  """``make bench-compile``'s report: trace, lower and compile seconds, and the goals' ratios."""
  settings, results = payload["settings"], payload["results"]
  goals = settings["goals"]
  lines = [
    "# Compile time of a GPT train step (measured)",
    "",
    _machine_line(payload["machine"]),
    "",
    f"`python benchmarks/bench_compile_gpt.py {settings['args']}`. GPT-2 small's widths (d 768, "
    "12 heads), sequence 128, batch 2, vocab 2048, blocks unrolled by a Python loop; one AdamW "
    "step. `adamw`: the model hand-cast to float16; `scaler`: the same with "
    "`dynamic_loss_scale`; `autocast`: the float32 model under `jls.autocast(..., float16)`, the "
    "same scaler; `retry`: `scaler` with `retry_on_overflow`. `h200`: XLA:GPU compiling for an "
    "H200 with no GPU (the compile is a real host-side figure; nothing ran on a GPU). Seconds, "
    f"median of {settings['rounds']} rounds in one process (the variants' order rotated each "
    "round, caches cleared before each compile).",
    "",
    "| model | target | variant | trace s | lower s | compile s | optimized HLO lines |",
    "|---|---|---|---:|---:|---:|---:|",
  ]
  for res in results:
    for v in settings["variants"]:
      m = res["median"][v]
      lines.append(
        f"| GPT, {res['layers']} blocks | {res['target']} | {v} | {m['trace']:.2f} | "
        f"{m['lower']:.2f} | {m['compile']:.2f} | {int(m['hlo_lines'])} |"
      )
  lines += [
    "",
    "Ratios of the XLA compile time, per round, and their median:",
    "",
    "| model | target | ratio | median | rounds | goal |",
    "|---|---|---|---:|---|---|",
  ]
  for res in results:
    for name, r in res["ratios"].items():
      verdict = "-"
      if name in goals:
        limit = goals[name][2]
        verdict = f"<= {limit}: " + ("met" if r["median"] <= limit else "**missed**")
      rounds = ", ".join(f"{x:.2f}" for x in r["rounds"])
      lines.append(
        f"| GPT, {res['layers']} blocks | {res['target']} | {name} | {r['median']:.2f}x | "
        f"{rounds} | {verdict} |"
      )
  return "\n".join(lines) + "\n"
