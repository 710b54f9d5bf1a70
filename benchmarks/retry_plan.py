"""Does ``jls.retry_on_overflow`` leave the host a predicate to read? The H200 plan, by form.

GPT-2 small (``bench_large``'s model, batch 16, cuDNN attention) compiled for the H200 target
without a GPU (``benchmarks/gpu_plan.py``): the plain scaled step (``dynamic_loss_scale``), and
the same with its gradients from ``jls.retry_on_overflow`` (``max_retries=3``) in each form
tried for it, under three sets of XLA options. Per row: the ``while``/``conditional`` thunks
that run outside every CUDA graph (their predicate copied to the host, which waits for it:
``Plan.host_predicates``) and the predicted step time and its ratio to the plain scaled step's
(``Plan.predicted_seconds``: a roofline of the compiled kernels, conditionals priced at their
cheapest branch and loops of unknown trip count as not taken, i.e. a step that does not
overflow). Predicted from the compiled program, not measured.

The forms: ``while`` (a ``lax.while_loop`` of unknown trip count after the first attempt, the
form before this one), ``conds`` (``max_retries`` ``lax.cond`` in a row), ``fori`` (a
``fori_loop`` of ``max_retries`` conds), ``shipped`` (one ``lax.cond`` around a fixed-trip loop
of conds: what ``jax_lossscale`` ships).

Usage (~4 minutes on 2 cores)::

  PYTHONPATH=. .venv-gpu-plan/bin/python benchmarks/retry_plan.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import os
import time

import bench_gpt
import gpu_plan_report
import jax
import jax.numpy as jnp

from jax_lossscale._scaler import _retry

_HERE = os.path.dirname(os.path.abspath(__file__))

#: The retry guide's options ("A step the host does not wait on").
GRAPH_OPTIONS = {
  "xla_gpu_enable_command_buffer": (
    "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL"
  ),
  "xla_gpu_command_buffer_unroll_loops": True,
}
OPTIONS = {
  "as compiled": {},
  "WHILE, CONDITIONAL": {
    "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"
  },
  "the guide's": GRAPH_OPTIONS,
}


def _parts(attempt, n):
  needed, again = _retry.retry_steps(attempt, n)
  return again, needed, lambda c: jax.lax.cond(needed(c), again, lambda c: c, c)


def _first(attempt, s):
  result, finite = attempt(s)
  return (jnp.zeros([], jnp.int32), s, result, finite)


def while_form(attempt, s, n):
  again, needed, _ = _parts(attempt, n)
  c = jax.lax.while_loop(needed, again, _first(attempt, s))
  return c[1], c[2], c[0]


def conds_form(attempt, s, n):
  _, _, one = _parts(attempt, n)
  c = _first(attempt, s)
  for _ in range(n):
    c = one(c)
  return c[1], c[2], c[0]


def fori_form(attempt, s, n):
  _, _, one = _parts(attempt, n)
  c = jax.lax.fori_loop(0, n, lambda i, c: one(c), _first(attempt, s))
  return c[1], c[2], c[0]


FORMS = {
  "while": while_form,
  "conds": conds_form,
  "fori": fori_form,
  "shipped": _retry.retry_loop,
}


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default=os.path.join(_HERE, "results"))
  args = p.parse_args(argv)
  cfg = bench_gpt.GPT2_SMALL._replace(batch=16)
  shipped = _retry.retry_loop
  lines = [
    "GPT-2 small (batch 16, cuDNN attention, AdamW) compiled for the H200 target without a GPU "
    f"(`benchmarks/retry_plan.py`, jax {jax.__version__}). {gpu_plan_report.LIMITS}",
    "",
    "| XLA options | step | host-read predicates | which (thunk: HLO) | predicted ms (MFU 0.4) "
    "| ratio (0.4) | ratio (0.5) |",
    "|---|---|---:|---|---:|---:|---:|",
  ]
  for label, options in OPTIONS.items():
    base = None
    for form in [None, *FORMS]:
      _retry.retry_loop = FORMS[form] if form else shipped
      t0 = time.perf_counter()
      try:
        name = "retry_on_overflow" if form else "dynamic_loss_scale"
        with jax.numpy_dtype_promotion("standard"):
          plan, _ = gpu_plan_report.compile_variant(name, cfg, "h200", "cudnn", options)
      finally:
        _retry.retry_loop = shipped
      ms = {m: 1e3 * plan.predicted_seconds(m) for m in (0.4, 0.5)}
      base = base or ms
      which = "; ".join(plan.host_predicates) or "none"
      lines.append(
        f"| {label} | {form or 'plain scaled step'} | {len(plan.host_predicates)} | {which} "
        f"| {ms[0.4]:.3f} | {ms[0.4] / base[0.4]:.4f} | {ms[0.5] / base[0.5]:.4f} |"
      )
      print(lines[-1], f"({time.perf_counter() - t0:.0f} s)", flush=True)
  text = "\n".join(lines) + "\n"
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "retry-plan-h200.md"), "w") as f:
    f.write(text)
  print("\n" + text)


if __name__ == "__main__":
  main()
