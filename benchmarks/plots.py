"""The benchmarks page's plots, drawn from the committed ``benchmarks/results/*.json``.

``python benchmarks/plots.py`` writes ``docs/assets/benchmarks/*.png`` (``--out DIR`` elsewhere).
The same JSON files and the same matplotlib give the same bytes: no date or random state goes
into a figure, and the PNG's only metadata is the matplotlib version
(``tests/test_bench_plots.py`` regenerates them and compares).

* ``step-ratio-cpu.png``: each scaler's median step-time ratio to plain Adam on XLA:CPU, beside
  its peers', from ``bench.json`` and ``bench-quick.json``.
* ``gpu-measured-vs-predicted.png``: the H200's measured step-time ratios to the unscaled
  float16 step (``bench-gpu-large.json``; the scaler against a static scale from
  ``bench-gpu-large-static.json``) beside the GPU plan's predictions for the same programs
  (``gpu-plan-h200.json``: compiled, not run).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
OUT = ROOT / "docs" / "assets" / "benchmarks"

# XLA:CPU, make bench: the shipped scaler first, then its peers (names as in the tables).
CPU_VARIANTS = {
  "jax_lossscale": "jls.dynamic_loss_scale",
  "jls_trainstate": "jls.flax.TrainState",
  "flax": "Flax DynamicScale + where",
  "jmp": "jmp DynamicLossScale",
  "optax_aif": "optax.apply_if_finite (static scale)",
  "cond_ref": "lax.cond skip (reference, not shipped)",
}
CPU_MODELS = {
  "mlp-1m": "MLP 1M, 6 leaves",
  "deep-1m": "100 layers 1M, 200 leaves",
  "mlp-30m": "MLP 30M, 6 leaves",
  "deep-30m": "100 layers 30M, 200 leaves",
  "transformer": "char-LM transformer 0.12M",
  "gpt": "GPT decoder 3.7M",
  "rope-gpt": "rotary GPT 0.53M",
}
# The H200: every JAX variant the plan predicts, then torch (measured only).
GPU_VARIANTS = {
  "dynamic_loss_scale": "float16, jls.dynamic_loss_scale",
  "jls_trainstate": "float16, jls.flax.TrainState",
  "flax_dynamic_scale": "float16, Flax DynamicScale + where",
  "autocast_dynamic_loss_scale": "float16, jls.autocast + dynamic_loss_scale",
  "bfloat16": "bfloat16, jls.no_loss_scale",
  "autocast_bfloat16": "bfloat16, jls.autocast + no_loss_scale",
  "static_scale": "float16, dynamic_loss_scale / a static 2^15 scale's step",
  "torch_eager": "torch AMP + GradScaler, eager",
  "torch_compile": "torch AMP + GradScaler, torch.compile",
}
COLORS = ["#3f51b5", "#7986cb", "#ff9800", "#8d6e63", "#9e9e9e", "#26a69a"]


def load(name: str) -> dict[str, Any]:
  return json.loads((RESULTS / name).read_text())


def cpu_ratios(payload: dict[str, Any]) -> dict[str, dict[str, float]]:
  """{model: {variant: median step ratio to plain Adam}} for the variants of ``CPU_VARIANTS``."""
  return {
    r["model"]: {v: r["variants"][v]["ratio_median"] for v in CPU_VARIANTS if v in r["variants"]}
    for r in payload["results"]
  }


def _static_scale_ratio() -> tuple[float, float, float]:
  """``dynamic_loss_scale`` over the static-scale step of the same rounds: median, min, max."""
  results = load("bench-gpu-large-static.json")["results"]
  rounds = zip(
    results["dynamic_loss_scale"]["step_ms_all"], results["float16_static_scale"]["step_ms_all"]
  )
  ratios = [dynamic / static for dynamic, static in rounds]
  return statistics.median(ratios), min(ratios), max(ratios)


def gpu_ratios() -> dict[str, tuple[float, float, float, tuple[float, float] | None]]:
  """{variant: (measured median, min, max, predicted (low, high) or None)} on the H200.

  ``static_scale`` is the scaler's own cost, against a static scale's step (the second run);
  its prediction is the plan's ``dynamic_loss_scale``, which carries the same gradients.
  """
  measured = load("bench-gpu-large.json")["results"]
  plan = load("gpu-plan-h200.json")["results"]
  out = {}
  for v in GPU_VARIANTS:
    predicted_as = "dynamic_loss_scale" if v == "static_scale" else v
    predicted = None
    if predicted_as in plan:
      low, high = sorted(plan[predicted_as]["ratio"].values())
      predicted = (low, high)
    if v == "static_scale":
      out[v] = (*_static_scale_ratio(), predicted)
    else:
      m = measured[v]
      out[v] = (m["ratio_median"], m["ratio_min"], m["ratio_max"], predicted)
  return out


def _save(fig, path: pathlib.Path) -> pathlib.Path:
  fig.savefig(path, dpi=100, metadata={"Software": f"matplotlib {matplotlib.__version__}"})
  plt.close(fig)
  return path


def _cpu_panel(ax, payload: dict[str, Any], title: str) -> None:
  ratios = cpu_ratios(payload)
  models = list(ratios)
  width = 0.8 / len(CPU_VARIANTS)
  for i, (variant, label) in enumerate(CPU_VARIANTS.items()):
    ys = [m + (i - (len(CPU_VARIANTS) - 1) / 2) * width for m in range(len(models))]
    xs = [ratios[m].get(variant, 0.0) for m in models]  # 0: not run in this file
    ax.barh(ys, xs, height=width, color=COLORS[i], label=label)
  ax.axvline(1.0, color="black", linewidth=1)
  ax.set_yticks(range(len(models)), [CPU_MODELS.get(m, m) for m in models])
  ax.invert_yaxis()
  ax.set_title(title, fontsize=10)
  ax.grid(axis="x", alpha=0.3)


def plot_cpu(out: pathlib.Path) -> pathlib.Path:
  fig, axes = plt.subplots(
    2, 1, figsize=(9, 9.5), height_ratios=[6, 4], sharex=True, layout="constrained"
  )
  for ax, name in zip(axes, ["bench.json", "bench-quick.json"]):
    payload = load(name)
    info = payload["machine"]
    _cpu_panel(ax, payload, f"{name}: XLA:CPU, {info['affinity']} cores, {info['date']}")
  axes[-1].set_xlabel("median step time / plain Adam's (1.0: no overhead)")
  handles, labels = axes[0].get_legend_handles_labels()
  fig.legend(handles, labels, loc="outside lower center", ncol=3, fontsize=8)
  fig.suptitle("Loss scalers' step time on XLA:CPU (measured)", fontsize=11)
  return _save(fig, out / "step-ratio-cpu.png")


def plot_gpu(out: pathlib.Path) -> pathlib.Path:
  ratios = gpu_ratios()
  info = load("bench-gpu-large.json")["machine"]
  fig, ax = plt.subplots(figsize=(10, 6), layout="constrained")
  names = list(GPU_VARIANTS)
  for i, v in enumerate(names):
    median, low, high, predicted = ratios[v]
    ax.barh(i - 0.2, median, height=0.38, color=COLORS[0], label="measured" if i == 0 else None)
    ax.errorbar(median, i - 0.2, xerr=[[median - low], [high - median]], color="black", capsize=2)
    if predicted is not None:
      mid = sum(predicted) / 2
      ax.barh(
        i + 0.2,
        mid,
        height=0.38,
        color="white",
        edgecolor=COLORS[2],
        hatch="//",
        label="predicted (GPU plan)" if i == 0 else None,
      )
      ax.errorbar(mid, i + 0.2, xerr=(predicted[1] - predicted[0]) / 2, color=COLORS[2], capsize=2)
  ax.axvline(1.0, color="black", linewidth=1)
  ax.set_xlim(0.85, 1.12)
  ax.set_yticks(range(len(names)), [GPU_VARIANTS[v] for v in names])
  ax.invert_yaxis()
  ax.set_xlabel("step time / the unscaled float16 step's (lower is faster)")
  ax.legend(loc="lower right", fontsize=8)
  ax.grid(axis="x", alpha=0.3)
  fig.suptitle(
    f"GPT-2 small on an {info['device'].removeprefix('gpu: ')}, {info['date']}\n"
    "measured: median, min..max over rounds; predicted: kernels at 40-50% of peak",
    fontsize=10,
  )
  return _save(fig, out / "gpu-measured-vs-predicted.png")


def render(out: pathlib.Path = OUT) -> list[pathlib.Path]:
  """Draws every plot into ``out``; returns the files written."""
  out.mkdir(parents=True, exist_ok=True)
  return [plot_cpu(out), plot_gpu(out)]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", type=pathlib.Path, default=OUT)
  for path in render(parser.parse_args().out):
    print(path)


if __name__ == "__main__":
  main()
