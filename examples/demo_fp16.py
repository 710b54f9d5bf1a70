"""Float16 training with and without dynamic loss scaling, on scikit-learn's digits.

Trains the same MLP from the same initial parameters on the same batches three
ways, for each of ``--seeds`` seeds (a seed sets the initial parameters and the
batch order; all share the train/test split of ``--seed``), and measures what float16 does to
the gradients, then to the quality:

* ``float32``: the reference, float32 parameters and compute.
* ``float16``: float16 compute (parameters cast to float16 inside the loss,
  float32 master parameters and optimizer), no loss scaling (scale 1).
* ``float16 + scaling``: the same float16 compute with
  ``jax_lossscale.dynamic_loss_scale``.

With ``--param-dtype float16`` the parameters themselves (and so the
gradients and updates) are float16 in the two float16 runs.

"Underflow" is measured on sampled steps with ``jax_lossscale.diagnostics.check_underflow``:
the run's gradient (float16 backward at the run's scale, unscaled) is compared
with the float32 gradient at the same parameters and batch, and the fraction of
the float32-non-zero elements that came out exactly zero is reported.

The table leads with that evidence (the share of gradients flushed to 0 without
and with scaling), then gives test accuracy, test loss and train loss as the mean
over the seeds with their range (min..max), and a headline says, from those
numbers, whether a run's quality differs from float32's beyond the seed-to-seed
spread or is equal within it.

``main`` is four named steps: ``build`` (data, each seed's initial parameters,
runs), ``train_run`` (one run of one seed, chunk by chunk, with
``probe_underflow`` before each chunk), ``make_report`` (with ``summarize`` and
``headline``) and ``write_outputs``. It prints the time of each
phase: data load, compile (``compile_run``, every run's jitted functions ahead
of training), training (a progress bar per run: tqdm's, or a text bar without
it) and the table and plot.

Usage::

  python examples/demo_fp16.py --out out            # 3 seeds, one to two minutes on 2 CPU cores
  python examples/demo_fp16.py --steps 200 --seeds 1 --out demo_small --no-progress

Writes ``demo_fp16.png`` (share of gradients flushed to 0, loss curves, loss
scale with its growth interval and skipped steps), ``demo_fp16.json`` (every
seed's runs and the summary) and ``demo_fp16.md`` (the table) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from typing import Any
from typing import Callable
from typing import NamedTuple
from typing import Sequence

RUNS = ("float32", "float16", "float16 + scaling")


# ----------------------------------------------------------------------------
# Command line.


def _int_at_least(minimum: int, name: str):
  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
    if value < minimum:
      raise argparse.ArgumentTypeError(f"{name} must be >= {minimum}, got {value}")
    return value

  return parse


def _positive_float(name: str, maximum: float = math.inf):
  def parse(text: str) -> float:
    try:
      value = float(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
    if not (math.isfinite(value) and 0 < value <= maximum):
      bound = "" if math.isinf(maximum) else f" and <= {maximum:g}"
      raise argparse.ArgumentTypeError(f"{name} must be positive{bound}, got {text!r}")
    return value

  return parse


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
    description=(
      "Train an MLP on scikit-learn's digits in float32, in float16 without "
      "loss scaling and in float16 with jax_lossscale.dynamic_loss_scale; "
      "print a table and write a PNG."
    ),
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  p.add_argument(
    "--steps", type=_int_at_least(1, "--steps"), default=1000, help="optimizer steps per run"
  )
  p.add_argument(
    "--seed",
    type=_int_at_least(0, "--seed"),
    default=0,
    help="first seed; also the seed of the train/test split, which all the seeds share",
  )
  p.add_argument(
    "--seeds",
    type=_int_at_least(1, "--seeds"),
    default=3,
    help="number of seeds (--seed, --seed + 1, ...); the table gives each run's mean and range",
  )
  p.add_argument("--out", default="out", help="output folder (created if missing)")
  p.add_argument(
    "--batch-size",
    type=_int_at_least(1, "--batch-size"),
    default=1024,
    help="examples per step; the loss is the batch mean",
  )
  p.add_argument(
    "--hidden", type=_int_at_least(1, "--hidden"), default=64, help="width of each hidden layer"
  )
  p.add_argument(
    "--depth", type=_int_at_least(1, "--depth"), default=4, help="number of hidden layers"
  )
  p.add_argument("--lr", type=_positive_float("--lr"), default=1e-3, help="Adam learning rate")
  p.add_argument(
    "--init-scale",
    type=_positive_float("--init-scale"),
    default=1.0,
    help="multiplier of the He-normal initial weights",
  )
  p.add_argument(
    "--param-dtype",
    choices=("float32", "float16"),
    default="float32",
    help="dtype of the parameters of the two float16 runs "
    "(float32 = master weights, float16 = params and grads in float16)",
  )
  p.add_argument(
    "--init-loss-scale",
    type=_positive_float("--init-loss-scale", 2.0**100),
    default=2.0**16,
    help="initial loss scale of the scaled run",
  )
  p.add_argument(
    "--growth-interval",
    type=_int_at_least(1, "--growth-interval"),
    default=100,
    help="clean steps before the scale doubles (torch's default is 2000)",
  )
  p.add_argument(
    "--test-fraction",
    type=_positive_float("--test-fraction", 0.9),
    default=0.2,
    help="fraction of the 1797 digits held out for testing",
  )
  p.add_argument(
    "--probes",
    type=_int_at_least(1, "--probes"),
    default=40,
    help="number of sampled steps at which underflow is measured",
  )
  p.add_argument(
    "--cast",
    choices=("autocast", "hand"),
    default="autocast",
    help="how the float16 runs train and evaluate: jls.autocast of the float32 model "
    "(default), or the model cast by hand (logits_fn's dtype argument)",
  )
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  p.add_argument("--no-plot", action="store_true", help="skip the PNG")
  return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = build_parser()
  args = parser.parse_args(argv)
  if args.probes > args.steps:
    args.probes = args.steps
  n_train = 1797 - round(1797 * args.test_fraction)
  if args.batch_size > n_train:
    parser.error(
      f"argument --batch-size: must be <= the {n_train} training examples, got {args.batch_size}"
    )
  if os.path.exists(args.out) and not os.path.isdir(args.out):
    parser.error(f"argument --out: {args.out!r} exists and is not a folder")
  return args


# ----------------------------------------------------------------------------
# Data, model, training.


def load_data(seed: int, test_fraction: float):
  import numpy as np

  try:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
  except ImportError:
    raise SystemExit(
      "The demo needs scikit-learn, matplotlib and tqdm: "
      "pip install '.[demo]' in the repository (or run `make demo`)."
    ) from None

  digits = load_digits()
  x = (digits.data / 16.0).astype(np.float32)  # pixels 0..16 -> [0, 1]
  y = digits.target.astype(np.int32)
  return train_test_split(x, y, test_size=test_fraction, random_state=seed, stratify=y)


class Run(NamedTuple):
  name: str
  compute_dtype: Any
  param_dtype: Any
  scaled: bool


class Setup(NamedTuple):
  """What every run shares: flags, data, each seed's initial parameters and batch key, chunks."""

  args: argparse.Namespace
  x_train: Any
  y_train: Any
  x_test: Any
  y_test: Any
  sizes: list[int]
  seeds: list[int]
  params0: list[Any]  # per seed
  batch_keys: list[Any]  # per seed
  chunks: list[tuple[int, int]]  # [start, stop) of each scanned chunk; a probe before each
  runs: list[Run]


class RunFns(NamedTuple):
  tx: Any
  train_chunk: Callable
  probe: Callable
  evaluate: Callable


def logits_fn(params, x, dtype, taps=None):
  """The MLP in ``dtype``; ``taps`` (zeros, cast to ``dtype``) are added to each
  pre-activation so that their gradients are the activation gradients."""
  import jax
  import jax.numpy as jnp

  h = x.astype(dtype)
  for i, layer in enumerate(params):
    h = h @ layer["w"].astype(dtype) + layer["b"].astype(dtype)
    if taps is not None:
      h = h + taps[i].astype(dtype)
    if i < len(params) - 1:
      h = jax.nn.relu(h)
  return h.astype(jnp.float32)  # softmax and loss in float32


def mlp(params, x):
  """The MLP as written for float32; ``jls.autocast`` runs its matmuls and biases in float16."""
  import jax

  h = x.astype(params[0]["w"].dtype)  # the input in the params' dtype (float16 params)
  for i, layer in enumerate(params):
    h = h @ layer["w"] + layer["b"]
    if i < len(params) - 1:
      h = jax.nn.relu(h)
  return h


def cross_entropy(logits, y):
  """The mean cross-entropy, one float32 region under autocast, as torch's ``cross_entropy``.

  torch's autocast runs ``log_softmax``/``cross_entropy`` as one float32 op. In JAX they are
  inlined primitives: without ``jls.float32`` the max-subtraction would run in float16 and the
  gradients would differ from the hand-cast model's by one float16 ulp in 10-18% of the
  weight-gradient elements (see ``--cast``).
  """
  import optax

  import jax_lossscale as jls

  loss = jls.float32(optax.softmax_cross_entropy_with_integer_labels)(logits, y)
  return loss.mean()


def plain_loss(params, x, y):
  return cross_entropy(mlp(params, x), y)


def plain_eval(params, x, y):
  import jax.numpy as jnp

  logits = mlp(params, x)
  loss = cross_entropy(logits, y)
  acc = jnp.mean((jnp.argmax(logits, -1) == y).astype(jnp.float32))
  return loss, acc


def loss_fn(params, x, y, dtype, taps=None):
  import optax

  logits = logits_fn(params, x, dtype, taps)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def init_params(sizes: list[int], key, init_scale: float):
  """He-normal weights times ``init_scale``, zero biases, in float32."""
  import jax
  import jax.numpy as jnp

  params = []
  for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
    key, sub = jax.random.split(key)
    std = init_scale * math.sqrt(2.0 / fan_in)
    w = std * jax.random.normal(sub, (fan_in, fan_out), jnp.float32)
    params.append({"w": w, "b": jnp.zeros((fan_out,), jnp.float32)})
  return params


def build(args: argparse.Namespace) -> Setup:
  """Step 1: data, each seed's initial parameters and batch key, the chunks and the three runs."""
  import jax
  import jax.numpy as jnp

  x_train, x_test, y_train, y_test = load_data(args.seed, args.test_fraction)
  sizes = [x_train.shape[1]] + [args.hidden] * args.depth + [10]
  seeds = list(range(args.seed, args.seed + args.seeds))
  params0, batch_keys = [], []
  for seed in seeds:
    init_key, batch_key = jax.random.split(jax.random.PRNGKey(seed))
    params0.append(init_params(sizes, init_key, args.init_scale))
    batch_keys.append(batch_key)
  probe_every = max(1, args.steps // args.probes)
  chunks = [(lo, min(args.steps, lo + probe_every)) for lo in range(0, args.steps, probe_every)]
  half_params = jnp.float16 if args.param_dtype == "float16" else jnp.float32
  runs = [
    Run(RUNS[0], jnp.float32, jnp.float32, False),
    Run(RUNS[1], jnp.float16, half_params, False),
    Run(RUNS[2], jnp.float16, half_params, True),
  ]
  return Setup(
    args,
    jnp.asarray(x_train),
    jnp.asarray(y_train),
    jnp.asarray(x_test),
    jnp.asarray(y_test),
    sizes,
    seeds,
    params0,
    batch_keys,
    chunks,
    runs,
  )


def make_run_fns(setup: Setup, run: Run) -> RunFns:
  """The optimizer and the jitted train chunk, underflow probe and evaluation of a run."""
  import jax
  import jax.numpy as jnp
  import optax

  import jax_lossscale as jls

  args = setup.args
  adam = optax.adam(args.lr)
  if run.scaled:
    tx = jls.dynamic_loss_scale(
      adam, init_scale=args.init_loss_scale, growth_interval=args.growth_interval
    )
  else:
    tx = jls.no_loss_scale(adam)  # scale 1: plain Adam, same state layout

  if run.compute_dtype != jnp.float32 and args.cast == "autocast":
    train_loss = jls.autocast(plain_loss, run.compute_dtype)
    eval_fn = jls.autocast(plain_eval, run.compute_dtype)
  else:  # float32, or the casts written by hand

    def train_loss(p, xb, yb):
      return loss_fn(p, xb, yb, run.compute_dtype)

    def eval_fn(params, x, y):
      logits = logits_fn(params, x, run.compute_dtype)
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
      return loss, jnp.mean((jnp.argmax(logits, -1) == y).astype(jnp.float32))

  def batch_indices(batch_key, step):
    return jax.random.randint(
      jax.random.fold_in(batch_key, step), (args.batch_size,), 0, setup.x_train.shape[0]
    )

  def train_step(carry, step, batch_key):
    params, opt_state = carry
    idx = batch_indices(batch_key, step)
    xb, yb = setup.x_train[idx], setup.y_train[idx]
    scale_state = jls.get_scale_state(opt_state)

    def scaled_loss(p):
      loss = train_loss(p, xb, yb)
      return jls.scale_loss(loss, opt_state), loss

    grads, loss = jax.grad(scaled_loss, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    skipped = jls.get_scale_state(opt_state).skipped_steps > scale_state.skipped_steps
    return (params, opt_state), (loss, scale_state.scale, skipped)

  @jax.jit
  def train_chunk(params, opt_state, batch_key, steps):
    step_fn = lambda carry, step: train_step(carry, step, batch_key)
    (params, opt_state), out = jax.lax.scan(step_fn, (params, opt_state), steps)
    return params, opt_state, out

  # The probe keeps the dtype argument: its activation taps must be added in float16 (under
  # autocast a float32 tap would promote the activation to float32).
  def probe_loss(variables, idx, dtype):
    return loss_fn(
      variables["params"], setup.x_train[idx], setup.y_train[idx], dtype, variables["activations"]
    )

  @jax.jit
  def probe(params, opt_state, batch_key, step):
    """jls.diagnostics.check_underflow of this run's backward (at its scale) at this step's batch."""
    taps = [jnp.zeros((args.batch_size, n), jnp.float32) for n in setup.sizes[1:]]
    return jls.diagnostics.check_underflow(
      probe_loss,
      {"params": params, "activations": taps},
      batch_indices(batch_key, step),
      scale=jls.get_scale_state(opt_state).scale,
    )

  @jax.jit
  def evaluate(params, x, y):
    return eval_fn(params, x, y)

  return RunFns(tx, train_chunk, probe, evaluate)


def probe_underflow(fns: RunFns, params, opt_state, batch_key, step: int):
  """Step 3: shares of parameter and activation gradients flushed to 0, or None.

  The run's own backward is checked (scale 1 without scaling, the current
  scale with it); a probe whose gradients overflowed is not counted.
  """
  import jax.numpy as jnp

  report = fns.probe(params, opt_state, batch_key, jnp.int32(step))
  nz_par = sum(int(v) for k, v in report.nonzero.items() if k.startswith("params/"))
  nz_act = sum(int(v) for k, v in report.nonzero.items() if k.startswith("activations/"))
  if not (bool(report.finite_scaled) and nz_par > 0 and nz_act > 0):
    return None
  return (
    report.total(scaled=True, prefix="params/"),
    report.total(scaled=True, prefix="activations/"),
  )


def compile_run(setup: Setup, run: Run, fns: RunFns) -> None:
  """Compiles a run's jitted functions for every shape that ``train_run`` calls them with."""
  import jax
  import jax.numpy as jnp

  params = jax.tree_util.tree_map(lambda p: p.astype(run.param_dtype), setup.params0[0])
  opt_state = fns.tx.init(params)
  key = setup.batch_keys[0]
  for n in sorted({hi - lo for lo, hi in setup.chunks}):
    fns.train_chunk.lower(params, opt_state, key, jnp.arange(n, dtype=jnp.int32)).compile()
  if run.compute_dtype != jnp.float32:
    fns.probe.lower(params, opt_state, key, jnp.int32(0)).compile()
  for x, y in ((setup.x_train, setup.y_train), (setup.x_test, setup.y_test)):
    fns.evaluate.lower(params, x, y).compile()


class TextBar:
  """A progress bar on stderr for when tqdm is not installed (the subset ``train_run`` uses)."""

  def __init__(self, total: int, desc: str, **_):
    self.total, self.desc, self.n, self.post = total, desc, 0, ""
    self.t0 = time.perf_counter()

  def update(self, n: int) -> None:
    self.n += n
    self._draw()

  def set_postfix(self, post: dict[str, str]) -> None:
    self.post = ", ".join(f"{k}={v}" for k, v in post.items())
    self._draw()

  def close(self) -> None:
    sys.stderr.write("\n")

  def _draw(self) -> None:
    done = 30 * self.n // self.total
    sys.stderr.write(
      f"\r{self.desc}: [{'#' * done}{'.' * (30 - done)}] {self.n}/{self.total} steps, "
      f"{time.perf_counter() - self.t0:.1f} s, {self.post}"
    )
    sys.stderr.flush()


def _phase(name: str, t0: float, detail: str = "") -> float:
  """Prints the phase's time since ``t0``; returns the time now (the next phase's start)."""
  now = time.perf_counter()
  print(f"== {name}: {now - t0:.1f} s{detail}", flush=True)
  return now


def train_run(setup: Setup, run: Run, fns: RunFns, index: int, tqdm=None):
  """Step 2: trains one run of seed ``setup.seeds[index]`` chunk by chunk, probing underflow
  before each chunk."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  import jax_lossscale as jls

  args = setup.args
  params = jax.tree_util.tree_map(lambda p: p.astype(run.param_dtype), setup.params0[index])
  batch_key = setup.batch_keys[index]
  opt_state = fns.tx.init(params)
  losses, scales, skips, probe_steps, frac_par, frac_act = [], [], [], [], [], []
  desc = f"seed {setup.seeds[index]}, {run.name:>17}"
  bar = tqdm(total=args.steps, desc=desc, unit="step", leave=True) if tqdm else None
  t0 = time.perf_counter()
  for lo, hi in setup.chunks:
    if run.compute_dtype != jnp.float32:
      shares = probe_underflow(fns, params, opt_state, batch_key, lo)
      if shares is not None:
        probe_steps.append(lo)
        frac_par.append(shares[0])
        frac_act.append(shares[1])
    params, opt_state, (loss, scale, skipped) = fns.train_chunk(
      params, opt_state, batch_key, jnp.arange(lo, hi, dtype=jnp.int32)
    )
    losses.append(np.asarray(loss))
    scales.append(np.asarray(scale))
    skips.append(np.asarray(skipped))
    if bar is not None:
      bar.update(hi - lo)
      post = {"loss": f"{float(loss[-1]):.3g}"}
      if run.scaled:
        post["scale"] = _pow2(float(jls.get_scale_state(opt_state).scale))
      bar.set_postfix(post)
  if bar is not None:
    bar.close()
  seconds = time.perf_counter() - t0
  losses, scales, skips = (np.concatenate(a) for a in (losses, scales, skips))
  train_loss, train_acc = fns.evaluate(params, setup.x_train, setup.y_train)
  test_loss, test_acc = fns.evaluate(params, setup.x_test, setup.y_test)
  scale_state = jls.get_scale_state(opt_state)
  frac_par = np.asarray(frac_par, np.float64)
  frac_act = np.asarray(frac_act, np.float64)
  n_half = max(1, len(frac_par) // 2)
  summary = lambda f, g: float(g(f)) if f.size else None
  result = {
    "run": run.name,
    "seed": setup.seeds[index],
    "compute_dtype": jnp.dtype(run.compute_dtype).name,
    "param_dtype": jnp.dtype(run.param_dtype).name,
    "loss_scaling": "dynamic" if run.scaled else "none",
    "train_loss": float(train_loss),
    "train_accuracy": float(train_acc),
    "test_loss": float(test_loss),
    "test_accuracy": float(test_acc),
    "final_batch_loss": float(losses[-1]),
    # Underflow: None for the float32 reference (nothing to compare).
    # Fractions of the float32-non-zero gradient elements that are exactly
    # zero in this run, over the probed steps: parameter gradients and
    # activation gradients (of each layer's pre-activation, per example).
    "underflow_params_mean": summary(frac_par, np.mean),
    "underflow_params_last_half": summary(frac_par[-n_half:], np.mean),
    "underflow_params_max": summary(frac_par, np.max),
    "underflow_activations_mean": summary(frac_act, np.mean),
    "underflow_activations_last_half": summary(frac_act[-n_half:], np.mean),
    "underflow_activations_max": summary(frac_act, np.max),
    "underflow_probes": int(frac_par.size),
    "skipped_steps": int(scale_state.skipped_steps),
    "scale_final": float(scale_state.scale),
    "scale_min": float(min(scales.min(), scale_state.scale)),
    "scale_max": float(max(scales.max(), scale_state.scale)),
    "seconds": seconds,
  }
  curves = {
    "loss": losses,
    "scale": scales,
    "skipped": skips,
    "probe_steps": np.asarray(probe_steps),
    "frac_par": frac_par,
    "frac_act": frac_act,
  }
  return result, curves


SUMMED = (
  "underflow_activations_last_half",
  "underflow_params_last_half",
  "test_accuracy",
  "test_loss",
  "train_accuracy",
  "train_loss",
  "skipped_steps",
  "scale_max",
)


def summarize(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """Each run's figures over the seeds: ``{key: {"mean", "min", "max"}}`` (None if unmeasured)."""
  summary = []
  for name in RUNS:
    rows = [r for r in results if r["run"] == name]
    entry: dict[str, Any] = {"run": name, "seeds": len(rows)}
    for key in SUMMED:
      values = [r[key] for r in rows]
      entry[key] = (
        None
        if None in values
        else {"mean": sum(values) / len(values), "min": min(values), "max": max(values)}
      )
    summary.append(entry)
  return summary


QUALITY = {"test_accuracy": "test accuracy", "test_loss": "test loss", "train_loss": "train loss"}


def compare(run: dict[str, Any], ref: dict[str, Any]) -> dict[str, list[str]]:
  """A summarized run against the reference: which quality figures are worse, better or equal.

  Worse or better means the min..max ranges over the seeds do not overlap; equal, that they do.
  """
  verdicts: dict[str, list[str]] = {"worse": [], "better": [], "equal": []}
  for key in QUALITY:
    a, b = run[key], ref[key]
    if a["min"] <= b["max"] and b["min"] <= a["max"]:
      verdicts["equal"].append(key)
    else:
      lower = a["mean"] < b["mean"]
      verdicts["worse" if lower == (key == "test_accuracy") else "better"].append(key)
  return verdicts


def headline(summary: list[dict[str, Any]]) -> str:
  """What the table shows, in words, from its numbers: the gradients lost, then the quality."""
  ref, half, scaled = summary
  n = ref["seeds"]
  act = lambda r: f"{100 * r['underflow_activations_last_half']['mean']:.0f}%"
  lines = [
    f"Gradients: without scaling float16 flushes {act(half)} of the activation gradients to 0 "
    f"(second half of training, mean of {n} seed{'s' * (n > 1)}); "
    f"with dynamic_loss_scale {act(scaled)}."
  ]
  phrase = {
    "worse": "worse beyond the seed-to-seed spread",
    "better": "better beyond the spread",
    "equal": "equal within the spread",
  }
  for r in (half, scaled):
    text = f"Quality, {r['run']} against float32: "
    if n == 1:
      lines.append(text + "one seed, no spread to compare with (use --seeds 3).")
      continue
    verdicts = compare(r, ref)
    parts = [
      f"{', '.join(QUALITY[key] for key in keys)} {phrase[k]}"
      for k, keys in verdicts.items()
      if keys
    ]
    lines.append(text + "; ".join(parts) + f" ({n} seeds, min..max ranges).")
  lines.append(
    "A committed result where the lost gradients cost quality: benchmarks/results/two-models.md "
    "(this MLP, 3000 steps, 3 seeds: final train loss 1.11-1.25x float32's without scaling, "
    "0.98-1.04x with it; test loss within noise on 360 digits)."
  )
  return "\n".join(lines)


def make_report(setup: Setup, results: list[dict[str, Any]], wall_seconds: float):
  """Step 4a: the report (config, machine, runs per seed, summary) that the table and JSON show."""
  import jax

  args = setup.args
  summary = summarize(results)
  return {
    "config": {k: v for k, v in vars(args).items() if k not in ("no_progress", "no_plot")},
    "machine": {
      "cpu": _cpu_name(),
      "platform": platform.platform(),
      "processor": platform.machine(),
      "cpu_count": os.cpu_count(),
      "jax_backend": jax.default_backend(),
      "jax_version": jax.__version__,
    },
    "date": time.strftime("%Y-%m-%d", time.gmtime()),
    "wall_seconds": wall_seconds,
    "train_examples": int(setup.x_train.shape[0]),
    "test_examples": int(setup.x_test.shape[0]),
    "parameters": int(sum(p.size for p in jax.tree_util.tree_leaves(setup.params0[0]))),
    "seeds": setup.seeds,
    "summary": summary,
    "headline": headline(summary),
    "runs": results,  # one per seed and run
  }


def write_outputs(report: dict[str, Any], curves: list, out: str, no_plot: bool) -> None:
  """Step 4b: print the table; write the JSON, the Markdown table and the PNG."""
  table = format_table(report)
  print(table)
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "demo_fp16.json"), "w") as f:
    json.dump(report, f, indent=2)
  with open(os.path.join(out, "demo_fp16.md"), "w") as f:
    f.write(table + "\n")
  if not no_plot:
    path = os.path.join(out, "demo_fp16.png")
    plot(curves, report, path)
    print(f"wrote {path}")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = parse_args(argv)  # before importing JAX: --help and errors are instant
  t = time.perf_counter()
  setup = build(args)
  t = _phase(
    "data load",
    t,
    f" (digits, {len(setup.runs)} runs of {args.steps} steps x {len(setup.seeds)} seeds)",
  )
  try:
    from tqdm.auto import tqdm as bar
  except ImportError:  # the demo extra has tqdm; without it, a text bar
    bar = TextBar
  if args.no_progress or not sys.stderr.isatty():
    bar = None
  t_start = t
  fns = [make_run_fns(setup, run) for run in setup.runs]
  for run, run_fns in zip(setup.runs, fns):
    compile_run(setup, run, run_fns)
  t = _phase("compile", t)
  results: list[dict[str, Any]] = []
  curves: list[dict[str, Any]] = []  # per seed: {run name: curves}
  for index in range(len(setup.seeds)):
    curves.append({})
    for run, run_fns in zip(setup.runs, fns):
      result, curves[index][run.name] = train_run(setup, run, run_fns, index, bar)
      results.append(result)
  each = ", ".join(
    f"{name} {sum(r['seconds'] for r in results if r['run'] == name):.1f} s" for name in RUNS
  )
  t = _phase("training", t, f" ({each})")
  report = make_report(setup, results, t - t_start)
  write_outputs(report, curves, args.out, args.no_plot)
  _phase("table and plot" if not args.no_plot else "table", t)
  return report


# ----------------------------------------------------------------------------
# Output.


def _cpu_name() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def _pow2(x: float) -> str:
  e = math.log2(x)
  return f"2^{e:.0f}" if e == round(e) else f"{x:.3g}"


def _spread(stat: dict[str, float] | None, fmt: str, pct: bool = False) -> str:
  """``mean (min..max)`` of a summarized figure; ``n/a`` if unmeasured."""
  if stat is None:
    return "n/a (reference)"
  k = 100.0 if pct else 1.0
  unit = "%" if pct else ""
  mean, lo, hi = (format(k * stat[x], fmt) for x in ("mean", "min", "max"))
  return f"{mean}{unit} ({lo}..{hi}{unit})"


def format_table(report: dict[str, Any]) -> str:
  """The results as a Markdown table (also readable as plain text): the gradients lost first,
  then the quality, each as the mean over the seeds and its range (min..max)."""
  cfg = report["config"]
  seeds = report["seeds"]
  lines = [
    f"digits: {report['train_examples']} train / {report['test_examples']} test (fixed split), "
    f"MLP {cfg['depth']}x{cfg['hidden']} ReLU ({report['parameters']} parameters), "
    f"Adam lr={cfg['lr']:g}, batch {cfg['batch_size']}, {cfg['steps']} steps, "
    f"seeds {seeds[0]}..{seeds[-1]} (initial parameters and batch order), "
    f"float16 runs: {cfg['param_dtype']} parameters, growth_interval {cfg['growth_interval']}",
    "",
    "| run | activation grads flushed to 0 | param grads flushed to 0 | skipped steps "
    "| test acc | test loss | train loss |",
    "|---|---:|---:|---:|---:|---:|---:|",
  ]
  for r in report["summary"]:
    skipped = r["skipped_steps"]
    lines.append(
      f"| {r['run']} | {_spread(r['underflow_activations_last_half'], '.1f', pct=True)} "
      f"| {_spread(r['underflow_params_last_half'], '.1f', pct=True)} "
      f"| {skipped['min']:.0f}..{skipped['max']:.0f} "
      f"| {_spread(r['test_accuracy'], '.4f')} | {_spread(r['test_loss'], '.4f')} "
      f"| {_spread(r['train_loss'], '.3g')} |"
    )
  m = report["machine"]
  probes = report["runs"][-1]["underflow_probes"]
  lines += [
    "",
    report["headline"],
    "",
    f"{report['date']}, {m['cpu_count']} CPU cores ({m['cpu']}), JAX {m['jax_version']} "
    f"on {m['jax_backend']}, {report['wall_seconds']:.0f} s in all. Each cell: mean over the "
    f"{len(seeds)} seed{'s' * (len(seeds) > 1)} (min..max). Flushed to 0: share of the "
    f"float32-non-zero gradient elements that are exactly 0 in the run, mean over the second half of {probes} sampled "
    "steps. Test: 360 digits (one digit is 0.0028 of accuracy).",
  ]
  return "\n".join(lines)


def _smooth(y, width: int):
  import numpy as np

  if width <= 1 or y.size < width:
    return np.arange(y.size), y
  kernel = np.ones(width) / width
  return np.arange(width - 1, y.size), np.convolve(y, kernel, mode="valid")


def plot(curves: list[dict[str, dict[str, Any]]], report: dict[str, Any], path: str) -> None:
  """Loss (first seed), flushed share (every seed) and loss scale (first seed), annotated."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np

  cfg = report["config"]
  colors = {RUNS[0]: "black", RUNS[1]: "tab:red", RUNS[2]: "tab:blue"}
  summary = {r["run"]: r for r in report["summary"]}
  fig, (ax_under, ax_loss, ax_scale) = plt.subplots(
    3, 1, figsize=(8, 10), sharex=True, gridspec_kw={"height_ratios": [2, 2, 2]}
  )
  first = curves[0]
  steps = len(first[RUNS[0]]["loss"])
  width = max(1, steps // 100)

  for index, seed_curves in enumerate(curves):
    for name in RUNS[1:]:
      c = seed_curves[name]
      act = summary[name]["underflow_activations_last_half"]["mean"]
      label = f"{name}: {100 * act:.0f}% (2nd half, mean)" if index == 0 else None
      ax_under.plot(
        c["probe_steps"], 100 * c["frac_act"], "o-", ms=2, lw=1, color=colors[name], label=label
      )
  ax_under.set_ylabel("activation gradients\nflushed to 0 (%)")
  ax_under.set_title(
    f"What float16 loses: gradient elements that are exactly 0 (float32: non-zero), "
    f"{len(curves)} seeds",
    fontsize=9,
  )
  ax_under.legend(fontsize=8)

  for name, c in first.items():
    x, y = _smooth(np.asarray(c["loss"], np.float64), width)
    acc = summary[name]["test_accuracy"]
    label = (
      f"{name}: test acc {acc['mean']:.3f} ({acc['min']:.3f}..{acc['max']:.3f}, "
      f"{len(curves)} seeds)"
    )
    ax_loss.plot(x, y, color=colors[name], label=label, lw=1.2)
  ax_loss.set_yscale("log")
  ax_loss.set_ylabel(f"train batch loss, seed {report['seeds'][0]}\n(mean of {width} steps)")
  worse = compare(summary[RUNS[1]], summary[RUNS[0]])["worse"]
  if len(curves) == 1:
    cost = "one seed, no spread to compare with"
  elif worse:
    cost = f"{', '.join(QUALITY[k] for k in worse)} worse beyond the seed spread"
  else:
    cost = "quality equal within the seed spread"
  ax_loss.set_title(f"What it costs here, float16 without scaling: {cost}", fontsize=9)
  ax_loss.legend(fontsize=8)

  c = first[RUNS[2]]
  ax_scale.plot(
    np.arange(steps),
    c["scale"],
    color=colors[RUNS[2]],
    lw=1.2,
    label="loss scale (float16 + scaling)",
  )
  skipped = np.flatnonzero(c["skipped"])
  if skipped.size:
    ax_scale.plot(
      skipped,
      c["scale"][skipped],
      "x",
      color="tab:orange",
      ms=7,
      label=f"skipped step ({skipped.size})",
    )
  ax_scale.set_yscale("log", base=2)
  ax_scale.set_ylabel(f"loss scale, seed {report['seeds'][0]}")
  ax_scale.set_xlabel("step")
  ax_scale.set_title(
    f"The scale starts at {_pow2(cfg['init_loss_scale'])}, doubles after every "
    f"{cfg['growth_interval']} clean steps (--growth-interval; PyTorch's default is 2000)\n"
    f"and halves on overflow, skipping that step: {skipped.size} of {steps} steps skipped",
    fontsize=9,
  )
  ax_scale.legend(fontsize=8)
  for ax in (ax_loss, ax_under, ax_scale):
    ax.grid(alpha=0.3)
  fig.suptitle(
    f"digits, MLP {cfg['depth']}x{cfg['hidden']}, batch {cfg['batch_size']}, "
    f"float16 runs with {cfg['param_dtype']} parameters",
    fontsize=11,
  )
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


if __name__ == "__main__":
  main()
