"""Compile time of a GPT train step: hand-cast, ``jls.autocast``, the scaler and the retry.

A GPT with GPT-2 small's widths (d_model 768, 12 heads, sequence 128, batch 2, vocab 2048),
its blocks unrolled by a Python loop (as most NNX, Equinox and HF-style models are), one
AdamW step. Variants, each a whole jitted step:

* ``adamw``: the model hand-cast to float16 (``bench_gpt``'s casts), plain ``optax.adamw``;
* ``scaler``: the same model, ``jls.dynamic_loss_scale(optax.adamw)``;
* ``autocast``: the float32 model under ``jls.autocast(..., jnp.float16)``, the same scaler;
* ``retry``: ``scaler`` with its gradients from ``jls.retry_on_overflow``.

For each target (``cpu``, and ``h200``: XLA:GPU compiling for an H200 with no GPU, through
JAX's CUDA plugin, as ``gpu_plan.py`` does) and depth, ``--rounds`` rounds in one process,
the variants' order rotated each round, ``jax.clear_caches()`` before each variant: the
seconds to trace, lower and compile. Reported: per variant, the median of each phase; the
ratios of the goals, per round and then their median (autocast / scaler, hand-cast model
with the same scaler: goal <= 1.2; scaler / adamw: goal <= 1.5; retry / scaler, no goal).

Usage::

  python benchmarks/bench_compile_gpt.py --layers 4 12 48 --targets cpu h200 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_lossscale as jls

sys.path.insert(0, os.path.dirname(__file__))
import bench_gpt as bg
import bench_report

VARIANTS = ("adamw", "scaler", "autocast", "retry")
GOALS = {
  "autocast / scaler": ("autocast", "scaler", 1.2),
  "scaler / adamw": ("scaler", "adamw", 1.5),
}
EXTRA = {"retry / scaler": ("retry", "scaler")}


def config(layers: int) -> bg.GPTConfig:
  return bg.GPTConfig(vocab=2048, seq=128, d_model=768, heads=12, layers=layers, batch=2)


def loss_fn(params, x, y, cfg: bg.GPTConfig, dtype) -> jax.Array:
  """``bench_gpt.loss_fn``'s model with its blocks unrolled (one set of ops per block)."""
  b, t = x.shape
  d, nh = cfg.d_model, cfg.heads
  embed = params["embed"]
  h = embed[x] + params["pos"][:t]
  for i in range(cfg.layers):
    p = {k: v[i] for k, v in params["blocks"].items()}
    a = bg.layernorm(h, p["ln1_scale"], p["ln1_bias"], dtype)
    qkv = a @ p["qkv_w"].astype(dtype) + p["qkv_b"].astype(dtype)
    q, k, v = jnp.split(qkv.reshape(b, t, 3, nh, d // nh), 3, axis=2)
    out = bg._attention(q[:, :, 0], k[:, :, 0], v[:, :, 0], "xla").reshape(b, t, d)
    h = h + (out @ p["proj_w"].astype(dtype) + p["proj_b"].astype(dtype)).astype(jnp.float32)
    m = bg.layernorm(h, p["ln2_scale"], p["ln2_bias"], dtype)
    m = jax.nn.gelu(m @ p["fc1_w"].astype(dtype) + p["fc1_b"].astype(dtype), approximate=True)
    h = h + (m @ p["fc2_w"].astype(dtype) + p["fc2_b"].astype(dtype)).astype(jnp.float32)
  h = bg.layernorm(h, params["ln_f_scale"], params["ln_f_bias"], dtype)
  logits = (h @ embed.astype(dtype).T).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def make_step(variant: str, cfg: bg.GPTConfig):
  """``(step, tx)``: the variant's train step ``(params, opt_state, x, y)`` and optimizer."""
  adamw = optax.adamw(1e-3)
  if variant == "adamw":

    def plain(params, opt_state, x, y):
      grads = jax.grad(loss_fn)(params, x, y, cfg, jnp.float16)
      updates, opt_state = adamw.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    return plain, adamw
  tx = jls.dynamic_loss_scale(adamw)
  if variant == "autocast":
    loss = jls.autocast(lambda p, x, y: loss_fn(p, x, y, cfg, jnp.float32), jnp.float16)
  else:
    loss = lambda p, x, y: loss_fn(p, x, y, cfg, jnp.float16)

  if variant == "retry":

    def retried(params, opt_state, x, y):
      opt_state, out = jls.retry_on_overflow(loss, opt_state)(params, x, y)
      updates, opt_state = tx.update(out.grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    return retried, tx

  def scaled(params, opt_state, x, y):
    grads = jax.grad(lambda p: jls.scale_loss(loss(p, x, y), opt_state))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return scaled, tx


def compile_once(variant: str, cfg: bg.GPTConfig, target: str) -> dict[str, float]:
  """Seconds to trace, lower and compile ``variant``'s step for ``target``, from clear caches."""
  step, tx = make_step(variant, cfg)
  params = jax.eval_shape(lambda: bg.init_params(cfg))
  opt_state = jax.eval_shape(tx.init, params)
  x = y = jax.ShapeDtypeStruct((cfg.batch, cfg.seq), jnp.int32)
  args: Any = (params, opt_state, x, y)
  if target != "cpu":
    import gpu_plan

    args = gpu_plan.place(args, gpu_plan.device(target))
  jax.clear_caches()
  t0 = time.perf_counter()
  traced = jax.jit(step, donate_argnums=(0, 1)).trace(*args)
  t1 = time.perf_counter()
  lowered = traced.lower()
  t2 = time.perf_counter()
  compiled = lowered.compile()
  t3 = time.perf_counter()
  return {
    "trace": t1 - t0,
    "lower": t2 - t1,
    "compile": t3 - t2,
    "hlo_lines": float(len(compiled.as_text().splitlines())),
  }


def run(layers: int, target: str, rounds: int, cfg: bg.GPTConfig | None = None) -> dict[str, Any]:
  """``rounds`` rounds of every variant at ``layers`` blocks (``cfg``: other widths, for tests)."""
  cfg = cfg or config(layers)
  compile_once(
    "adamw", cfg._replace(layers=1), target
  )  # discarded: the first compile of a process loads more
  rows: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
  for r in range(rounds):
    order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
    for v in order:
      rows[v].append(compile_once(v, cfg, target))
      print(
        f"  {target} L={layers} round {r} {v}: "
        + ", ".join(f"{k} {val:.2f}" for k, val in rows[v][-1].items()),
        flush=True,
      )
  median = {v: {k: statistics.median(x[k] for x in rows[v]) for k in rows[v][0]} for v in VARIANTS}
  ratios = {}
  for name, (a, b, *_) in {**GOALS, **EXTRA}.items():
    per_round = [rows[a][i]["compile"] / rows[b][i]["compile"] for i in range(rounds)]
    ratios[name] = {"median": statistics.median(per_round), "rounds": per_round}
  return {"layers": layers, "target": target, "rounds": rows, "median": median, "ratios": ratios}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--layers", type=int, nargs="+", default=[4, 12, 48])
  parser.add_argument("--targets", nargs="+", default=["cpu", "h200"])
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  args = parser.parse_args()
  for target in args.targets:
    if target != "cpu":
      import gpu_plan

      if not gpu_plan.plugin_installed():
        parser.error(f"--targets {target} needs JAX's CUDA plugin (make gpu-plan's venv)")
  payload: dict[str, Any] = {
    "kind": "compile-gpt",
    "machine": bench_report.machine_info(),
    "settings": {
      "args": " ".join(sys.argv[1:]),
      "rounds": args.rounds,
      "variants": VARIANTS,
      "goals": {k: [a, b, g] for k, (a, b, g) in GOALS.items()},
      "extra": EXTRA,
    },
    "results": [],
  }
  for target in args.targets:
    for layers in args.layers:
      payload["results"].append(run(layers, target, args.rounds))
      os.makedirs(
        args.out, exist_ok=True
      )  # written after each depth: a cut-short run keeps its rows
      with open(os.path.join(args.out, "bench-compile-gpt.json"), "w") as f:
        json.dump(payload, f, indent=1)
      with open(os.path.join(args.out, "bench-compile-gpt.md"), "w") as f:
        f.write(bench_report.markdown(payload))
  print(bench_report.markdown(payload))


if __name__ == "__main__":
  np.set_printoptions(precision=3)
  main()
