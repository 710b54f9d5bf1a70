"""Which `dynamic_loss_scale` settings to recommend for tunix: skips and distance from float32.

Trains a small Qwen3 (tunix's own `tunix.models.qwen3`, from scratch: tunix zero-initialises
the MLP weights, so they are re-drawn) in tunix's unedited `PeftTrainer`, in float16 with the
scaler linked (`jls.flax.link_loss_scale`) and in float32, on the same batches (arithmetic
sequences modulo the vocabulary: a learnable next-token task), and reports per setting and
seed the skipped steps (logged by `jls.flax.log_loss_scale`), the final scale and the mean
|loss_float16 - loss_float32| over the steps.

Needs google-tunix. Usage::

  python benchmarks/tunix_settings.py --steps 60 --seeds 0 1 --out benchmarks/results/tunix-settings.md
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_lossscale as jls
from jax_lossscale.flax import link_loss_scale
from jax_lossscale.flax import log_loss_scale

V, T, B = 256, 32, 8  # vocabulary, sequence length, batch

#: (label, init_scale, growth_interval)
SETTINGS = (
  ("2**20, 10 (the guide's before)", 2.0**20, 10),
  ("2**16, 2000 (torch's defaults)", 2.0**16, 2000),
  ("2**16, 10", 2.0**16, 10),
)


def qwen3(seed, dtype):
  """A 2-layer Qwen3, float32 params, ``dtype`` compute, MLP weights re-drawn."""
  from tunix.models.qwen3 import model as qwen3_lib

  config = qwen3_lib.ModelConfig(
    num_layers=2,
    vocab_size=V,
    embed_dim=64,
    hidden_dim=128,
    num_heads=4,
    head_dim=16,
    num_kv_heads=2,
    rope_theta=10_000,
    norm_eps=1e-6,
    dtype=dtype,
    param_dtype=jnp.float32,
  )
  model = qwen3_lib.Qwen3(config, rngs=nnx.Rngs(seed))
  init = nnx.initializers.lecun_normal()
  key = jax.random.key(seed + 1000)
  for path, var in nnx.iter_graph(model):
    if isinstance(var, nnx.Param) and any(p in ("gate_proj", "up_proj", "down_proj") for p in path):
      key, sub = jax.random.split(key)
      var[...] = init(sub, var[...].shape, jnp.float32)
  return model


def batches(n, seed):
  rng = np.random.default_rng(seed)
  start, stride = rng.integers(0, V, (n, B, 1)), rng.integers(1, 8, (n, B, 1))
  return (start + stride * np.arange(T)) % V


def model_inputs(x):
  tokens = x.input_tokens
  return dict(
    input_tokens=tokens,
    input_mask=x.input_mask,
    positions=jnp.broadcast_to(jnp.arange(T), tokens.shape),
    attention_mask=jnp.broadcast_to(jnp.tril(jnp.ones((T, T), jnp.bool_)), (*tokens.shape, T)),
  )


def run(seed, steps, setting=None):
  """Losses of one run, and (float16) the logged skip counts and scales."""
  from tunix.sft import peft_trainer

  data = [
    peft_trainer.TrainingInput(input_tokens=jnp.asarray(t, jnp.int32), input_mask=jnp.ones(t.shape))
    for t in batches(steps, seed)
  ]
  config = peft_trainer.TrainingConfig(eval_every_n_steps=10**6, max_steps=steps)
  if setting is None:
    trainer = peft_trainer.PeftTrainer(qwen3(seed, jnp.float32), optax.adam(1e-3), config)
  else:
    _, init_scale, interval = setting
    tx = jls.dynamic_loss_scale(optax.adam(1e-3), init_scale=init_scale, growth_interval=interval)
    trainer = peft_trainer.PeftTrainer(qwen3(seed, jnp.float16), tx, config)
    link_loss_scale(trainer.model, trainer.optimizer, output_dtype=jnp.float32)
    log_loss_scale(trainer)
  trainer.with_gen_model_input_fn(model_inputs)
  trainer.train(data)
  history = lambda name: trainer.metrics_logger.get_metric_history("", name, "train")
  if setting is None:
    return history("loss"), None, None
  return history("loss"), history("skipped_steps"), history("loss_scale")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=60)
  p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
  p.add_argument("--out", default=None, help="write the markdown table here")
  args = p.parse_args(argv)
  jax.config.update("jax_numpy_dtype_promotion", "standard")  # tunix is not strict-clean
  t0 = time.perf_counter()
  rows = []
  for seed in args.seeds:
    f32, _, _ = run(seed, args.steps)
    for setting in SETTINGS:
      f16, skips, scales = run(seed, args.steps, setting)
      where = np.flatnonzero(np.diff(np.concatenate([[0], skips]))) + 1
      row = (
        setting[0],
        seed,
        int(skips[-1]),
        where.tolist(),
        float(scales[-1]),
        float(np.mean(np.abs(f16 - f32))),
        float(f16[-1]),
        float(f32[-1]),
      )
      rows.append(row)
      print(row, flush=True)
  took = time.perf_counter() - t0
  lines = [
    "# tunix: `dynamic_loss_scale` settings on a small Qwen3 from scratch (measured)",
    "",
    f"Measured {datetime.date.today().isoformat()} on CPU, JAX {jax.__version__}, google-tunix "
    f"0.1.7; {args.steps} steps of tunix's `PeftTrainer`, `optax.adam(1e-3)`, a 2-layer Qwen3 "
    f"(vocabulary {V}, width 64, MLP 128, MLP weights re-drawn), batch {B} x {T} tokens, float16 "
    "compute with float32 params and `output_dtype=jnp.float32`, against the float32 model fed "
    f"the same batches. {took:.0f} s in all.",
    "",
    "```",
    "python benchmarks/tunix_settings.py " + " ".join(sys.argv[1:] if argv is None else argv),
    "```",
    "",
    "| `init_scale`, `growth_interval` | seed | skipped steps | at steps | final scale | "
    "mean \\|loss_fp16 - loss_fp32\\| | final loss fp16 | fp32 |",
    "|---|---:|---:|---|---:|---:|---:|---:|",
  ]
  for label, seed, n, at, scale, diff, l16, l32 in rows:
    lines.append(
      f"| {label} | {seed} | {n} | {at} | 2^{int(np.log2(scale))} | {diff:.4f} | {l16:.4f} | "
      f"{l32:.4f} |"
    )
  text = "\n".join(lines) + "\n"
  print(text)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text)


if __name__ == "__main__":
  main()
