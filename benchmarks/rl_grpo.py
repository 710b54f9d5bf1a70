"""GRPO in tunix, float32 against bfloat16 against float16 with dynamic loss scaling.

tunix's unedited ``RLCluster`` and ``GRPOLearner`` (colocated rollout: the sampler decodes with
the actor's own weights and KV cache) train a small Qwen3 (tunix's model, from scratch: tunix
zero-initialises its MLP weights, which are redrawn here) on a task whose reward is checked
exactly: the prompt is a few words of tunix's ``MockVocab``, and the reward of a completion
is the fraction of its words equal to the prompt's first word. A random model scores about
1/20; copying the first word scores 1.

Per dtype (the model's compute dtype; the parameters stay float32) and seed, the mean reward
of each step's sampled completions, and for float16 the scaler's skips, its final scale and
its retries. float16 runs through the documented lines
(``link_loss_scale(trainer.model, trainer.optimizer, output_dtype=jnp.float32)`` after the
learner is built, the optimizer ``jls.dynamic_loss_scale(...)``); float32 and bfloat16 run the
same optimizer without the scaler.

Writes ``rl-grpo.md`` (and ``docs/assets/rl-grpo.png``, the reward curves) with ``--out``.

Usage::

  python benchmarks/rl_grpo.py --steps 60 --seeds 0 1 2 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import dataclasses
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
from jax_lossscale.flax import link_loss_scale

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_report

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
#: The prompt's words: tunix's MockVocab, less its special tokens.
FIRST_WORD = 3


@dataclasses.dataclass(frozen=True)
class Settings:
  steps: int = 500
  batch: int = 8  # prompts a step
  generations: int = 8  # completions a prompt
  prompt_words: int = 4
  completion_tokens: int = 8
  layers: int = 2
  embed: int = 64
  learning_rate: float = 1e-3
  beta: float = 0.0  # no KL term (no reference forward)
  task: str = "copy"  # or "word": the fraction of words equal to "Tunix"


def float16_safe_mask() -> None:
  """tunix's Qwen3 masks attention with float16's lowest instead of -2.38e38.

  tunix's -2.38e38 is -inf in float16: a fully masked row (a left-padded prompt's pad
  positions) is NaN there, and 0 x NaN in the attention's sum spreads it to every position,
  so every float16 step would be skipped. float16's lowest is used for every dtype here
  (the same results for the others: the masked scores still underflow to 0 in the float32
  softmax).
  """
  from tunix.models.qwen3 import model as qwen3

  qwen3.K_MASK = float(jnp.finfo(jnp.float16).min)


def _model(dtype: Any, seed: int, vocab: int, s: Settings):
  from flax import nnx
  from tunix.models.qwen3 import model as qwen3

  config = qwen3.ModelConfig(
    num_layers=s.layers,
    vocab_size=vocab,
    embed_dim=s.embed,
    hidden_dim=4 * s.embed,
    num_heads=4,
    head_dim=s.embed // 4,
    num_kv_heads=2,
    rope_theta=10_000,
    norm_eps=1e-6,
    dtype=dtype,
    param_dtype=jnp.float32,
  )
  model = qwen3.Qwen3(config, rngs=nnx.Rngs(seed))
  # tunix zero-initialises the MLP (it expects pretrained weights): redraw every matrix.
  graph, params, rest = nnx.split(model, nnx.Param, ...)
  leaves, treedef = jax.tree_util.tree_flatten(params)
  keys = jax.random.split(jax.random.key(seed + 1000), len(leaves))
  leaves = [
    0.02 * jax.random.normal(k, p.shape, p.dtype) if p.ndim >= 2 else p
    for k, p in zip(keys, leaves)
  ]
  return nnx.merge(graph, jax.tree_util.tree_unflatten(treedef, leaves), rest)


def run(dtype_name: str, seed: int, s: Settings) -> dict[str, Any]:
  """One GRPO run: the mean reward of every step's completions, and the scaler's counters."""
  import grain.python as grain
  from tunix.rl import rl_cluster as rl_cluster_lib
  from tunix.rl.grpo import grpo_learner
  from tunix.rl.rollout import base_rollout
  from tunix.tests import test_common

  vocab = test_common.MockVocab()
  words = [w for w, i in vocab._mapping_text_to_id.items() if i >= FIRST_WORD]
  rng = np.random.default_rng(seed)
  prompts = [" ".join(rng.choice(words, s.prompt_words)) for _ in range(s.steps * s.batch)]

  class Prompts(grain.RandomAccessDataSource):
    def __getitem__(self, i):
      return prompts[i]

    def __len__(self):
      return len(prompts)

  rewards: list[float] = []

  def reward(prompts, completions, **_):
    out = []
    for p, c in zip(prompts, completions):
      target, got = (p.split()[0] if s.task == "copy" else "Tunix"), c.split()
      out.append(sum(w == target for w in got) / max(len(got), 1))
    rewards.append(float(np.mean(out)))
    return out

  dtype = DTYPES[dtype_name]
  float16_safe_mask()
  model = _model(dtype, seed, vocab.GetPieceSize(), s)
  inner = optax.adamw(s.learning_rate)
  tx = jls.dynamic_loss_scale(inner) if dtype == jnp.float16 else inner
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
  Role = rl_cluster_lib.Role
  cluster = rl_cluster_lib.RLCluster(
    actor=model,
    reference=model,
    tokenizer=vocab,
    cluster_config=rl_cluster_lib.ClusterConfig(
      role_to_mesh={Role.ACTOR: mesh, Role.REFERENCE: mesh, Role.ROLLOUT: mesh},
      rollout_engine="vanilla",
      training_config=rl_cluster_lib.RLTrainingConfig(
        actor_optimizer=tx, eval_every_n_steps=10**6, max_steps=s.steps
      ),
      rollout_config=base_rollout.RolloutConfig(
        max_tokens_to_generate=s.completion_tokens,
        max_prompt_length=s.prompt_words + 2,
        kv_cache_size=s.prompt_words + s.completion_tokens + 8,
        temperature=1.0,
      ),
    ),
  )
  learner = grpo_learner.GRPOLearner(
    rl_cluster=cluster,
    reward_fns=[reward],
    algo_config=grpo_learner.GRPOConfig(num_generations=s.generations, beta=s.beta),
  )
  trainer = cluster.actor_trainer
  if dtype == jnp.float16:  # the documented line
    link_loss_scale(trainer.model, trainer.optimizer, output_dtype=jnp.float32)
  data = (
    grain.MapDataset.source(Prompts()).batch(s.batch).map(lambda x: {"prompts": x, "answer": x})
  )
  t0 = time.perf_counter()
  learner.train(data)
  out: dict[str, Any] = {
    "dtype": dtype_name,
    "seed": seed,
    "rewards": rewards,
    "seconds": time.perf_counter() - t0,
  }
  if dtype == jnp.float16:
    from flax import nnx

    state = jls.get_scale_state(nnx.as_pure(trainer.optimizer.opt_state))
    out.update(skips=int(state.skipped_steps), final_scale=float(state.scale))
  return out


def _last(r: list[float], n: int = 10) -> float:
  return float(np.mean(r[-n:])) if r else float("nan")


def markdown(payload: dict[str, Any]) -> str:
  s, m = payload["settings"], payload["machine"]
  versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v)
  lines = [
    "# GRPO in tunix: float32, bfloat16 and float16 with dynamic loss scaling (measured)",
    "",
    f"{m['date']}; {m['cpu']}, {m['affinity']} cores; {versions}, google-tunix"
    f" {payload['tunix']}; git {m['git_commit'] or '?'}."
    f" `python benchmarks/rl_grpo.py {payload['args']}`.",
    "",
    f"tunix's `RLCluster` + `GRPOLearner`, colocated rollout; a Qwen3 of {s['layers']} layers,"
    f" width {s['embed']}, from scratch; {s['batch']} prompts x {s['generations']} completions"
    f" of {s['completion_tokens']} tokens a step, {s['steps']} steps, AdamW {s['learning_rate']};"
    " parameters float32, the model's compute in the dtype. Reward: the fraction of a"
    " completion's words equal to the prompt's first word (random: about 0.05)"
    + (" (task `word`: equal to one fixed word)" if s["task"] == "word" else "")
    + ".",
    "",
    "| model | dtype | seed | reward, first 10 steps | reward, last 10 steps | skips |"
    " final scale | s |",
    "|---|---|---:|---:|---:|---:|---:|---:|",
  ]
  model = f"Qwen3 {s['layers']}x{s['embed']}"
  for r in payload["runs"]:
    lines.append(
      f"| {model} | {r['dtype']} | {r['seed']} | {_last(r['rewards'][:10]):.3f} | {_last(r['rewards']):.3f} |"
      f" {r.get('skips', '-')} | {r.get('final_scale', '-')} | {r['seconds']:.0f} |"
    )
  lines += ["", "| dtype | reward, last 10 steps: mean (min..max over seeds) |", "|---|---|"]
  for name in DTYPES:
    last = [_last(r["rewards"]) for r in payload["runs"] if r["dtype"] == name]
    if last:
      lines.append(f"| {name} | {statistics.mean(last):.3f} ({min(last):.3f}..{max(last):.3f}) |")
  return "\n".join(lines) + "\n"


def plot(payload: dict[str, Any], path: str, window: int = 20) -> None:
  """One panel a dtype: each seed's reward, its ``window``-step mean over the raw curve."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  names = [n for n in DTYPES if any(r["dtype"] == n for r in payload["runs"])]
  fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.4), sharey=True)
  axes = np.atleast_1d(axes)
  for ax, name in zip(axes, names):
    for i, r in enumerate(run for run in payload["runs"] if run["dtype"] == name):
      y = np.asarray(r["rewards"])
      w = max(1, min(window, len(y)))  # a run shorter than the window: its own mean
      smooth = np.convolve(y, np.ones(w) / w, mode="valid")
      color = f"C{i}"
      ax.plot(y, color=color, alpha=0.15, linewidth=0.6)
      skips = ""
      if "skips" in r:
        skips = f", {r['skips']} skip" + ("" if r["skips"] == 1 else "s")
      ax.plot(np.arange(w - 1, len(y)), smooth, color=color, label=f"seed {r['seed']}{skips}")
    ax.set_title(name + (" + scaler" if name == "float16" else ""))
    ax.set_xlabel("GRPO step")
    ax.legend(loc="upper left", fontsize=8)
  axes[0].set_ylabel(f"reward ({window}-step mean; raw, pale)")
  fig.suptitle("GRPO in tunix on a from-scratch Qwen3: the copy task's reward", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv=None) -> dict[str, Any]:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--steps", type=int, default=Settings.steps)
  p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
  p.add_argument("--layers", type=int, default=Settings.layers)
  p.add_argument("--embed", type=int, default=Settings.embed)
  p.add_argument("--learning-rate", type=float, default=Settings.learning_rate)
  p.add_argument("--task", default=Settings.task, choices=["copy", "word"])
  p.add_argument("--generations", type=int, default=Settings.generations)
  p.add_argument("--out", default=None, help="a folder for rl-grpo.md and rl-grpo.json")
  p.add_argument("--plot", default=None, help="where to draw the reward curves (a .png)")
  p.add_argument("--replot", default=None, help="only draw --plot from this rl-grpo.json")
  args = p.parse_args(argv)
  if args.replot:
    with open(args.replot) as f:
      payload = json.load(f)
    plot(payload, args.plot)
    return payload
  from importlib import metadata

  import tunix  # noqa: F401  (fails early, before any run, where google-tunix is missing)

  s = Settings(
    steps=args.steps,
    layers=args.layers,
    embed=args.embed,
    learning_rate=args.learning_rate,
    task=args.task,
    generations=args.generations,
  )
  # tunix's code is not strict-clean and runs in its own threads: the global setting.
  jax.config.update("jax_numpy_dtype_promotion", "standard")
  payload: dict[str, Any] = {
    "kind": "rl-grpo",
    "machine": bench_report.machine_info(),
    "tunix": metadata.version("google-tunix"),
    "args": " ".join(sys.argv[1:] if argv is None else argv),
    "settings": dataclasses.asdict(s),
    "runs": [],
  }
  for seed in args.seeds:
    for name in args.dtypes:
      payload["runs"].append(run(name, seed, s))
      r = payload["runs"][-1]
      curve = " ".join(
        f"{_last(r['rewards'][i : i + 10]):.2f}" for i in range(0, len(r["rewards"]), 10)
      )
      print(
        f"{name} seed {seed} [{curve}]: reward {_last(r['rewards'][:10]):.3f} -> {_last(r['rewards']):.3f}"
        f" in {r['seconds']:.0f} s" + (f", skips {r['skips']}" if "skips" in r else ""),
        flush=True,
      )
      if args.out:
        with open(os.path.join(args.out, "rl-grpo.json"), "w") as f:
          json.dump(payload, f, indent=1)
        with open(os.path.join(args.out, "rl-grpo.md"), "w") as f:
          f.write(markdown(payload))
  if args.plot:
    plot(payload, args.plot)
  print(markdown(payload))
  return payload


if __name__ == "__main__":
  main()
