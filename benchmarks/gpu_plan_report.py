"""``make gpu-plan``: ``bench_large.py``'s variants compiled for an H200 and a V100, without a GPU.

Each JAX variant of ``benchmarks/bench_large.py`` (GPT-2 small: 12 layers, d_model 768,
sequence 1024, vocab 50304, batch 16, 16,384 tokens a step; AdamW) is compiled by XLA:GPU for a
compile-only device (``benchmarks/gpu_plan.py``). Per variant: its kernels and launches, the
bytes they read and write, the temporaries, the host round trips, which attention it got, and
a predicted step time and ratio to the float16 step: each kernel's roofline (its dots at a
model FLOP utilisation of the GPU's published peak for their dtype, or its bytes at the GPU's
published bandwidth), summed. Two utilisations bracket the prediction (40% and 50%).

Predicted from the compiled program, not measured: no autotuning ran, the cuDNN graphs were not
built, nothing was executed, and kernel launches are not priced. The hand-cast half variants
ask for cuDNN's attention (``--attention cudnn``, bench_large's default on a GPU); where cuDNN
cannot take it for a target, the einsum attention, and the report says so.

Writes ``<out>/gpu-plan-<target>.{json,md}``.

Usage::

  PYTHONPATH=. python benchmarks/gpu_plan_report.py                   # H200 and V100
  PYTHONPATH=. python benchmarks/gpu_plan_report.py --layers 2 --batch 2 --out /tmp
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import bench_gpt
import bench_large
import bench_report
import bench_variants
import gpu_plan
import jax

_HERE = os.path.dirname(os.path.abspath(__file__))

#: The variants per target: the V100 has no bfloat16 tensor cores (float16 is its half).
VARIANTS = {
  "h200": [
    "float32",
    "float16",
    "dynamic_loss_scale",
    "jls_trainstate",
    "flax_dynamic_scale",
    "bfloat16",
    "autocast_dynamic_loss_scale",
    "autocast_bfloat16",
  ],
  "v100": ["float16", "dynamic_loss_scale", "jls_trainstate", "autocast_dynamic_loss_scale"],
}
#: The attention the variants ask for: cuDNN's fused kernel on the H200 (bench_large's default
#: on a GPU, and what autocast routes to); the einsum attention on the V100, where cuDNN's
#: flash attention does not run (it needs sm_80 or newer; XLA compiles the custom call for
#: sm_70 without building the cuDNN graph, so the plan alone would not show it failing).
ATTENTION = {"h200": "cudnn", "v100": "xla"}
#: The batch per target: GPT-2 small's 16 sequences on the H200; 8 on the V100, whose 32 GB do
#: not hold batch 16's step (its plan needs 32.7 GB of temporaries; XLA's rematerialization
#: cannot bring it under the device's memory).
BATCH = {"h200": 16, "v100": 8}
MFUS = (0.4, 0.5)
LIMITS = (
  "Predicted from the compiled program (XLA:GPU compiled for this target with no GPU): no "
  "autotuning, the cuDNN graphs not built, nothing run, launches not priced. Not a measurement."
)


def attention_of(plan: gpu_plan.Plan) -> str:
  fmha = [k for k in plan.kernels if "fmha" in k.kind.lower()]
  if fmha:
    return f"cuDNN fused ({len(fmha)} kernels: {', '.join(sorted({k.kind for k in fmha}))})"
  return "XLA (einsum/softmax kernels)"


def _retry_variant(cfg, attention: str):
  """``dynamic_loss_scale``'s step with its gradients from ``jls.retry_on_overflow``."""

  def make():
    import optax

    import jax_lossscale as jls

    tx = jls.dynamic_loss_scale(bench_variants.adamw(), init_scale=bench_variants.INIT_SCALE)
    f = lambda p, x, y: bench_gpt.loss_fn(p, x, y, cfg, jax.numpy.float16, attention)

    def step(state, x, y):
      params, opt_state = state
      opt_state, out = jls.retry_on_overflow(f, opt_state)(params, x, y)
      updates, opt_state = tx.update(out.grads, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state), None

    return (lambda p: (p, tx.init(p))), step, lambda s: {}

  return ("float16, jls.retry_on_overflow + jls.dynamic_loss_scale", make)


def compile_variant(
  name: str, cfg, target: str, attention: str, compiler_options: dict[str, Any] | None = None
) -> tuple[gpu_plan.Plan, str]:
  autocast_attention = None if attention == "cudnn" else attention
  specs = {
    **bench_large._jax_steps(cfg, attention),
    **bench_large.autocast_variants(cfg, autocast_attention),
    "retry_on_overflow": _retry_variant(cfg, attention),
  }
  init, step, _ = specs[name][1]()
  params = jax.eval_shape(lambda: bench_gpt.init_params(cfg))
  x, y = jax.eval_shape(lambda: bench_gpt.make_batch(cfg))
  with jax.numpy_dtype_promotion("standard"), gpu_plan.cudnn_answered(target):
    args = (jax.eval_shape(init, params), x, y)
    return gpu_plan.compile_plan(step, args, target, compiler_options=compiler_options), attention


def run(target: str, cfg, variants: list[str]) -> dict[str, Any]:
  results: dict[str, Any] = {}
  notes: dict[str, str] = {}
  for name in variants:
    t0 = time.perf_counter()
    attention = ATTENTION[target]
    try:
      plan, _ = compile_variant(name, cfg, target, attention)
    except Exception as e:  # cuDNN's attention refused for this target: the einsum attention
      if attention == "xla":
        raise
      notes[name] = f"cuDNN attention failed ({type(e).__name__}: {str(e)[:160]}); einsum attention"
      plan, _ = compile_variant(name, cfg, target, "xla")
    s = plan.summary(MFUS[0])
    s.pop("memory")
    s["predicted_ms"] = {str(m): 1e3 * plan.predicted_seconds(m) for m in MFUS}
    s["attention"] = attention_of(plan)
    s["compile_s"] = time.perf_counter() - t0
    results[name] = s
    print(f"[{target}] {name:28s} {s['compile_s']:5.1f}s  {s['attention']}", flush=True)
  ref = results.get("float16")
  for s in results.values():
    if ref:
      s["ratio"] = {m: s["predicted_ms"][m] / ref["predicted_ms"][m] for m in s["predicted_ms"]}
      s["extra_bytes_per_param"] = {
        "read": (s["bytes_read"] - ref["bytes_read"]) / bench_gpt.n_params(cfg),
        "written": (s["bytes_written"] - ref["bytes_written"]) / bench_gpt.n_params(cfg),
      }
  t = gpu_plan.TARGETS[target]
  return {
    "kind": "gpu-plan",
    "target": {
      "name": t.name,
      "label": t.label,
      "file": f"benchmarks/gpu_targets/{t.file}",
      "bandwidth": t.bandwidth,
      "half_flops": t.half_flops,
      "float32_flops": t.float32_flops,
    },
    "settings": {
      "model": cfg._asdict(),
      "params": bench_gpt.n_params(cfg),
      "tokens_per_step": cfg.batch * cfg.seq,
      "mfu": list(MFUS),
      "jax": jax.__version__,
      "reference": "float16",
    },
    "limits": LIMITS,
    "results": results,
    "notes": notes,
  }


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default=os.path.join(_HERE, "results"))
  p.add_argument("--targets", nargs="+", default=list(VARIANTS))
  p.add_argument("--layers", type=int, default=None)
  p.add_argument("--batch", type=int, default=None)
  p.add_argument("--variants", nargs="+", default=None)
  args = p.parse_args(argv)
  cfg = bench_gpt.GPT2_SMALL
  if args.layers:
    cfg = cfg._replace(layers=args.layers)
  if args.batch:
    cfg = cfg._replace(batch=args.batch)
  os.makedirs(args.out, exist_ok=True)
  for target in args.targets:
    target_cfg = cfg if args.batch else cfg._replace(batch=BATCH[target])
    payload = run(target, target_cfg, args.variants or VARIANTS[target])
    base = os.path.join(args.out, f"gpu-plan-{target}")
    with open(base + ".json", "w") as f:
      json.dump(payload, f, indent=1)
    text = bench_report.markdown(payload)
    with open(base + ".md", "w") as f:
      f.write(text)
    print("\n" + text, flush=True)


if __name__ == "__main__":
  main()
