"""What ``autocast`` costs: trace and compile time of a 12-layer scanned transformer.

The interpreter runs while JAX traces the function, so under ``jax.jit`` it adds to the
trace (and, through the casts it inserts, to the compile), never to the step. This script
lowers and compiles the gradient step of a 12-layer decoder (layers stacked and run by
``lax.scan``, ``jax.checkpoint`` per layer) with and without ``autocast``, alternating the
two, and prints the median of each and their ratio. It then times the compiled steps of
the float32 model, the autocast model and the same model with float16 casts written by
hand, with their temporary memory.

Run::

  python examples/autocast_trace_cost.py            # 12 layers, d=256, 5 repeats
  python examples/autocast_trace_cost.py --smoke    # 2 layers, d=32, 1 repeat
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

import jax_lossscale as jls


def init(key, layers, d, vocab):
  ks = jax.random.split(key, 6)

  def normal(k, shape, scale):
    return scale * jax.random.normal(k, shape, jnp.float32)

  return {
    "emb": normal(ks[0], (vocab, d), 1.0),
    "out": normal(ks[1], (d, vocab), d**-0.5),
    "stack": {
      "ln1": jnp.ones((layers, d)),
      "ln2": jnp.ones((layers, d)),
      "wqkv": normal(ks[2], (layers, d, 3 * d), d**-0.5),
      "wo": normal(ks[3], (layers, d, d), d**-0.5),
      "w1": normal(ks[4], (layers, d, 4 * d), d**-0.5),
      "w2": normal(ks[5], (layers, 4 * d, d), (4 * d) ** -0.5),
      "b1": jnp.zeros((layers, 4 * d)),
      "b2": jnp.zeros((layers, d)),
    },
  }


def _norm(x, g):
  mean = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
  return (x - mean) * lax.rsqrt(var + 1e-5) * g


def _block(x, p, heads):
  b, t, d = x.shape
  qkv = _norm(x, p["ln1"]) @ p["wqkv"]
  q, k, v = jnp.split(qkv.reshape(b, t, 3 * heads, d // heads), 3, axis=2)
  s = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(d // heads)
  s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e4)
  a = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v).reshape(b, t, d)
  x = x + a @ p["wo"]
  h = jax.nn.gelu(_norm(x, p["ln2"]) @ p["w1"] + p["b1"])
  return x + h @ p["w2"] + p["b2"]


def _block_by_hand(x, p, heads):
  """``_block`` with float16 casts written by hand, as ``examples/transformer_lm.py`` does.

  float16 matmuls (bias included), softmax and layer norm on float32 input, GELU in
  float16, float32 residual stream.
  """
  f16 = jnp.float16
  b, t, d = x.shape
  qkv = _norm(x, p["ln1"]).astype(f16) @ p["wqkv"].astype(f16)
  q, k, v = jnp.split(qkv.reshape(b, t, 3 * heads, d // heads), 3, axis=2)
  s = jnp.einsum("bthd,bshd->bhts", q, k) / float(np.sqrt(d // heads))
  s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s.astype(jnp.float32), -1e4)
  probs = jax.nn.softmax(s, axis=-1).astype(f16)
  a = jnp.einsum("bhts,bshd->bthd", probs, v).reshape(b, t, d)
  x = x + (a @ p["wo"].astype(f16)).astype(jnp.float32)
  h = jax.nn.gelu(_norm(x, p["ln2"]).astype(f16) @ p["w1"].astype(f16) + p["b1"].astype(f16))
  return x + (h @ p["w2"].astype(f16) + p["b2"].astype(f16)).astype(jnp.float32)


def _loss(params, tokens, block, heads=4, f16_logits=False):
  x = params["emb"][tokens[:, :-1]]
  x, _ = lax.scan(
    lambda x, p: (jax.checkpoint(block, static_argnums=2)(x, p, heads), None), x, params["stack"]
  )
  if f16_logits:
    logits = (x.astype(jnp.float16) @ params["out"].astype(jnp.float16)).astype(jnp.float32)
  else:
    logits = x @ params["out"]
  logp = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def loss_fn(params, tokens):
  """The float32 model: what ``autocast`` is applied to."""
  return _loss(params, tokens, _block)


def loss_by_hand(params, tokens):
  """The same model with hand-written float16 casts."""
  return _loss(params, tokens, _block_by_hand, f16_logits=True)


def trace_and_compile(fun, *args):
  """Seconds to lower (trace) and to compile ``jax.jit(fun)`` at ``args``, from cold."""
  jax.clear_caches()
  t0 = time.perf_counter()
  lowered = jax.jit(fun).lower(*args)
  t1 = time.perf_counter()
  lowered.compile()
  t2 = time.perf_counter()
  return t1 - t0, t2 - t1


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--layers", type=int, default=12)
  ap.add_argument("--d", type=int, default=256)
  ap.add_argument("--seq", type=int, default=128)
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--smoke", action="store_true")
  args = ap.parse_args(argv)
  if args.smoke:
    args.layers, args.d, args.seq, args.batch, args.repeats = 2, 32, 16, 2, 1
  params = init(jax.random.key(0), args.layers, args.d, 256)
  tokens = jax.random.randint(jax.random.key(1), (args.batch, args.seq + 1), 0, 256)
  plain = jax.value_and_grad(loss_fn)
  cast = jax.value_and_grad(jls.autocast(loss_fn))
  times = {"plain": [], "autocast": []}
  for _ in range(args.repeats):
    for name, fun in (("plain", plain), ("autocast", cast)):
      times[name].append(trace_and_compile(fun, params, tokens))
  med = {k: [statistics.median(t[i] for t in v) for i in (0, 1)] for k, v in times.items()}
  print(
    f"{args.layers} layers, d={args.d}, seq={args.seq}, batch={args.batch}, {args.repeats} repeats"
  )
  for k, (tr, co) in med.items():
    print(
      f"  {k:9s} trace {tr * 1e3:8.1f} ms  compile {co * 1e3:8.1f} ms  total {(tr + co) * 1e3:8.1f} ms"
    )
  (pt, pc), (at, ac) = med["plain"], med["autocast"]
  print(
    f"  ratio     trace {at / pt:.2f}x  compile {ac / pc:.2f}x  total {(at + ac) / (pt + pc):.2f}x"
  )
  hand = jax.value_and_grad(loss_by_hand)
  steps = {"plain": plain, "autocast": cast, "by hand": hand}
  compiled = {k: jax.jit(f).lower(params, tokens).compile() for k, f in steps.items()}
  step_times: dict[str, list[float]] = {k: [] for k in steps}
  for _ in range(args.repeats):
    for k, c in compiled.items():
      jax.block_until_ready(c(params, tokens))
      t0 = time.perf_counter()
      jax.block_until_ready(c(params, tokens))
      step_times[k].append(time.perf_counter() - t0)
  print("  compiled gradient step (median; CPU timings of float16 say little about a GPU):")
  for k, c in compiled.items():
    mem = c.memory_analysis()
    temp = getattr(mem, "temp_size_in_bytes", float("nan")) / 2**20
    value = float(c(params, tokens)[0])
    print(
      f"  {k:9s} step {statistics.median(step_times[k]) * 1e3:8.1f} ms  "
      f"temp {temp:8.2f} MiB  loss {value:.5f}"
    )
  ratio = statistics.median(step_times["autocast"]) / statistics.median(step_times["by hand"])
  print(f"  autocast / by hand: step {ratio:.2f}x")


if __name__ == "__main__":
  main()
