"""Where a scaled step's extra time goes: per-kernel device time of two ``bench_large`` variants.

For each variant named (default: ``float16`` and ``dynamic_loss_scale``, GPT-2 small), this
compiles ``bench_large``'s step, runs a warm-up, then traces ``--steps`` steps with
``jax.profiler`` (a Perfetto trace, JSON: no TensorBoard needed) and writes
``<out>/trace-<variant>.json.gz`` and the optimized HLO ``<out>/hlo-<variant>.txt``.
``--summarize DIR`` reads those traces back (on any machine) and prints each variant's device
time by kernel and what differs between them.

Usage::

  PYTHONPATH=. python benchmarks/gpu_step_profile.py --out OUT            # on the GPU
  python benchmarks/gpu_step_profile.py --summarize OUT                    # anywhere
  PYTHONPATH=. python benchmarks/gpu_step_profile.py --tiny --out /tmp/p   # CPU smoke test
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import shutil
import sys
import tempfile


def _profile(args) -> None:
  import bench_gpt
  import bench_large
  import jax
  import jax.numpy as jnp

  cfg = bench_gpt.TINY_GPT if args.tiny else bench_gpt.GPT2_SMALL
  attention = "cudnn" if jax.default_backend() == "gpu" else "xla"
  specs = {**bench_large._jax_steps(cfg, attention), **bench_large.autocast_variants(cfg)}
  params = bench_gpt.init_params(cfg, 0)
  x, y = bench_gpt.make_batch(cfg, 1)
  os.makedirs(args.out, exist_ok=True)
  for name in args.variants:
    init, step, _ = specs[name][1]()
    state = init(jax.tree_util.tree_map(jnp.copy, params))
    compiled = jax.jit(step, donate_argnums=(0,)).lower(state, x, y).compile()
    with open(os.path.join(args.out, f"hlo-{name}.txt"), "w") as f:
      f.write(compiled.as_text())
    for _ in range(3):
      state, loss = compiled(state, x, y)
    jax.block_until_ready(state)
    tmp = tempfile.mkdtemp()
    with jax.profiler.trace(tmp, create_perfetto_trace=True):
      for _ in range(args.steps):
        state, loss = compiled(state, x, y)
      jax.block_until_ready((state, loss))
    found = glob.glob(os.path.join(tmp, "**", "*perfetto_trace.json.gz"), recursive=True)
    if not found:
      raise SystemExit(f"{name}: no Perfetto trace under {tmp}")
    shutil.copy(found[0], os.path.join(args.out, f"trace-{name}.json.gz"))
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"{name}: traced {args.steps} steps", flush=True)


def _device_kernels(path: str) -> dict[str, tuple[float, int]]:
  """kernel name -> (total microseconds, count) on the trace's GPU streams (the threads named
  ``Stream...`` of ``/device:GPU:N``; off a GPU, every event of the host's XLA threads)."""
  with gzip.open(path, "rt") as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  processes, threads = {}, {}
  for e in events:
    if e.get("ph") == "M" and e.get("name") == "process_name":
      processes[e["pid"]] = e.get("args", {}).get("name", "")
    if e.get("ph") == "M" and e.get("name") == "thread_name":
      threads[(e["pid"], e["tid"])] = e.get("args", {}).get("name", "")
  gpu = {pid for pid, n in processes.items() if "/device:GPU" in n}
  if gpu:
    keep = {k for k, n in threads.items() if k[0] in gpu and n.startswith("Stream")}
  else:
    keep = {k for k, n in threads.items() if n.startswith("tf_XLA")}
  out: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
  for e in events:
    if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in keep and "dur" in e:
      out[e["name"]][0] += float(e["dur"])
      out[e["name"]][1] += 1
  return {k: (v[0], int(v[1])) for k, v in out.items()}


#: Kernel kinds by name: cuBLAS's and XLA's matrix products, cuDNN's attention, the rest.
KINDS = (
  ("matrix products", ("nvjet", "gemm_fusion", "cutlass", "sm90_xmma", "cublas")),
  ("attention (cuDNN)", ("cudnn",)),
)


def kind_of(kernel: str) -> str:
  for kind, prefixes in KINDS:
    if any(p in kernel for p in prefixes):
      return kind
  return "other kernels (fusions, copies)"


def summarize(directory: str, variants: list[str], top: int = 25, steps: int = 3) -> str:
  """Each variant's device time and kernel count; the kernels whose time differs most between
  the first two."""
  kernels = {
    v: _device_kernels(os.path.join(directory, f"trace-{v}.json.gz"))
    for v in variants
    if os.path.exists(os.path.join(directory, f"trace-{v}.json.gz"))
  }
  lines = [f"device time a step by kind (ms; {steps} steps traced):"]
  for name, k in kernels.items():
    by_kind: dict[str, float] = collections.defaultdict(float)
    for kernel, (us, _) in k.items():
      by_kind[kind_of(kernel)] += us / steps / 1e3
    cells = ", ".join(f"{kind} {ms:.2f}" for kind, ms in sorted(by_kind.items()))
    lines.append(f"{name}: {sum(by_kind.values()):.2f} ({cells})")
  lines.append("")
  for name, k in kernels.items():
    total = sum(v[0] for v in k.values())
    calls = sum(v[1] for v in k.values())
    lines.append(f"{name}: {total / 1e3:.2f} ms of device time, {calls} kernel runs")
  if len(kernels) >= 2:
    (a, ka), (b, kb) = list(kernels.items())[:2]
    diff = {n: kb.get(n, (0.0, 0))[0] - ka.get(n, (0.0, 0))[0] for n in set(ka) | set(kb)}
    lines.append(f"\nlargest differences, {b} - {a} (microseconds over the traced steps):")
    for n in sorted(diff, key=lambda n: -abs(diff[n]))[:top]:
      lines.append(
        f"{diff[n]:+10.1f}  {n[:100]}  ({ka.get(n, (0, 0))[1]} vs {kb.get(n, (0, 0))[1]} calls)"
      )
  return "\n".join(lines)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default=None)
  p.add_argument("--variants", nargs="+", default=["float16", "dynamic_loss_scale"])
  p.add_argument("--steps", type=int, default=3)
  p.add_argument("--tiny", action="store_true")
  p.add_argument("--summarize", default=None, help="a directory of traces to summarize")
  args = p.parse_args(argv)
  if args.summarize:
    print(summarize(args.summarize, args.variants, steps=args.steps))
    return
  if not args.out:
    sys.exit("--out is required to profile")
  _profile(args)
  print(summarize(args.out, args.variants, steps=args.steps))


if __name__ == "__main__":
  main()
