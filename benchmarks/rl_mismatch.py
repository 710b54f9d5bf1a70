"""The training-inference mismatch of RL, measured on a tunix Qwen3 model in three dtypes.

Qi et al., "Defeating the Training-Inference Mismatch via FP16" (arXiv 2510.26788): in RL the
sampler's token probabilities and the trainer's differ for the same weights, because the two
compute the same function in different orders (a KV-cached decode, one token at a time, against
one forward pass over the whole sequence), and bfloat16's coarse rounding turns those different
orders into different numbers. float16, with 3 more mantissa bits, makes the gap much smaller.

For each dtype (float32, bfloat16, float16), the same float32 master weights are cast to the
dtype and the model computes in it (tunix's ``ModelConfig(dtype=..., param_dtype=...)``):

* **sampler**: tunix's own ``Sampler`` (prefill, then its jitted decode loop with the model's KV
  cache) draws ``Size.gen_len`` tokens after each prompt at temperature 1 and returns the log
  probability of each sampled token (``return_logprobs=True``);
* **trainer**: tunix's ``rl.common.compute_per_token_logps``, what its GRPO learner calls: the
  full-sequence forward of the same model on prompt + completion, no cache.

Reported per dtype: the token-level ``|p_sampler - p_trainer|`` distribution (median, p90, p99,
max, and the fraction exactly 0), and the sequence-level log-ratio
``sum_t (log p_sampler - log p_trainer)`` (the paper's ``log mu/pi``; its mean over sequences
estimates ``KL[mu | pi]``, the number the paper's figure 5 gives).

XLA:CPU computes half-precision ops in float32, and by default (``--xla_allow_excess_precision``,
on) it may drop the roundings back to half precision between ops: each setting runs in a child
process of its own (``XLA_FLAGS`` must be set before JAX is imported), under a time limit.

Run ``python benchmarks/rl_mismatch.py`` (needs ``google-tunix``; ``make rl-demo`` builds a venv
for it). It writes ``rl-mismatch.{md,json}`` to ``--out`` and the histograms to ``--plot``.
The weights are random (tunix zero-initialises Qwen3's MLP: it expects pretrained weights, so the
MLP is re-drawn here, with the attention projections, the embedding and the output head), the
token ids too: no checkpoint or tokenizer is downloaded. ``python benchmarks/rl_mismatch.py
--quick`` runs the same on a one-layer model (a smoke test, numbers of no interest).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
DTYPES = ("float32", "bfloat16", "float16")
SETTINGS = {
  "excess-precision": "--xla_allow_excess_precision=true",
  "no-excess-precision": "--xla_allow_excess_precision=false",
}
QUANTILES = {"median": 50, "p90": 90, "p99": 99}

# The paper's figure 5 (DeepSeek-R1-Distill-Qwen-1.5B, vLLM against FSDP, responses of 1K-25K
# tokens), as printed in the figure's panels: the slope of log(pi/mu) against the sequence
# length in thousands of tokens, and KL[mu | pi] per sequence. sail-sg/Precision-RL's
# figures/offline_mismatch.png, the README's figure 5.
PAPER = {
  "bfloat16": {"slope_per_1k_tokens": -1.01, "kl_mu_pi": 7.64},
  "float16": {"slope_per_1k_tokens": -0.07, "kl_mu_pi": 0.32},
}


@dataclasses.dataclass(frozen=True)
class Size:
  """The model and the rollout: a Qwen3 in miniature (Qwen3-0.6B's layout: GQA with 2 query
  heads per KV head, q/k norms, SwiGLU MLP of 3x the width; an output head of its own)."""

  num_layers: int = 4
  embed_dim: int = 256
  hidden_dim: int = 768
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 64
  vocab_size: int = 4096
  num_sequences: int = 64
  prompt_len: int = 8
  gen_len: int = 56
  # The sampler's KV cache: longer than the sequences, as tunix's rollout configs make it
  # (``kv_cache_size`` defaults to 1024), so its attention reduces over more (masked) keys than
  # the trainer's.
  cache_size: int = 128
  # Std of the re-drawn weights: the layers' projections (the MLP, which tunix zero-initialises,
  # and attention's), the embedding, and the output head, whose std makes the next-token
  # distributions peaked (logits of std ~ head_std * sqrt(embed_dim)), as a trained model's are,
  # not uniform over the vocabulary.
  weight_std: float = 0.02
  embed_std: float = 0.02
  head_std: float = 0.3


TINY = Size(
  num_layers=1,
  embed_dim=32,
  hidden_dim=64,
  num_heads=2,
  num_kv_heads=1,
  head_dim=16,
  vocab_size=64,
  num_sequences=4,
  prompt_len=4,
  gen_len=8,
  cache_size=16,
  head_std=0.5,
)


class IdTokenizer:
  """Token ids written as space-separated integers: what tunix's ``TokenizerAdapter`` takes from
  a tokenizer with ``encode``, ``decode``, ``bos_id``, ``eos_id`` and ``pad_id``.

  Pad and EOS are ids outside the vocabulary, so the model never samples them: every sequence
  runs to the full length, and no sampled token is taken for padding by either side's mask.
  """

  def __init__(self, vocab_size: int):
    self.vocab_size = vocab_size

  def encode(self, text, **_):
    return [int(t) for t in text.split()]

  def decode(self, ids, **_):
    return " ".join(str(int(i)) for i in ids)

  def bos_id(self):
    return 0  # falsy: tunix's sampler prepends no BOS

  def eos_id(self):
    return self.vocab_size + 1

  def pad_id(self):
    return self.vocab_size


def _config(size: Size, dtype):
  from tunix.models.qwen3 import model as qwen3

  return qwen3.ModelConfig(
    num_layers=size.num_layers,
    vocab_size=size.vocab_size,
    embed_dim=size.embed_dim,
    hidden_dim=size.hidden_dim,
    num_heads=size.num_heads,
    head_dim=size.head_dim,
    num_kv_heads=size.num_kv_heads,
    rope_theta=1_000_000,
    norm_eps=1e-6,
    use_tied_embedding=False,
    dtype=dtype,
    param_dtype=dtype,
  )


def master_params(size: Size, seed: int = 0):
  """The float32 master weights: tunix's Qwen3 initialisation with its zero MLP (and the
  attention projections and the embedding) re-drawn from normal distributions."""
  from flax import nnx
  import jax
  import jax.numpy as jnp
  from tunix.models.qwen3 import model as qwen3

  model = qwen3.Qwen3(_config(size, jnp.float32), rngs=nnx.Rngs(seed))
  params = nnx.state(model, nnx.Param)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  redrawn = []
  for (path, leaf), key in zip(leaves, keys, strict=True):
    name = jax.tree_util.keystr(path)
    if "input_embedding" in name:
      leaf = size.embed_std * jax.random.normal(key, leaf.shape, jnp.float32)
    elif "lm_head" in name:
      leaf = size.head_std * jax.random.normal(key, leaf.shape, jnp.float32)
    elif "_proj" in name:  # q/k/v/o and gate/up/down: not the norms' scales
      leaf = size.weight_std * jax.random.normal(key, leaf.shape, jnp.float32)
    redrawn.append(leaf)
  return jax.tree_util.tree_unflatten(treedef, redrawn)


def model_in(size: Size, params, dtype):
  """A Qwen3 computing in ``dtype`` whose params are the master weights cast to ``dtype``."""
  from flax import nnx
  import jax
  from tunix.models.qwen3 import model as qwen3

  model = nnx.eval_shape(lambda: qwen3.Qwen3(_config(size, dtype), rngs=nnx.Rngs(0)))
  nnx.update(model, jax.tree_util.tree_map(lambda p: p.astype(dtype), params))
  return model


def prompts(size: Size, seed: int = 0) -> np.ndarray:
  rng = np.random.default_rng(seed)
  return rng.integers(0, size.vocab_size, (size.num_sequences, size.prompt_len), dtype=np.int32)


def sampler_logps(size: Size, model, prompt_ids: np.ndarray, seed: int = 0):
  """tunix's ``Sampler`` at temperature 1: the sampled tokens ``[B, gen]`` and their log
  probabilities as the sampler computed them (KV-cached decode)."""
  from tunix.generate import sampler as sampler_lib

  sampler = sampler_lib.Sampler(
    model,
    IdTokenizer(size.vocab_size),
    sampler_lib.CacheConfig(
      cache_size=size.cache_size,
      num_layers=size.num_layers,
      num_kv_heads=size.num_kv_heads,
      head_dim=size.head_dim,
    ),
  )
  out = sampler(
    [" ".join(map(str, p)) for p in prompt_ids],
    max_generation_steps=size.gen_len,
    max_prompt_length=size.prompt_len,
    return_logprobs=True,
    temperature=1.0,
    top_p=1.0,
    seed=seed,
  )
  tokens = np.stack([np.asarray(t, np.int32) for t in out.tokens])
  logps = np.asarray(out.logprobs, np.float32)
  if tokens.shape != (size.num_sequences, size.gen_len) or logps.shape != tokens.shape:
    raise RuntimeError(f"sampler returned tokens {tokens.shape}, logprobs {logps.shape}")
  return tokens, logps


def trainer_logps(size: Size, model, prompt_ids: np.ndarray, completions: np.ndarray):
  """tunix's ``compute_per_token_logps`` (what its GRPO learner calls): one forward pass over
  prompt + completion, no cache; the log probability of each completion token ``[B, gen]``."""
  from flax import nnx
  import jax.numpy as jnp
  from tunix.rl import common

  graphdef, state = nnx.split(model)
  logps = common.compute_per_token_logps(
    graphdef,
    state,
    jnp.asarray(prompt_ids),
    jnp.asarray(completions),
    pad_id=size.vocab_size,
    eos_id=size.vocab_size + 1,
  )
  return np.asarray(logps, np.float32)


def measure(size: Size = Size(), dtypes=DTYPES, seed: int = 0) -> dict[str, dict[str, np.ndarray]]:
  """Sampler against trainer for each dtype, on the same master weights and prompts.

  Returns, per dtype name: ``tokens`` (int32 ``[B, gen]``, the sampler's draws in that dtype),
  ``logp_sampler`` and ``logp_trainer`` (float32 ``[B, gen]``).
  """
  import jax.numpy as jnp

  params = master_params(size, seed)
  prompt_ids = prompts(size, seed)
  out = {}
  for name in dtypes:
    model = model_in(size, params, jnp.dtype(name))
    tokens, logp_s = sampler_logps(size, model, prompt_ids, seed)
    logp_t = trainer_logps(size, model, prompt_ids, tokens)
    out[name] = {"tokens": tokens, "logp_sampler": logp_s, "logp_trainer": logp_t}
  return out


def summarize(logp_sampler: np.ndarray, logp_trainer: np.ndarray) -> dict[str, float]:
  """The token-level |p_sampler - p_trainer| and sequence-level log-ratio statistics."""
  logp_s = np.asarray(logp_sampler, np.float64)
  logp_t = np.asarray(logp_trainer, np.float64)
  dp = np.abs(np.exp(logp_s) - np.exp(logp_t)).ravel()
  seq = np.sum(logp_s - logp_t, axis=-1)
  stats: dict[str, float] = {
    f"token_{k}": float(np.percentile(dp, q)) for k, q in QUANTILES.items()
  }
  stats["token_max"] = float(dp.max())
  stats["token_zero_fraction"] = float(np.mean(dp == 0))
  stats["p_sampler_median"] = float(np.median(np.exp(logp_s)))
  stats["seq_mean"] = float(seq.mean())  # estimates KL[mu | pi] per sequence
  stats["seq_median"] = float(np.median(seq))
  stats["seq_abs_median"] = float(np.median(np.abs(seq)))
  stats["seq_abs_p90"] = float(np.percentile(np.abs(seq), 90))
  stats["seq_abs_max"] = float(np.abs(seq).max())
  # The paper's slope: log(pi/mu) per 1K tokens (pi the trainer): -mean(seq) / length * 1000.
  stats["slope_per_1k_tokens"] = float(-seq.mean() / logp_s.shape[-1] * 1000)
  return stats


def _child(setting: str, size: Size, raw_out: pathlib.Path) -> None:
  """One XLA setting (its flag already in XLA_FLAGS): measure, save the raw arrays, print JSON."""
  import importlib.metadata

  import jax

  start = time.perf_counter()
  result = measure(size)
  np.savez(raw_out, **{f"{d}/{k}": v for d, r in result.items() for k, v in r.items()})
  print(
    json.dumps(
      {
        "setting": setting,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "jax": jax.__version__,
        "tunix": importlib.metadata.version("google-tunix"),
        "backend": jax.default_backend(),
        "seconds": round(time.perf_counter() - start, 1),
        "stats": {d: summarize(r["logp_sampler"], r["logp_trainer"]) for d, r in result.items()},
      }
    )
  )


def _run_setting(setting: str, raw_out: pathlib.Path, timeout: float, quick: bool) -> dict:
  env = dict(os.environ)
  env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {SETTINGS[setting]}".strip()
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
  cmd = [sys.executable, __file__, "--child", setting, "--raw-out", str(raw_out)]
  cmd += ["--quick"] if quick else []
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
  if proc.returncode != 0:
    raise RuntimeError(f"{setting}: exit {proc.returncode}\n{proc.stderr[-4000:]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def plot(raws: dict[str, dict[str, np.ndarray]], path: pathlib.Path) -> None:
  """Token |dp| histograms (log x) and sequence log-ratio histograms, one row per setting."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  colors = {"float32": "tab:gray", "bfloat16": "tab:red", "float16": "tab:blue"}
  fig, axes = plt.subplots(len(raws), 2, figsize=(11, 3.4 * len(raws)), squeeze=False)
  for row, (setting, raw) in zip(axes, raws.items()):
    logp = {d: (raw[f"{d}/logp_sampler"], raw[f"{d}/logp_trainer"]) for d in DTYPES}
    logp = {d: (s.astype(np.float64), t.astype(np.float64)) for d, (s, t) in logp.items()}
    dps = {d: np.abs(np.exp(s) - np.exp(t)) for d, (s, t) in logp.items()}
    positive = np.concatenate([v[v > 0] for v in dps.values()])
    lo, hi = (positive.min(), positive.max()) if positive.size else (1e-12, 1.0)
    bins = np.logspace(np.log10(lo), np.log10(hi), 50)
    for d, v in dps.items():
      zero = np.mean(v == 0)
      row[0].hist(
        v[v > 0].ravel(), bins=bins, histtype="step", lw=1.6, color=colors[d],
        label=f"{d} (median {np.median(v):.1e}; {zero:.0%} exactly 0)",
      )  # fmt: skip
    row[0].set_xscale("log")
    row[0].set_xlabel("|p_sampler - p_trainer| per token (log scale; exact zeros not drawn)")
    row[0].set_ylabel("tokens")
    row[0].set_title(f"token mismatch, XLA:CPU {setting}")
    row[0].legend(fontsize=8, loc="upper left")
    seqs = {d: np.sum(s - t, -1) for d, (s, t) in logp.items()}
    span = max(np.abs(s).max() for s in seqs.values())
    for d, s in seqs.items():
      row[1].hist(
        s, bins=np.linspace(-span, span, 41), histtype="step", lw=1.6, color=colors[d],
        label=f"{d} (median |.| {np.median(np.abs(s)):.1e})",
      )  # fmt: skip
    row[1].set_xlabel("sum_t (log p_sampler - log p_trainer) per sequence")
    row[1].set_ylabel("sequences")
    row[1].set_title(f"sequence log-ratio, XLA:CPU {setting}")
    row[1].legend(fontsize=8, loc="upper left")
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110, metadata={"Software": None})
  plt.close(fig)


def _fmt(x: float) -> str:
  return "0" if x == 0 else f"{x:.2e}"


def report(runs: dict[str, dict], size: Size, seconds: float, command: str) -> tuple[str, dict]:
  """The results file's contents (``data``) and its markdown, rendered from them."""
  now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
  machine = f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} (XLA:CPU)"
  first = next(iter(runs.values()))
  for run in runs.values():
    bf, fp = run["stats"]["bfloat16"], run["stats"]["float16"]
    run["bf16_over_fp16_token_median"] = (
      bf["token_median"] / fp["token_median"] if fp["token_median"] else float("inf")
    )
  data = {
    "kind": "rl-mismatch",
    "machine": {"date": now, "description": machine},
    "command": command,
    "jax": first["jax"],
    "tunix": first["tunix"],
    "seconds": round(seconds, 1),
    "size": dataclasses.asdict(size),
    "paper_figure_5": PAPER,
    "settings": runs,
  }
  return markdown(data), data


def markdown(data: dict) -> str:
  """``rl-mismatch.md``, from the contents of ``rl-mismatch.json``."""
  now, machine = data["machine"]["date"], data["machine"]["description"]
  command, seconds, runs = data["command"], data["seconds"], data["settings"]
  s = Size(**data["size"])
  paper = data["paper_figure_5"]
  model = f"Qwen3 {s.num_layers}x{s.embed_dim}"
  lines = [
    "# The training-inference mismatch, measured (benchmarks/rl_mismatch.py)",
    "",
    f"{now}; {machine}; jax {data['jax']}, google-tunix {data['tunix']}; `{command}`; "
    f"{seconds:.0f} s in all.",
    "",
    f"Model: tunix's `Qwen3`, {s.num_layers} layers, d {s.embed_dim}, MLP {s.hidden_dim}, "
    f"{s.num_heads} query heads and {s.num_kv_heads} KV heads of {s.head_dim}, vocabulary "
    f"{s.vocab_size}, an output head of its own; random float32 master weights (projections "
    f"std {s.weight_std}, embedding std {s.embed_std}, head std {s.head_std}) cast to each dtype, "
    f"which is also the compute dtype. Rollout: {s.num_sequences} prompts of {s.prompt_len} "
    f"random tokens, {s.gen_len} tokens sampled after each by tunix's `Sampler` at temperature 1 "
    f"(its KV-cached decode, cache of {s.cache_size}, `return_logprobs=True`), in the dtype under "
    "test; the trainer's log probabilities of the "
    "same tokens from tunix's `rl.common.compute_per_token_logps` (one forward pass, no cache).",
    "",
    "Token: |p_sampler - p_trainer| over all "
    f"{s.num_sequences * s.gen_len} sampled tokens. Sequence: "
    "sum_t (log p_sampler - log p_trainer) over each sequence's "
    f"{s.gen_len} tokens (the paper's log mu/pi; its mean estimates KL[mu | pi]). "
    "Slope: log(pi/mu) per 1K tokens, -mean / length * 1000, as the paper's figure fits it.",
    "",
  ]
  for setting, run in runs.items():
    st = run["stats"]
    lines += [
      f"## XLA:CPU, {setting} (`{SETTINGS[setting]}`), {run['seconds']} s",
      "",
      "| model | dtype | token median | p90 | p99 | max | exactly 0 | seq mean (KL estimate) "
      "| seq median abs | seq p90 abs | seq max abs | slope / 1K tokens |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for d in DTYPES:
      x = st[d]
      lines.append(
        f"| {model} | {d} | {_fmt(x['token_median'])} | {_fmt(x['token_p90'])} | {_fmt(x['token_p99'])} "
        f"| {_fmt(x['token_max'])} | {x['token_zero_fraction']:.0%} | {_fmt(x['seq_mean'])} "
        f"| {_fmt(x['seq_abs_median'])} | {_fmt(x['seq_abs_p90'])} | {_fmt(x['seq_abs_max'])} "
        f"| {_fmt(x['slope_per_1k_tokens'])} |"
      )
    bf, fp = st["bfloat16"], st["float16"]
    ratio = run["bf16_over_fp16_token_median"]
    lines += [
      "",
      f"bfloat16's median token mismatch over float16's: {ratio:.1f}x "
      f"(p90 {bf['token_p90'] / max(fp['token_p90'], 1e-30):.1f}x, "
      f"p99 {bf['token_p99'] / max(fp['token_p99'], 1e-30):.1f}x; sequence median |log-ratio| "
      f"{bf['seq_abs_median'] / max(fp['seq_abs_median'], 1e-30):.1f}x).",
      "",
    ]
  lines += [
    "## The paper's figure 5, beside",
    "",
    "DeepSeek-R1-Distill-Qwen-1.5B, vLLM sampling against FSDP training on GPUs, responses of "
    "1K-25K tokens: the numbers printed in the figure's panels (its token-level panels are "
    "scatter plots, with no quantiles to compare).",
    "",
    "| dtype | slope of log(pi/mu) / 1K tokens | KL[mu / pi] per sequence |",
    "|---|---|---|",
    *(
      f"| {d} | {v['slope_per_1k_tokens']} | {v['kl_mu_pi']} |"
      for d, v in data["paper_figure_5"].items()
    ),
    "",
    f"Ratio bfloat16 / float16: slope {paper['bfloat16']['slope_per_1k_tokens'] / paper['float16']['slope_per_1k_tokens']:.0f}x, "
    f"KL {paper['bfloat16']['kl_mu_pi'] / paper['float16']['kl_mu_pi']:.0f}x.",
    "",
  ]
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
  parser.add_argument("--plot", default=str(ROOT / "docs" / "assets" / "rl-mismatch.png"))
  parser.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated")
  parser.add_argument("--timeout", type=float, default=270.0, help="seconds per setting")
  parser.add_argument("--quick", action="store_true", help="the tiny model (a smoke test)")
  parser.add_argument("--child", choices=list(SETTINGS), help=argparse.SUPPRESS)
  parser.add_argument("--raw-out", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  size = TINY if args.quick else Size()
  if args.child:
    _child(args.child, size, pathlib.Path(args.raw_out))
    return 0
  settings = [s for s in args.settings.split(",") if s]
  for s in settings:
    if s not in SETTINGS:
      raise ValueError(f"--settings: {s!r} is not one of {list(SETTINGS)}")
  start = time.perf_counter()
  runs, raws = {}, {}
  with tempfile.TemporaryDirectory() as tmp:
    for s in settings:
      raw_path = pathlib.Path(tmp) / f"{s}.npz"
      runs[s] = _run_setting(s, raw_path, args.timeout, args.quick)
      with np.load(raw_path) as f:
        raws[s] = dict(f)
      print(f"== {s}: {runs[s]['seconds']} s", flush=True)
  command = "python benchmarks/rl_mismatch.py" + (" --quick" if args.quick else "")
  md, data = report(runs, size, time.perf_counter() - start, command)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "rl-mismatch.md").write_text(md)
  (out / "rl-mismatch.json").write_text(json.dumps(data, indent=2) + "\n")
  plot(raws, pathlib.Path(args.plot))
  print(md)
  return 0


if __name__ == "__main__":
  sys.exit(main())
