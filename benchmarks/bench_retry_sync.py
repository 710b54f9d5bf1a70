"""Does a step with a retry loop make the host wait? Queue time against run time.

JAX queues a jitted step and returns before the device has run it, so the host
can queue the next steps while the device works. A program that the host must
wait on in the middle (XLA:GPU reads a ``while`` loop's predicate on the host
at each test) returns only once the device has reached that point. Queuing
``--steps`` steps in a row then takes about as long as running them.

For each step (the scaled step, and the same with ``jls.retry_on_overflow``)
this prints the time to queue ``--steps`` steps (no ``block_until_ready``),
the time until they have run, and their ratio: near 0 the host ran ahead, near
1 it waited on every step. ``--child FLAGS`` reruns the measurement in a
process whose ``XLA_FLAGS`` get ``FLAGS`` appended, for the variant where
XLA:GPU evaluates the predicate on the device (command buffers for ``while``
and ``conditional``); a flag the installed XLA rejects is reported, not fatal.

Usage (``make gpu-bench-retry`` on a GPU machine)::

  python benchmarks/bench_retry_sync.py --model gpt --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

#: The XLA:GPU flags of the on-device predicate variant (appended to XLA_FLAGS): the retry
#: guide's ("A step the host does not wait on"). The gpt model scans over its layers, so
#: DYNAMIC_SLICE_FUSION and unrolled loops are needed besides WHILE and CONDITIONAL.
DEVICE_PREDICATE_FLAGS = (
  "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL,+DYNAMIC_SLICE_FUSION"
  " --xla_gpu_command_buffer_unroll_loops=true"
)


def measure(model_name: str, steps: int, rounds: int) -> dict:
  import bench_models
  import jax
  import optax

  import jax_lossscale as jls

  model = bench_models.MODELS[model_name]
  params = model.init_params()
  x, y = model.make_batch()
  tx = jls.dynamic_loss_scale(optax.adam(1e-4))

  def make(retry: bool):
    def step(state, x, y):
      p, o = state
      if retry:
        o, out = jls.retry_on_overflow(model.loss_fn, o)(p, x, y)
        grads = out.grads
      else:
        grads = jax.grad(lambda q: jls.scale_loss(model.loss_fn(q, x, y), o))(p)
      with jax.numpy_dtype_promotion("standard"):  # optax.adam's b1 ** count
        updates, o = tx.update(grads, o, p)
      return optax.apply_updates(p, updates), o

    return jax.jit(step, donate_argnums=0)

  out = {"backend": jax.default_backend(), "device": str(jax.devices()[0]), "steps": steps}
  for name, retry in [("scaled", False), ("retry", True)]:
    step = make(retry)
    state = (params, tx.init(params))
    for _ in range(3):
      state = step(state, x, y)
    jax.block_until_ready(state)
    ratios, queued, ran = [], [], []
    for _ in range(rounds):
      t0 = time.perf_counter()
      for _ in range(steps):
        state = step(state, x, y)
      t1 = time.perf_counter()
      jax.block_until_ready(state)
      t2 = time.perf_counter()
      queued.append(t1 - t0)
      ran.append(t2 - t0)
      ratios.append((t1 - t0) / (t2 - t0))
    med = lambda v: sorted(v)[len(v) // 2]
    out[name] = {"queue_s": med(queued), "run_s": med(ran), "queue_over_run": med(ratios)}
    params = state[0]
  return out


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--model", default="gpt")
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--out", default=None, help="write retry-sync-<backend>.md here")
  parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.child is not None:
    print(json.dumps(measure(args.model, args.steps, args.rounds)))
    return

  rows = {"as compiled": measure(args.model, args.steps, args.rounds)}
  backend = rows["as compiled"]["backend"]
  if backend == "gpu":
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {DEVICE_PREDICATE_FLAGS}")
    cmd = [sys.executable, __file__, "--model", args.model, "--steps", str(args.steps)]
    cmd += ["--rounds", str(args.rounds), f"--child={DEVICE_PREDICATE_FLAGS}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode == 0:
      rows[DEVICE_PREDICATE_FLAGS] = json.loads(proc.stdout.strip().splitlines()[-1])
    else:
      rows[DEVICE_PREDICATE_FLAGS] = {"error": proc.stderr.strip().splitlines()[-1:]}

  lines = [
    f"Queue time over run time of {args.steps} steps of `{args.model}` "
    f"(`benchmarks/bench_retry_sync.py`, {rows['as compiled']['device']}; "
    "near 0: the host ran ahead, near 1: it waited on every step).",
    "",
    "| XLA flags | step | queue (s) | run (s) | queue / run |",
    "|---|---|---:|---:|---:|",
  ]
  for flags, r in rows.items():
    if "error" in r:
      lines.append(f"| `{flags}` | - | - | - | rejected: {r['error']} |")
      continue
    for name in ("scaled", "retry"):
      m = r[name]
      lines.append(
        f"| {flags if flags == 'as compiled' else f'`{flags}`'} | {name} | {m['queue_s']:.4f} "
        f"| {m['run_s']:.4f} | {m['queue_over_run']:.3f} |"
      )
  text = "\n".join(lines) + "\n"
  print(text)
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"retry-sync-{backend}.md"), "w") as f:
      f.write(text)


if __name__ == "__main__":
  main()
