"""``make gpu-bench-large``: loss scaling at GPT-2 small size, against PyTorch AMP, on one GPU.

The model (``bench_gpt.GPT2_SMALL``): a GPT-2-style decoder, 12 layers,
d_model 768, 12 heads, sequence 1024, vocab 50304, ~124M params, layers under
``lax.scan``; float32 params, AdamW (lr 1e-4, weight decay 0.1), batch 16
(16,384 tokens a step). Variants, all the same model, shapes and batch:

* ``float32``: float32 compute, plain AdamW;
* ``float16``: float16 compute, plain AdamW, no loss scaling (the reference
  of every ratio: what loss scaling should cost nothing against);
* ``dynamic_loss_scale``: ``jls.dynamic_loss_scale(adamw)``;
* ``jls_trainstate``: ``jax_lossscale.flax.TrainState`` (the scaler a field);
* ``flax_dynamic_scale``: Flax's ``DynamicScale`` with the ``jnp.where`` skip
  of Flax's ImageNet example;
* ``bfloat16``: bfloat16 compute with ``jls.no_loss_scale(adamw)``;
* ``torch_eager`` / ``torch_compile``: the same architecture in PyTorch with
  ``torch.autocast(float16)``, ``torch.amp.GradScaler`` and fused AdamW,
  eager and with ``torch.compile(model)``.

* ``autocast_dynamic_loss_scale`` / ``autocast_bfloat16``: the same two steps on
  ``jls.autocast`` of the float32 model, whose attention is ``jax.nn.dot_product_attention``
  (cuDNN on a GPU under autocast, as the hand-cast variants'; see :func:`autocast_variants`).

Every variant is compiled (and warmed up) first, its compile time printed;
then in ``--rounds`` rounds, in a shuffled order, each runs ``--steps``
steps ending in a device sync. Reported: tokens/s (median over rounds), the
median per-round ratio of step time to ``float16``'s, compile seconds, and
memory: for JAX the compiled step's ``memory_analysis()`` (arguments +
outputs + temporaries, less aliased donations) and the process-wide
``peak_bytes_in_use`` after the variant's warm-up (cumulative: JAX cannot
reset it); for torch ``torch.cuda.max_memory_allocated()`` over its warm-up
(reset before). Writes ``<out>/<name>.json`` and ``.md``.

Sized for a 10-minute device budget: expected ~4-6 minutes on one H200
(compiles dominate; ``--budget-s`` skips what would not fit and says so).

Usage::

  PYTHONPATH=. python benchmarks/bench_large.py                  # GPU, GPT-2 small
  PYTHONPATH=. python benchmarks/bench_large.py --tiny --out /tmp # CPU smoke test
"""

from __future__ import annotations

import os

# JAX must not take 75% of the GPU up front: torch shares the device here.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse
import json
import random
import statistics
import time
import traceback
from typing import Any
from typing import Callable
from typing import NamedTuple

import bench
import bench_gpt
from bench_gpt import GPTConfig
import bench_report
import bench_variants
from bench_variants import INIT_SCALE
from bench_variants import LEARNING_RATE
from bench_variants import WEIGHT_DECAY
from bench_variants import adamw
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_lossscale as jls

_HERE = os.path.dirname(os.path.abspath(__file__))
REFERENCE = "float16"
T0 = time.perf_counter()


def log(msg: str) -> None:
  print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


class Built(NamedTuple):
  """A variant ready to run: ``run(k) -> (seconds, last loss)`` after its warm-up."""

  run: Callable[[int], tuple[float, float]]
  compile_s: float
  memory: dict[str, Any]
  notes: Callable[[], dict[str, Any]]
  attention: str = ""


def attention_of(hlo: str) -> str:
  """Which attention a compiled step got, read from its optimized HLO."""
  kernels = hlo.count('custom_call_target="__cudnn$fmha')
  if kernels:
    return f"cuDNN fused attention ({kernels} custom calls)"
  return "XLA attention (einsum and softmax kernels)"


# ----------------------------------------------------------------------------- JAX


def _scaled_variant(wrap, make_loss):
  """A variant maker: AdamW inside ``wrap`` (a jax_lossscale scaler), trained on the loss
  ``make_loss()`` builds (the hand-cast model or autocast of the float32 one); the step is
  ``bench_variants.scaled_variant``'s."""
  return lambda: bench_variants.scaled_variant(wrap(adamw()), make_loss())


def _jax_steps(cfg: GPTConfig, attention: str) -> dict[str, tuple[str, Callable[[], Any]]]:
  """name -> (label, make() -> (init(params) -> state, step(state, x, y) -> (state, loss),
  notes(state))): ``bench_variants``' builders (a ``Variant``) on the GPT's loss, with AdamW."""

  def loss(dtype):
    att = "xla" if dtype == jnp.float32 else attention  # cuDNN attention is half-only
    return lambda p, x, y: bench_gpt.loss_fn(p, x, y, cfg, dtype, att)

  def plain(dtype):
    return lambda: bench_variants.baseline(loss(dtype), adamw)

  def wrapped(dtype, wrap):
    return _scaled_variant(wrap, lambda: loss(dtype))

  def trainstate():
    return bench_variants.jls_trainstate(loss(jnp.float16), adamw)

  def flax_ds():
    return bench_variants.flax_dynamic_scale(loss(jnp.float16), adamw)

  dls = lambda tx: jls.dynamic_loss_scale(tx, init_scale=INIT_SCALE)
  return {
    "float32": ("float32, plain AdamW", plain(jnp.float32)),
    "float16": ("float16, plain AdamW (no loss scaling)", plain(jnp.float16)),
    "float16_static_scale": (
      f"float16, static loss scale 2^{STATIC_EXPONENT} (no check, no skip)",
      lambda: static_scale(loss(jnp.float16)),
    ),
    "dynamic_loss_scale": ("float16, jls.dynamic_loss_scale", wrapped(jnp.float16, dls)),
    "jls_trainstate": ("float16, jls.flax.TrainState", trainstate),
    "flax_dynamic_scale": ("float16, Flax DynamicScale + where", flax_ds),
    "bfloat16": ("bfloat16, jls.no_loss_scale", wrapped(jnp.bfloat16, jls.no_loss_scale)),
  }


#: The static scale's exponent: the scale ``dynamic_loss_scale`` settles at on this model
#: (2^16 overflows on its first step and backs off to 2^15, measured on an H200).
STATIC_EXPONENT = 15


def static_scale(loss_fn) -> bench_variants.Variant:
  """Plain AdamW on gradients of the loss times a constant 2^15, divided back in float32:
  what loss scaling costs with no finiteness check and no skip. Its backward multiplies the
  same scaled cotangents as ``dynamic_loss_scale``'s, where ``float16``'s multiplies
  unscaled ones, mostly flushed to zero: the two references apart show the matrix
  products' data-dependent speed apart from the scaler's own work."""
  tx = adamw()
  scale = jnp.float32(2.0**STATIC_EXPONENT)

  def step(state, x, y):
    params, opt_state = state

    def scaled(p):
      value = loss_fn(p, x, y)
      return value * scale, value

    grads, value = jax.grad(scaled, has_aux=True)(params)
    grads = jax.tree_util.tree_map(lambda g: g / scale, grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), value

  return bench_variants.Variant(lambda p: (p, tx.init(p)), step, lambda s: {})


def autocast_variants(
  cfg: GPTConfig, attention: str | None = None
) -> dict[str, tuple[str, Callable[[], Any]]]:
  """The ``jls.autocast`` variants, beside the hand-cast ones: the same step and optimizer.

  The model is ``bench_gpt.loss_fn`` with ``dtype=float32`` (the float32 model: every cast
  of the hand-cast model a no-op), run under ``jls.autocast(..., float16 or bfloat16)``.
  Its attention (``attention=None``) is ``jax.nn.dot_product_attention(...,
  implementation=None)``, which autocast runs as one lower-precision op (torch's
  ``scaled_dot_product_attention``): lowered for CUDA it takes cuDNN's fused kernel for the
  half inputs, the kernel of the hand-cast variants' default ``--attention cudnn`` (where
  cuDNN cannot, JAX's XLA implementation, and the reason is logged); lowered for the CPU the
  XLA implementation in float32, returned in the half dtype. Each variant's log says which
  attention its compiled step got. ``attention="xla"`` (``--attention xla``): the einsum
  attention, as the hand-cast variants'. Empty where the installed package has no
  ``autocast``.
  """
  if not hasattr(jls, "autocast"):
    return {}
  float32_model = lambda p, x, y: bench_gpt.loss_fn(p, x, y, cfg, jnp.float32, attention)

  def make_for(dtype, wrap):
    return _scaled_variant(wrap, lambda: jls.autocast(float32_model, dtype))

  dls = lambda tx: jls.dynamic_loss_scale(tx, init_scale=INIT_SCALE)
  return {
    "autocast_dynamic_loss_scale": (
      "float16, jls.autocast(float32 model) + jls.dynamic_loss_scale",
      make_for(jnp.float16, dls),
    ),
    "autocast_bfloat16": (
      "bfloat16, jls.autocast(float32 model) + jls.no_loss_scale",
      make_for(jnp.bfloat16, jls.no_loss_scale),
    ),
  }


def _memory(compiled) -> dict[str, Any]:
  m = bench.memory(compiled)  # empty where the backend has no memory_analysis()
  if not m:
    return {}
  fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes")
  out = {f: m.get(f, 0) for f in fields + ("temp_size_in_bytes",)}
  out["compiled_peak_bytes"] = (
    out["argument_size_in_bytes"]
    + out["output_size_in_bytes"]
    - out["alias_size_in_bytes"]
    + out["temp_size_in_bytes"]
  )
  return out


def _device_peak() -> int | None:
  try:
    stats = jax.local_devices()[0].memory_stats() or {}
  except Exception:
    return None
  return stats.get("peak_bytes_in_use")


def build_jax(make, params, x, y, warmup: int) -> Built:
  init, step, notes = make()
  state = init(jax.tree_util.tree_map(jnp.copy, params))
  t0 = time.perf_counter()
  compiled = jax.jit(step, donate_argnums=(0,)).lower(state, x, y).compile()
  compile_s = time.perf_counter() - t0
  memory = _memory(compiled)
  holder = {"state": state}

  def run(k):
    holder["state"], value, seconds, _ = bench.timed_steps(compiled, holder["state"], x, y, k)
    return seconds, float(value)

  run(warmup)
  memory["process_peak_bytes_after_warmup"] = _device_peak()
  attention = attention_of(compiled.as_text())
  return Built(run, compile_s, memory, lambda: notes(holder["state"]), attention)


# ----------------------------------------------------------------------------- torch


def torch_device() -> str:
  import torch

  return "cuda" if torch.cuda.is_available() else "cpu"


def build_torch(cfg: GPTConfig, params, x, y, warmup: int, compiled: bool) -> Built:
  """``torch.autocast(float16)`` + ``GradScaler`` + fused AdamW, eager or ``torch.compile``."""
  import torch
  import torch.nn.functional as F

  dev = torch_device()
  model = bench_gpt.torch_model(cfg, params, dev)
  try:
    opt = torch.optim.AdamW(
      model.parameters(), lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY, fused=True
    )
    fused = True
  except (RuntimeError, TypeError, ValueError):
    opt = torch.optim.AdamW(
      model.parameters(), lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY, foreach=True
    )
    fused = False
  scaler = torch.amp.GradScaler(dev, init_scale=INIT_SCALE)
  forward = torch.compile(model) if compiled else model
  tx = torch.tensor(np.array(x), dtype=torch.long, device=dev)
  ty = torch.tensor(np.array(y), dtype=torch.long, device=dev).view(-1)
  sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

  def step():
    with torch.autocast(device_type=dev, dtype=torch.float16):
      logits = forward(tx)
      value = F.cross_entropy(logits.float().view(-1, cfg.vocab), ty)
    opt.zero_grad(set_to_none=True)
    scaler.scale(value).backward()
    scaler.step(opt)  # syncs with the host: found_inf.item()
    scaler.update()
    return value

  if dev == "cuda":
    torch.cuda.reset_peak_memory_stats()
  t0 = time.perf_counter()
  value = step()  # torch.compile compiles here
  sync()
  compile_s = time.perf_counter() - t0

  def run(k):
    sync()
    t0 = time.perf_counter()
    last = None
    for _ in range(k):
      last = step()
    sync()
    # no step run (a warm-up of one step: the compiling one above): no loss to report
    return time.perf_counter() - t0, float("nan") if last is None else float(last.detach())

  run(max(warmup - 1, 0))
  memory = {"fused_adamw": fused}
  if dev == "cuda":
    memory["torch_max_memory_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
  del value
  return Built(run, compile_s, memory, lambda: {"scale": float(scaler.get_scale())})


# ----------------------------------------------------------------------------- main


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default=os.path.join(_HERE, "results"))
  p.add_argument("--name", default="bench-gpu-large")
  p.add_argument("--tiny", action="store_true", help="a tiny GPT: a CPU smoke test")
  p.add_argument("--batch", type=int, default=None)
  p.add_argument("--rounds", type=int, default=None)
  p.add_argument("--steps", type=int, default=None, help="steps per round")
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--variants", nargs="+", default=None)
  p.add_argument(
    "--attention",
    default=None,
    help="JAX attention: xla (einsum + float32 softmax) or cudnn (default on GPU)",
  )
  p.add_argument(
    "--torch-compile-cpu",
    action="store_true",
    help="also run torch.compile off-GPU (skipped by default: slow on CPU)",
  )
  p.add_argument("--budget-s", type=float, default=420.0, help="skip what would not fit")
  p.add_argument(
    "--peak-flops",
    type=float,
    default=H200_PEAK_FLOPS,
    help="the MFU's denominator (default: the H200's dense half-precision peak)",
  )
  args = p.parse_args(argv)
  gpu = jax.default_backend() == "gpu"
  args.cfg = bench_gpt.TINY_GPT if args.tiny else bench_gpt.GPT2_SMALL
  if args.batch:
    args.cfg = args.cfg._replace(batch=args.batch)
  args.rounds = args.rounds or (3 if args.tiny else 7)
  args.steps = args.steps or (2 if args.tiny else 5)
  # The float32 model under autocast calls jax.nn.dot_product_attention (cuDNN on a GPU)
  # unless --attention xla asks for the einsum attention everywhere.
  args.autocast_attention = "xla" if args.attention == "xla" else None
  args.attention = args.attention or ("cudnn" if gpu else "xla")
  return args


#: The order variants are compiled and timed in when ``--variants`` is not given: what the
#: GPU issue asks first (the reference, the scaler, autocast + scaler, torch eager and
#: compiled), then the rest. A variant that would start past 60% of ``--budget-s`` is skipped,
#: so a short lease measures the first ones.
PRIORITY = (
  "float16",
  "float16_static_scale",
  "dynamic_loss_scale",
  "autocast_dynamic_loss_scale",
  "torch_eager",
  "torch_compile",
  "jls_trainstate",
  "flax_dynamic_scale",
  "bfloat16",
  "autocast_bfloat16",
  "float32",
)

#: The H200's dense half-precision peak (NVIDIA's datasheet), the MFU's denominator.
H200_PEAK_FLOPS = 989e12


def flops_per_token(cfg: GPTConfig) -> float:
  """A train step's FLOPs a token: 6 N (forward + backward of the matmuls) plus the
  attention's 12 L T d (PaLM's appendix B). 0.855 GFLOP for GPT-2 small at sequence 1024."""
  return 6.0 * bench_gpt.n_params(cfg) + 12.0 * cfg.layers * cfg.seq * cfg.d_model


def order(names: list[str]) -> list[str]:
  """``names`` with :data:`PRIORITY`'s first, in its order, then the others as given."""
  first = [n for n in PRIORITY if n in names]
  return first + [n for n in names if n not in first]


class Run:
  """The state of one benchmark run, written to ``<out>/<name>.{json,md}`` whenever it grows:
  after each variant's build and after each round, so a run cut short keeps what it measured."""

  def __init__(self, args, info: dict[str, Any], labels: dict[str, str], torch_ok: bool):
    self.args, self.info, self.labels, self.torch_ok = args, info, labels, torch_ok
    self.built: dict[str, Built] = {}
    self.skipped: dict[str, str] = {}
    self.times: dict[str, list[float]] = {}
    self.losses: dict[str, float] = {}

  def payload(self) -> dict[str, Any]:
    args, cfg = self.args, self.args.cfg
    tokens = cfg.batch * cfg.seq
    flops = flops_per_token(cfg)
    base = self.times.get(REFERENCE, [])
    results = {}
    for n, b in self.built.items():
      times = self.times.get(n, [])
      r: dict[str, Any] = {
        "label": self.labels[n],
        "compile_s": b.compile_s,
        "memory": b.memory,
      }
      if times and base:
        ratios = [t / ref for t, ref in zip(times, base)]
        tps = tokens / statistics.median(times)
        r.update(
          step_ms_median=1e3 * statistics.median(times),
          step_ms_all=[1e3 * t for t in times],
          tokens_per_s=tps,
          mfu=tps * flops / args.peak_flops,
          ratio_median=statistics.median(ratios),
          ratio_min=min(ratios),
          ratio_max=max(ratios),
          final_loss=self.losses[n],
          final=b.notes(),
        )
      if b.attention:
        r["attention"] = b.attention
      results[n] = r
    self.info["wall_s"] = time.perf_counter() - T0
    return {
      "kind": "gpu-large",
      "machine": self.info,
      "settings": {
        "model": cfg._asdict(),
        "params": bench_gpt.n_params(cfg),
        "tokens_per_step": tokens,
        "flops_per_token": flops,
        "peak_flops": args.peak_flops,
        "learning_rate": LEARNING_RATE,
        "weight_decay": WEIGHT_DECAY,
        "init_scale": INIT_SCALE,
        "attention": args.attention,
        "autocast_attention": args.autocast_attention or "jax.nn.dot_product_attention",
        "rounds": len(base),
        "steps_per_round": args.steps,
        "warmup": args.warmup,
        "reference": REFERENCE,
        "torch_device": torch_device() if self.torch_ok else None,
      },
      "results": results,
      "skipped": self.skipped,
    }

  def write(self) -> dict[str, Any]:
    payload = self.payload()
    os.makedirs(self.args.out, exist_ok=True)
    path = os.path.join(self.args.out, self.args.name)
    with open(path + ".json", "w") as f:
      json.dump(payload, f, indent=1)
    with open(path + ".md", "w") as f:
      f.write(bench_report.markdown(payload))
    return payload


def _build(run: Run, name: str, specs, params, x, y) -> None:
  """Builds (compiles and warms up) variant ``name`` into ``run.built``."""
  args, cfg = run.args, run.args.cfg
  if name in specs:
    try:
      run.built[name] = build_jax(specs[name][1], params, x, y, args.warmup)
    except Exception as e:  # e.g. no cuDNN attention for this shape: plain XLA attention
      if args.attention == "xla" and (
        name not in autocast_variants(cfg) or args.autocast_attention == "xla"
      ):
        raise
      log(f"{name}: {args.attention} attention failed ({type(e).__name__}: {e}); using xla")
      fallback = {**_jax_steps(cfg, "xla"), **autocast_variants(cfg, "xla")}
      run.built[name] = build_jax(fallback[name][1], params, x, y, args.warmup)
      run.skipped[f"{name}:attention"] = f"xla attention (cudnn failed: {type(e).__name__})"
  elif name in ("torch_eager", "torch_compile"):
    if not run.torch_ok:
      run.skipped[name] = "torch is not installed"
      return
    if name == "torch_compile" and torch_device() != "cuda" and not args.torch_compile_cpu:
      run.skipped[name] = "torch.compile is skipped off-GPU (--torch-compile-cpu runs it)"
      log(f"{name}: {run.skipped[name]}")
      return
    run.built[name] = build_torch(cfg, params, x, y, args.warmup, name == "torch_compile")
  else:
    raise ValueError(f"unknown variant {name!r}; known: {list(run.labels)}")
  log(f"{name:20s} compiled in {run.built[name].compile_s:6.1f}s  {run.built[name].memory}")
  if run.built[name].attention:
    log(f"{name:20s} attention: {run.built[name].attention}")


def run_all(args) -> dict[str, Any]:
  cfg = args.cfg
  info = bench_report.machine_info()
  log(f"{info['device']}; {cfg}; {bench_gpt.n_params(cfg) / 1e6:.1f}M params")
  params = bench_gpt.init_params(cfg, args.seed)
  x, y = bench_gpt.make_batch(cfg, args.seed + 1)
  specs = {**_jax_steps(cfg, args.attention), **autocast_variants(cfg, args.autocast_attention)}
  if not hasattr(jls, "autocast"):
    log("jls.autocast is not in this build: its variants are left out")
  torch_ok = True
  try:
    import torch  # noqa: F401
  except ImportError:
    torch_ok = False
    log("torch is not installed: the torch variants are left out")
  labels = {k: v[0] for k, v in specs.items()}
  labels["torch_eager"] = "torch autocast(float16) + GradScaler + AdamW, eager"
  labels["torch_compile"] = "torch autocast(float16) + GradScaler + AdamW, torch.compile"
  names = args.variants or order(list(labels))
  if REFERENCE not in names:
    names = [REFERENCE] + names

  run = Run(args, info, labels, torch_ok)
  for name in names:
    if time.perf_counter() - T0 > 0.6 * args.budget_s:
      run.skipped[name] = f"not compiled: past 60% of the {args.budget_s:.0f}s budget"
      log(f"{name}: {run.skipped[name]}")
      continue
    try:
      _build(run, name, specs, params, x, y)
    except Exception as e:
      run.skipped[name] = f"failed: {type(e).__name__}: {e}"[:500]
      log(f"{name}: FAILED\n{traceback.format_exc()}")
    run.write()

  if REFERENCE not in run.built:
    run.write()
    raise SystemExit("the float16 reference did not build; nothing to compare against")
  run.times = {n: [] for n in run.built}
  shuffled = list(run.built)
  rng = random.Random(args.seed)
  for r in range(args.rounds):
    if r and time.perf_counter() - T0 > 0.9 * args.budget_s:
      log(f"stopping after {r} rounds: past 90% of the budget")
      break
    rng.shuffle(shuffled)
    for n in shuffled:
      dt, run.losses[n] = run.built[n].run(args.steps)
      run.times[n].append(dt / args.steps)
    log(f"round {r + 1}: " + ", ".join(f"{n} {1e3 * run.times[n][-1]:.1f}ms" for n in run.built))
    run.write()
  return run.write()


def main(argv=None):
  args = parse_args(argv)
  payload = run_all(args)
  print("\n" + bench_report.markdown(payload), flush=True)
  log(f"done, wall {payload['machine']['wall_s']:.0f}s")


if __name__ == "__main__":
  main()
