"""A small decoder-only character LM in float16, with dynamic loss scaling and diagnostics.

A template for transformer users (Flax linen). Mixed precision as PyTorch's
autocast does it:

* float32 master params (``param_dtype=float32``) and a float32 residual stream;
* float16 matmuls (the ``nn.Dense`` layers, the attention einsums);
* softmax, layernorm statistics and the cross-entropy in float32 (see
  ``attention`` for what goes wrong with a float16 softmax).

By default (``--cast autocast``) the float16 runs train ``jls.autocast`` of the model
built for float32 (every ``dtype=`` float32), which makes those casts by torch's policy;
``--cast hand`` trains the model's own ``dtype=float16`` casts instead. The forward logits
are the same; the gradients differ in two places, and the losses agree to ~1e-5
(``--smoke --compare``): ``nn.gelu`` (tanh form, written with ``x ** 3``) runs partly in
float32 under autocast (``integer_pow`` is on torch's float32 list), and each bias is cast
where the add consumes it, after its broadcast, so its gradient's sum over the batch runs
in float32 (the hand-cast ``nn.Dense`` casts the bias first and sums in float16). The
``check_underflow`` probes keep the hand casts: their perturbation taps must be added in
float16.

Linen rather than NNX because the params are a plain nested dict: the keys
``jls.diagnostics.grad_diagnostics`` logs (``layers_0/attn/qkv/kernel/headroom``) are the
module names, the train step is a pure function that ``jax.lax.scan`` runs N
steps at a time, and ``Module.perturb`` gives the activation gradients that
``jls.diagnostics.check_underflow`` measures. (NNX works the same way; see flax_nnx.py.)

Corpus: Python standard library source files read from this interpreter's own
installation (no download): ``argparse.py``, ``functools.py``,
``dataclasses.py`` and ``textwrap.py`` (216,091 bytes on CPython 3.11; the
sizes are printed). Bytes are the tokens (vocabulary 256); the last 10% is
held out.

Logging: every ``--log-every`` steps the host reads the loss, the scale, the
skipped steps and the diagnostics of the chunk that just finished, while the
next chunk is already dispatched: there is no per-step host sync.

Run::

  python examples/transformer_lm.py --smoke              # seconds
  python examples/transformer_lm.py                      # float16 + dynamic scaling, 300 steps
  python examples/transformer_lm.py --compare --seed 1   # float32 / float16 / float16 + scaling
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_lossscale as jls

FILES = ("argparse.py", "functools.py", "dataclasses.py", "textwrap.py")


def load_corpus():
  """The bytes of ``FILES`` from the standard library, and their sizes."""
  root = os.path.dirname(os.__file__)
  chunks, sizes = [], {}
  for name in FILES:
    with open(os.path.join(root, name), "rb") as f:
      data = f.read()
    sizes[name] = len(data)
    chunks.append(data)
  tokens = np.frombuffer(b"\n".join(chunks), np.uint8).astype(np.int32)
  n_train = int(len(tokens) * 0.9)
  return tokens[:n_train], tokens[n_train:], sizes


class Attention(nn.Module):
  n_heads: int
  dtype: Any

  @nn.compact
  def __call__(self, h):
    b, t, d = h.shape
    head = d // self.n_heads
    qkv = nn.Dense(3 * d, dtype=self.dtype, param_dtype=jnp.float32, name="qkv")(h)
    qkv = self.perturb("qkv_act", qkv)
    q, k, v = jnp.split(qkv.reshape(b, t, 3 * self.n_heads, head), 3, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.asarray(math.sqrt(head), self.dtype)
    # Softmax in float32. A float16 softmax goes wrong three ways:
    # * exp() without the max subtracted overflows above 11.09 (e**11.09 = 65504);
    # * the usual mask constants (-1e9, finfo(float32).min) are -inf in
    #   float16, and a fully masked row gives -inf - -inf = NaN;
    # * even jax.nn.softmax (max subtracted) rounds the probabilities to
    #   float16: on 1000 rows of 128 scores with std 4 we measured 6.7% of the
    #   (float32-non-zero) probabilities come out exactly 0, relative errors up
    #   to 294% on the small ones, row sums off by 8e-4.
    scores = self.perturb("scores_act", scores).astype(jnp.float32)
    causal = jnp.tril(jnp.ones((t, t), jnp.bool_))
    scores = jnp.where(causal, scores, np.float32(-1e30))
    probs = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, d)
    return nn.Dense(d, dtype=self.dtype, param_dtype=jnp.float32, name="out")(out)


class Block(nn.Module):
  n_heads: int
  dtype: Any

  @nn.compact
  def __call__(self, x):  # x: float32 residual stream
    d = x.shape[-1]
    # LayerNorm statistics (mean, variance) in float32; its output feeds
    # float16 matmuls (nn.Dense casts it).
    h = nn.LayerNorm(dtype=jnp.float32, param_dtype=jnp.float32, name="ln_1")(x)
    y = Attention(self.n_heads, self.dtype, name="attn")(h)
    # perturb: zeros added to float16 activations; their gradients are the
    # float16 activation gradients (only when a "perturbations" collection is
    # passed, as check_at does; otherwise the identity).
    x = x + self.perturb("attn_act", y).astype(jnp.float32)
    h = nn.LayerNorm(dtype=jnp.float32, param_dtype=jnp.float32, name="ln_2")(x)
    h = nn.Dense(4 * d, dtype=self.dtype, param_dtype=jnp.float32, name="mlp_in")(h)
    h = self.perturb("mlp_hidden_act", h)
    y = nn.Dense(d, dtype=self.dtype, param_dtype=jnp.float32, name="mlp_out")(nn.gelu(h))
    return x + self.perturb("mlp_act", y).astype(jnp.float32)


class CharLM(nn.Module):
  vocab: int
  d_model: int
  n_layers: int
  n_heads: int
  seq_len: int
  dtype: Any = jnp.float16

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(self.vocab, self.d_model, param_dtype=jnp.float32, name="embed")(tokens)
    pos = self.param("pos", nn.initializers.normal(0.02), (self.seq_len, self.d_model), jnp.float32)
    x = x + pos[: tokens.shape[1]]
    for i in range(self.n_layers):
      x = Block(self.n_heads, self.dtype, name=f"layers_{i}")(x)
    x = nn.LayerNorm(dtype=jnp.float32, param_dtype=jnp.float32, name="ln_f")(x)
    logits = nn.Dense(self.vocab, dtype=self.dtype, param_dtype=jnp.float32, name="head")(x)
    return logits.astype(jnp.float32)  # cross-entropy in float32


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--smoke", action="store_true", help="a tiny model, a few steps (seconds)")
  p.add_argument(
    "--compare",
    action="store_true",
    help="train float32, float16 and float16 + scaling from the same start",
  )
  p.add_argument("--steps", type=int, default=300)
  p.add_argument("--log-every", type=int, default=50)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--batch-size", type=int, default=32)
  p.add_argument("--seq-len", type=int, default=64)
  p.add_argument("--d-model", type=int, default=64)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--init-scale", type=float, default=2.0**16, help="initial loss scale")
  p.add_argument("--growth-interval", type=int, default=2000, help="torch's default")
  p.add_argument(
    "--cast",
    choices=("autocast", "hand"),
    default="autocast",
    help="how the float16 runs train: jls.autocast of the float32 model (default), or the "
    "model's own dtype=float16 casts",
  )
  p.add_argument("--json", default=None, help="write the results to this file")
  return p


def parse_args(argv):
  parser = build_parser()
  args = parser.parse_args(argv)
  if args.smoke:
    args.steps, args.log_every = min(args.steps, 20), 10
    args.batch_size, args.seq_len, args.d_model, args.layers = 8, 32, 32, 1
  for name in ("steps", "log_every", "batch_size", "seq_len", "d_model", "layers", "heads"):
    if getattr(args, name) < 1:
      parser.error(f"argument --{name.replace('_', '-')}: must be >= 1")
  if args.d_model % args.heads:
    parser.error("argument --d-model: must be a multiple of --heads")
  args.log_every = min(args.log_every, args.steps)
  return args


def make_functions(args, train_tokens, dtype, scaled):
  """``train_chunk`` (a jitted scan of steps) and the loss function."""
  model = CharLM(256, args.d_model, args.layers, args.heads, args.seq_len, dtype)
  adam = optax.adam(args.lr)
  if scaled:
    tx = jls.dynamic_loss_scale(
      adam, init_scale=args.init_scale, growth_interval=args.growth_interval
    )
  else:
    tx = jls.no_loss_scale(adam)  # scale 1, the same state layout
  data = jnp.asarray(train_tokens)
  batch_key = jax.random.key(args.seed + 1000)

  def get_batch(step):
    starts = jax.random.randint(
      jax.random.fold_in(batch_key, step), (args.batch_size,), 0, data.shape[0] - args.seq_len - 1
    )
    idx = starts[:, None] + jnp.arange(args.seq_len + 1)[None, :]
    seq = data[idx]
    return seq[:, :-1], seq[:, 1:]

  # One float32 region, as torch's cross_entropy under autocast: JAX inlines log_softmax, and
  # its max-subtraction would otherwise run in float16 under jls.autocast.
  cross_entropy = jls.float32(optax.softmax_cross_entropy_with_integer_labels)

  def loss_fn(variables, batch, compute_dtype):
    x, y = batch
    logits = model.clone(dtype=compute_dtype).apply(variables, x)
    return cross_entropy(logits, y).mean()

  if dtype != jnp.float32 and args.cast == "autocast":
    # The float32 model (every dtype= float32), with torch's autocast policy: the Dense and
    # einsum matmuls in float16; softmax, layernorm statistics and the loss in float32.
    train_loss = jls.autocast(lambda v, b: loss_fn(v, b, jnp.float32), dtype)
  else:

    def train_loss(v, b):
      return loss_fn(v, b, dtype)

  def step(carry, i):
    params, opt_state = carry
    batch = get_batch(i)
    scale_state = jls.get_scale_state(opt_state)

    def scaled_loss(p):
      loss = train_loss({"params": p}, batch)
      return jls.scale_loss(loss, opt_state), loss

    grads, loss = jax.grad(scaled_loss, has_aux=True)(params)
    diag = jls.diagnostics.grad_diagnostics(grads, scale_state)  # before the optimizer
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    logs = {
      "loss": loss,
      "scale": scale_state.scale,
      "skipped": jls.get_scale_state(opt_state).consecutive_skips > 0,
      **diag,
    }
    return (params, opt_state), logs

  @jax.jit
  def train_chunk(params, opt_state, steps):
    (params, opt_state), logs = jax.lax.scan(step, (params, opt_state), steps)
    return params, opt_state, logs

  def init(key):
    params = model.init(key, jnp.zeros((1, args.seq_len), jnp.int32))["params"]
    return params, tx.init(params)

  return init, train_chunk, loss_fn, get_batch, model


def check_at(loss_fn, get_batch, model, params, step, scale):
  """``jls.diagnostics.check_underflow`` of one batch, params and activations (perturbations).

  The perturbation taps need the model's own float16 casts (``loss_fn``'s dtype): under
  autocast a float32 tap would promote the activation it taps to float32.
  """
  batch = get_batch(step)
  perturb = model.init(jax.random.key(0), batch[0])["perturbations"]
  variables = {"params": params, "perturbations": perturb}
  return jls.diagnostics.check_underflow(loss_fn, variables, batch, scale=scale)


def train(args, train_tokens, val_tokens, dtype, scaled, label, verbose=True):
  init, train_chunk, loss_fn, get_batch, model = make_functions(args, train_tokens, dtype, scaled)
  params, opt_state = init(jax.random.key(args.seed))
  names = jls.diagnostics.grad_leaf_names(params)
  check = jax.jit(lambda p, i, s: check_at(loss_fn, get_batch, model, p, i, s))
  half = dtype != jnp.float32
  probes = []

  def log(lo, hi, logs, opt_state):
    logs = jax.device_get(logs)  # the chunk's values, one transfer
    worst = int(np.argmin(logs["min_headroom"]))
    leaf = names[int(logs["min_headroom_leaf"][worst])] if names else "-"
    if verbose:
      print(
        f"[{label}] steps {lo:4d}-{hi - 1:4d}  loss {logs['loss'][-1]:.4f}  "
        f"scale 2^{math.log2(logs['scale'][-1]):.0f}  skipped {int(logs['skipped'].sum())}  "
        f"min headroom {logs['min_headroom'][worst]:.1f} ({leaf})"
      )

  pending = None
  t0 = time.perf_counter()
  losses, _skipped_total = [], 0
  for lo in range(0, args.steps, args.log_every):
    hi = min(args.steps, lo + args.log_every)
    if half and lo % args.log_every == 0:
      scale = jls.get_scale_state(opt_state).scale
      probes.append(check(params, jnp.int32(lo), scale))  # async; read at the end
    params, opt_state, logs = train_chunk(params, opt_state, jnp.arange(lo, hi, dtype=jnp.int32))
    if pending is not None:  # read the previous chunk while this one runs
      log(*pending)
      losses.append(np.asarray(pending[2]["loss"]))
    pending = (lo, hi, logs, opt_state)
  log(*pending)
  losses.append(np.asarray(pending[2]["loss"]))
  losses = np.concatenate(losses)
  state = jls.get_scale_state(opt_state)
  seconds = time.perf_counter() - t0

  # Held-out loss in float32 for every run (the same yardstick).
  val = jnp.asarray(val_tokens)
  n = (val.shape[0] - 1) // args.seq_len
  vx = val[: n * args.seq_len].reshape(n, args.seq_len)[:64]
  vy = val[1 : n * args.seq_len + 1].reshape(n, args.seq_len)[:64]
  val_loss = float(jax.jit(lambda p: loss_fn({"params": p}, (vx, vy), jnp.float32))(params))
  result = {
    "run": label,
    "final_train_loss": float(np.mean(losses[-10:])),
    "val_loss": val_loss,
    "skipped_steps": int(state.skipped_steps),
    "scale_final": float(state.scale),
    "seconds": seconds,
  }
  if probes:
    # The run's own backward: scale 1 without scaling, its scale with.
    def shares(prefix):
      return [p.total(scaled=True, prefix=prefix) for p in probes if bool(p.finite_scaled)]

    act = [p.total(scaled=True, prefix="perturbations") for p in probes if bool(p.finite_scaled)]
    par = shares("params")
    result["underflow_activations_mean"] = float(np.mean(act)) if act else None
    result["underflow_params_mean"] = float(np.mean(par)) if par else None
    result["underflow_probes"] = len(act)
    ok = [p.fractions(scaled=True) for p in probes if bool(p.finite_scaled)]
    result["underflow_by_leaf_mean"] = (
      {k: float(np.mean([f[k] for f in ok])) for k in ok[0]} if ok else {}
    )
    result["verdict_at_end"] = check(params, jnp.int32(args.steps), jnp.float32(2.0**16)).verdict()
  return result


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = parse_args(argv)
  train_tokens, val_tokens, sizes = load_corpus()
  print(
    "corpus: "
    + ", ".join(f"{k} {v:,} B" for k, v in sizes.items())
    + f" ({sum(sizes.values()):,} bytes; {len(train_tokens):,} train tokens)"
  )
  runs = [("float16 + scaling", jnp.float16, True)]
  if args.compare:
    runs = [("float32", jnp.float32, False), ("float16", jnp.float16, False)] + runs
  results = [train(args, train_tokens, val_tokens, dt, sc, label) for label, dt, sc in runs]
  for r in results:
    line = (
      f"{r['run']:>17}: final loss {r['final_train_loss']:.4f}  val loss {r['val_loss']:.4f}"
      f"  scale 2^{math.log2(r['scale_final']):.0f}  skipped {r['skipped_steps']}"
    )
    if r.get("underflow_activations_mean") is not None:
      line += (
        f"  underflow: activations {r['underflow_activations_mean']:.3%}, "
        f"params {r['underflow_params_mean']:.3%}"
      )
    print(line)
  print(results[-1].get("verdict_at_end", ""))
  report = {"config": vars(args), "corpus": sizes, "runs": results}
  if args.json:
    with open(args.json, "w") as f:
      json.dump(report, f, indent=2)
  return report


if __name__ == "__main__":
  report = main()
  ok = all(math.isfinite(r["val_loss"]) for r in report["runs"])
  sys.exit(0 if ok else 1)
