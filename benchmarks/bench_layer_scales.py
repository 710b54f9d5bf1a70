"""One loss scale against a scale per layer group, on three models (CPU, about 7 minutes on 2 cores).

For each model, five runs from the same initial params on the same batches: float32 (the
reference), and float16 with one dynamic scale (``jls.dynamic_loss_scale``) and with a scale
per layer group (``layer_loss_scale``, boundaries on the stream between groups), each at
``growth_interval`` 100 (the demo's) and 2000 (torch's default): one scale and the per-layer
scales are compared at the same interval.
Reported, per layer group: the share of the float32-non-zero gradient elements that the
run's float16 backward flushes to zero (``jls.diagnostics.check_underflow`` at the run's own
scales, on sampled steps), for the parameter gradients and for the activation gradients
tapped in float16; per run: the skipped steps, the final scales, and the final training loss
(mean of the last 10% of the steps) against float32's.

Models:

* ``digits-mlp``: ``make demo``'s MLP (scikit-learn digits, 64-4x64-10 ReLU, batch 1024,
  Adam 1e-3, 3000 steps); a group per layer.
* ``char-lm``: the char-LM transformer of ``bench_models.py`` (2 layers, d_model 64) on
  Python source bytes, batch 32, Adam 1e-3, 600 steps; groups: embeddings, each block,
  final norm and head. Taps: the logits (the float32 residual stream does not flush).
* ``small-grad``: digits, a ReLU layer, a residual branch whose output is multiplied by a
  fixed gain of 2**-20 (CaiT's LayerScale initialised small) on a float32 stream, the head:
  the branch's gradients are 2**20 times smaller than the others'.

Usage::

  python benchmarks/bench_layer_scales.py --out benchmarks/results   # writes layer-scales.md
  python benchmarks/bench_layer_scales.py --quick                    # fewer steps
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any
from typing import Callable
from typing import NamedTuple

import bench_models
import jax
import jax.numpy as jnp
import layer_scales as _groups
import numpy as np
import optax

import jax_lossscale as jls

# Every float16 scaler runs at each of these: the demo's 100 and torch's default 2000 (for
# the per-layer scaler the interval times the probing of its one shared headroom).
GROWTH_INTERVALS = (100, 2000)
SCALERS = ("one scale", "per-layer")
PROBES = 10


class Case(NamedTuple):
  name: str
  label: str
  params0: Any  # dict of top-level keys -> float32 leaves
  group_of: dict[str, int]  # top-level param key -> group
  taps: dict[str, tuple[int, ...]]  # tap name -> shape (float16 activations)
  tap_group: dict[str, int]
  boundary_group: dict[str, int]  # mark name -> group it leaves
  loss: Callable[..., jax.Array]  # loss(params, x, y, dtype, mark) -> float32
  batch: Callable[[jax.Array], tuple[jax.Array, jax.Array]]  # step -> (x, y)
  steps: int
  lr: float


def _digits():
  from sklearn.datasets import load_digits
  from sklearn.model_selection import train_test_split

  d = load_digits()
  x = (d.data / 16.0).astype(np.float32)
  y = d.target.astype(np.int32)
  x_train, _, y_train, _ = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
  return jnp.asarray(x_train), jnp.asarray(y_train)


def _dense_params(sizes):
  """``layer_<i>`` weights (He-initialised, key 0) and zero biases for consecutive ``sizes``."""
  key = jax.random.PRNGKey(0)
  params = {}
  for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
    key, sub = jax.random.split(key)
    w = np.sqrt(2.0 / fan_in) * jax.random.normal(sub, (fan_in, fan_out), jnp.float32)
    params[f"layer_{i}"] = {"w": w, "b": jnp.zeros((fan_out,), jnp.float32)}
  return params


def _sampler(x_train, y_train, batch_size):
  """``step -> (x, y)``: a batch drawn with replacement, the same at every run (key 1)."""
  batch_key = jax.random.PRNGKey(1)

  def batch(step):
    idx = jax.random.randint(
      jax.random.fold_in(batch_key, step), (batch_size,), 0, x_train.shape[0]
    )
    return x_train[idx], y_train[idx]

  return batch


def mlp_case(name, label, steps, batch_size=1024, hidden=64, depth=4):
  x_train, y_train = _digits()
  sizes = [x_train.shape[1]] + [hidden] * depth + [10]
  params = _dense_params(sizes)
  n = len(sizes) - 1
  batch = _sampler(x_train, y_train, batch_size)

  def loss(params, x, y, dtype, mark):
    h = x.astype(dtype)
    for i in range(n):
      layer = params[f"layer_{i}"]
      h = mark(h @ layer["w"].astype(dtype) + layer["b"].astype(dtype), f"pre_{i}")
      if i < n - 1:
        h = mark(jax.nn.relu(h), f"out_{i}")
    return optax.softmax_cross_entropy_with_integer_labels(h.astype(jnp.float32), y).mean()

  return Case(
    name,
    label,
    params,
    {f"layer_{i}": i for i in range(n)},
    {f"pre_{i}": (batch_size, sizes[i + 1]) for i in range(n)},
    {f"pre_{i}": i for i in range(n)},
    {f"out_{i}": i for i in range(n - 1)},
    loss,
    batch,
    steps,
    1e-3,
  )


def branch_case(steps, gain_exponent=-20, batch_size=1024, hidden=64):
  """Digits, a ReLU layer, a residual branch of gain ``2**gain_exponent`` (CaiT's LayerScale
  initialised small, fixed here) on a float32 stream, and the head: the branch's gradients
  are ``2**-gain_exponent`` times smaller than the other layers'."""
  x_train, y_train = _digits()
  sizes = [x_train.shape[1], hidden, hidden, 10]
  params = _dense_params(sizes)
  gain = np.float32(2.0**gain_exponent)
  batch = _sampler(x_train, y_train, batch_size)

  def dense(h, layer, dtype):
    return h.astype(dtype) @ layer["w"].astype(dtype) + layer["b"].astype(dtype)

  def loss(params, x, y, dtype, mark):
    h = jax.nn.relu(mark(dense(x, params["layer_0"], dtype), "pre_0"))
    # The boundary on the float32 stream: a float16 cotangent of the stream would overflow
    # at the branch's scale before the boundary could bring it down.
    h = mark(h.astype(jnp.float32), "out_0")
    branch = jax.nn.relu(mark(dense(h, params["layer_1"], dtype), "pre_1"))
    h = mark(h + gain * branch.astype(jnp.float32), "out_1")
    logits = mark(dense(h, params["layer_2"], dtype), "pre_2")
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()

  return Case(
    "small-grad",
    f"digits, a ReLU layer, a residual branch of gain 2^{gain_exponent}, the head",
    params,
    {f"layer_{i}": i for i in range(3)},
    {f"pre_{i}": (batch_size, sizes[i + 1]) for i in range(3)},
    {f"pre_{i}": i for i in range(3)},
    {"out_0": 0, "out_1": 1},
    loss,
    batch,
    steps,
    1e-3,
  )


def lm_case(steps):
  root = os.path.dirname(os.__file__)
  data = b"\n".join(
    open(os.path.join(root, f), "rb").read()
    for f in ("argparse.py", "functools.py", "dataclasses.py", "textwrap.py")
  )
  tokens = jnp.asarray(np.minimum(np.frombuffer(data, np.uint8), 127).astype(np.int32))
  c = bench_models.LM
  t, b = c["context"], bench_models.BATCH
  params = bench_models.lm_init_params(0)
  blocks = sorted(k for k in params if k.startswith("block_"))
  group_of = {"embed": 0, "pos": 0, "ln_f": len(blocks) + 1, "head": len(blocks) + 1}
  group_of.update({k: i + 1 for i, k in enumerate(blocks)})
  batch_key = jax.random.PRNGKey(1)

  def batch(step):
    start = jax.random.randint(jax.random.fold_in(batch_key, step), (b,), 0, len(tokens) - t - 1)
    idx = start[:, None] + jnp.arange(t + 1)[None, :]
    seq = tokens[idx]
    return seq[:, :-1], seq[:, 1:]

  def loss(params, x, y, dtype, mark):
    return bench_models.lm_loss_fn(params, x, y, dtype=dtype, mark=mark)

  return Case(
    "char-lm",
    "char-LM transformer (bench_models), Python source, batch 32, 600 steps",
    params,
    group_of,
    {"logits": (b, t, c["vocab"])},
    {"logits": len(blocks) + 1},
    {"embed": 0, **{k: i + 1 for i, k in enumerate(blocks)}},
    loss,
    batch,
    steps,
    1e-3,
  )


def make_mark(case: Case, scales, taps):
  """The ``mark`` of a run: taps added to the float16 activations, boundaries (when
  ``scales`` is given) on the stream between groups."""

  def mark(h, name):
    if taps is not None and name in taps:
      h = h + taps[name].astype(h.dtype)
    if scales is not None and name in case.boundary_group:
      h = _groups.layer_boundary(h, scales, case.boundary_group[name])
    return h

  return mark


def run(case: Case, kind: str, growth_interval: int | None = None) -> dict[str, Any]:
  """Trains one run; returns its losses, skips, scales and the per-group flushed shares."""
  dtype = jnp.float32 if kind == "float32" else jnp.float16
  adam = optax.adam(case.lr)
  labels = {
    k: jax.tree_util.tree_map(lambda _, g=g: g, case.params0[k]) for k, g in case.group_of.items()
  }
  if kind == "float32":
    tx = jls.no_loss_scale(adam)
  elif kind == "one scale":
    tx = jls.dynamic_loss_scale(adam, growth_interval=growth_interval)
  else:
    tx = _groups.layer_loss_scale(adam, labels, growth_interval=growth_interval)
  layered = kind == "per-layer"

  def scales_of(opt_state):
    return _groups.get_layer_scale_state(opt_state).scales if layered else None

  def loss_scale(opt_state):
    if layered:
      return _groups.get_layer_scale_state(opt_state).scales[-1]
    return jls.get_scale_state(opt_state).scale

  def skipped(opt_state):
    s = _groups.get_layer_scale_state(opt_state) if layered else jls.get_scale_state(opt_state)
    return s.skipped_steps

  def step(carry, i):
    params, opt_state = carry
    x, y = case.batch(i)
    mark = make_mark(case, scales_of(opt_state), None)

    def scaled(p):
      loss = case.loss(p, x, y, dtype, mark)
      return loss * loss_scale(opt_state), loss

    grads, loss = jax.grad(scaled, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  @jax.jit
  def chunk(params, opt_state, steps):
    return jax.lax.scan(step, (params, opt_state), steps)

  @jax.jit
  def probe(params, opt_state, i):
    x, y = case.batch(i)
    scales = scales_of(opt_state)
    taps = {k: jnp.zeros(s, jnp.float32) for k, s in case.taps.items()}

    def loss_fn(p, batch, dt, tp):
      return case.loss(p, batch[0], batch[1], dt, make_mark(case, scales, tp))

    return jls.diagnostics.check_underflow(
      loss_fn, params, (x, y), scale=loss_scale(opt_state), activations=taps
    )

  params, opt_state = case.params0, tx.init(case.params0)
  every = case.steps // PROBES
  losses, shares = [], []
  for lo in range(0, case.steps, every):
    if dtype != jnp.float32:
      r = probe(params, opt_state, jnp.int32(lo))
      if bool(r.finite_scaled):
        shares.append(group_shares(case, r))
    (params, opt_state), out = chunk(params, opt_state, jnp.arange(lo, min(lo + every, case.steps)))
    losses.append(np.asarray(out))
  losses = np.concatenate(losses)
  tail = max(1, case.steps // 10)
  result = {
    "final_loss": float(losses[-tail:].mean()),
    "skipped": int(skipped(opt_state)),
  }
  if layered:
    result["scales"] = [float(s) for s in np.asarray(scales_of(opt_state))]
  elif dtype != jnp.float32:
    result["scales"] = [float(loss_scale(opt_state))]
  if shares:
    result["flushed"] = {
      part: {g: float(np.mean([s[part][g] for s in shares])) for g in shares[0][part]}
      for part in ("params", "activations")
    }
  return result


def group_shares(case: Case, report) -> dict[str, dict[int, float]]:
  """Per group: the pooled share of float32-non-zero elements flushed, params and taps."""
  out: dict[str, dict[int, float]] = {"params": {}, "activations": {}}
  groups = sorted(set(case.group_of.values()))
  for g in groups:
    keys = [k for k in report.nonzero if not k.startswith("activations/")]
    keys = [k for k in keys if case.group_of[k.split("/")[0]] == g]
    out["params"][g] = report.total(scaled=True, keys=keys)
    taps = [f"activations/{k}" for k, tg in case.tap_group.items() if tg == g]
    if taps:
      out["activations"][g] = report.total(scaled=True, keys=taps)
  return out


def cases(quick: bool) -> list[Case]:
  f = 4 if quick else 1
  return [
    mlp_case("digits-mlp", "make demo's MLP (digits, 64-4x64-10, batch 1024)", 3000 // f),
    lm_case(600 // f),
    branch_case(3000 // f),
  ]


def _pow2(x: float) -> str:
  e = np.log2(x)
  return f"2^{e:.0f}" if e == round(e) else f"{x:g}"


def _runs():
  """(scaler, growth_interval) of the float16 runs, the equal-interval pairs together."""
  return [(kind, gi) for gi in GROWTH_INTERVALS for kind in SCALERS]


def markdown(results: dict[str, Any]) -> str:
  intervals = " and ".join(str(gi) for gi in GROWTH_INTERVALS)
  lines = [
    "# One loss scale against a scale per layer group (measured)",
    "",
    f"Measured {results['date']} on {results['machine']}, JAX {jax.__version__}; same initial "
    f"params and batches in every run; one scale (`jls.dynamic_loss_scale`) and the per-layer "
    f"scales (`benchmarks/layer_scales.py`, outside the package) each run at `growth_interval` {intervals} (the "
    f"`growth_interval` column); flushed shares averaged over {PROBES} sampled steps. "
    "`python benchmarks/bench_layer_scales.py` reproduces it.",
    "",
    "| model | run | growth_interval | skipped steps | final scale(s) | final train loss | "
    "float32's | difference |",
    "|---|---|---:|---:|---|---:|---:|---:|",
  ]
  for name, r in results["models"].items():
    ref = r["float32"]["final_loss"]
    for kind, gi in _runs():
      x = r[kind][str(gi)]
      scales = ", ".join(_pow2(s) for s in x["scales"])
      lines.append(
        f"| {name} | {kind} | {gi} | {x['skipped']} | {scales} | {x['final_loss']:.6g} | "
        f"{ref:.6g} | {x['final_loss'] - ref:+.2e} |"
      )
  head = " | ".join(f"{kind}, {gi}" for kind, gi in _runs())
  for part, what in (
    ("params", "parameter gradients"),
    ("activations", "activation gradients (the float16 activations tapped in that group)"),
  ):
    lines += [
      "",
      f"Share of the {what} flushed to zero, per layer group (group 0 nearest the input; "
      "columns: scaler, growth_interval):",
      "",
      f"| model | group | {head} |",
      "|---|---:|" + "---:|" * len(_runs()),
    ]
    for name, r in results["models"].items():
      flushed = [r[kind][str(gi)]["flushed"][part] for kind, gi in _runs()]
      for g in r["one scale"][str(GROWTH_INTERVALS[0])]["flushed"]["params"]:
        if g not in flushed[0]:
          continue
        cells = " | ".join(f"{f[g]:.3%}" for f in flushed)
        lines.append(f"| {name} | {g} | {cells} |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> dict[str, Any]:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default=None, help="folder for layer-scales.md")
  p.add_argument("--quick", action="store_true", help="a quarter of the steps")
  p.add_argument("--models", nargs="*", default=None)
  args = p.parse_args(argv)
  import platform

  results: dict[str, Any] = {
    "date": time.strftime("%Y-%m-%d"),
    "machine": f"{os.cpu_count()} CPU cores ({platform.machine()})",
    "models": {},
  }
  for case in cases(args.quick):
    if args.models and case.name not in args.models:
      continue
    t0 = time.time()
    r: dict[str, Any] = {"float32": run(case, "float32")}
    for kind, gi in _runs():
      r.setdefault(kind, {})[str(gi)] = run(case, kind, gi)
    results["models"][case.name] = r
    print(case.name, f"{time.time() - t0:.0f}s", json.dumps(results["models"][case.name]))
  text = markdown(results)
  print(text)
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "layer-scales.md"), "w") as f:
      f.write(text)
  return results


if __name__ == "__main__":
  main()
