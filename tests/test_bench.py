"""The benchmark: every variant computes the same training step, and the report re-renders.

Each registered variant is compiled on two tiny models (an MLP and a small
decoder-only transformer) and must train like plain Adam. A variant whose
package is missing (flax, jmp) is skipped with its reason outside CI and fails
in CI (``CI=true``): nothing here is skipped silently there.
"""

import glob
import importlib.util
import os

from helpers import BENCHMARKS_DIR
from helpers import in_ci
from helpers import load_benchmark_module
from helpers import standard_promotion
import numpy as np
import pytest

_DIR = BENCHMARKS_DIR
bench = load_benchmark_module("bench")  # puts benchmarks/ on sys.path for its siblings
import bench_gpt  # noqa: E402
import bench_models  # noqa: E402
import bench_report  # noqa: E402
import bench_variants  # noqa: E402

WIDTHS = [16, 32, 10]
TINY_LM = {"d_model": 16, "context": 8, "vocab": 128, "layers": 1}
TINY = {
  "mlp": bench_models.Model(
    "tiny-mlp",
    "tiny MLP",
    lambda seed=0: bench_models.mlp_init_params(WIDTHS, seed),
    lambda seed=1: bench_models.mlp_make_batch(WIDTHS, seed),
    bench_models.mlp_loss_fn,
    {"widths": WIDTHS},
    plain_loss_fn=bench_models.mlp_plain_loss_fn,
  ),
  "transformer": bench_models.Model(
    "tiny-lm",
    "tiny LM",
    lambda seed=0: bench_models.lm_init_params(seed, **TINY_LM),
    lambda seed=1: bench_models.lm_make_batch(seed, **TINY_LM),
    bench_models.lm_loss_fn,
    {"transformer": TINY_LM},
    plain_loss_fn=bench_models.lm_plain_loss_fn,
  ),
  "gpt": bench_models.gpt("tiny-gpt", "tiny GPT (AdamW)", bench_gpt.TINY_GPT),
  "rope": bench_models.rope_gpt(
    "tiny-rope", "tiny rotary GPT", vocab=128, seq=16, d_model=32, heads=2, layers=1, batch=2
  ),
}
_BASELINE = {}


def _require(name: str):
  need = bench_variants.missing(name)
  if need is None:
    return
  message = f"benchmark variant {name} needs {need}, which is not installed"
  if in_ci():
    pytest.fail(message + " (CI installs the test and bench extras)", pytrace=False)
  pytest.skip(message)


def _losses(name, model, steps=3):
  params = model.init_params(0)
  x, y = model.make_batch(1)
  with standard_promotion():  # optax.adam and the peers are not strict-clean
    variant, compiled, state, _, _, _ = bench.compile_variant(name, model, params, x, y)
    out = []
    for _ in range(steps):
      state, loss = compiled(state, x, y)
      out.append(float(loss))
  return out, variant.describe(state), bench.memory(compiled)


@pytest.mark.parametrize("model", sorted(TINY))
@pytest.mark.parametrize("name", bench_variants.VARIANTS)
def test_variant_trains_like_the_baseline(name, model):
  _require(name)
  if model not in _BASELINE:
    _BASELINE[model] = _losses("baseline", TINY[model])[0]
  base = _BASELINE[model]
  losses, final, memory = _losses(name, TINY[model])
  # Same model, same data, same Adam: the loss trajectories agree (the scaled
  # variants differ only by float16 rounding of scaled gradients).
  np.testing.assert_allclose(losses, base, rtol=1e-3)
  assert base[2] < base[0]
  if "scale" in final:
    assert final["scale"] > 0
  if "skipped_steps" in final:
    assert final["skipped_steps"] == 0
  # The memory columns come from here: CPU reports the temporary buffers.
  assert memory["temp_size_in_bytes"] > 0


def test_every_peer_and_reference_is_registered():
  assert bench_variants.VARIANTS[0] == "baseline"
  assert set(bench_variants.PEERS) == {"flax", "jmp", "optax_aif"}
  assert {"jax_lossscale", "jls_trainstate", "cond_ref", "jls_diagnostics"} <= set(
    bench_variants.VARIANTS
  )
  assert set(bench.QUICK_MODELS) <= set(bench.DEFAULT_MODELS) <= set(bench.MODELS)


def test_transformer_model_is_the_char_lm():
  """2 layers, d_model 64, float16 matmuls, float32 softmax/layernorm and loss."""
  import jax

  model = bench.MODELS["transformer"]
  params = model.init_params(0)
  x, y = model.make_batch(1)
  assert sorted(k for k in params if k.startswith("block_")) == ["block_0", "block_1"]
  assert params["embed"].shape == (128, 64)
  assert x.shape == y.shape == (bench.BATCH, 64)
  loss = jax.jit(model.loss_fn)(params, x, y)
  assert loss.dtype == np.float32
  assert abs(float(loss) - np.log(128)) < 1.0  # near uniform at init
  hlo = jax.jit(model.loss_fn).lower(params, x, y).as_text()
  assert "f16" in hlo and "dot_general" in hlo


@pytest.mark.parametrize(
  "path", sorted(glob.glob(os.path.join(_DIR, "results", "*.json"))), ids=os.path.basename
)
def test_committed_results_re_render_to_their_markdown(path):
  """The report is a function of the JSON: committed tables are reproducible."""
  import json

  md = path[: -len(".json")] + ".md"
  if not os.path.exists(md):
    pytest.fail(f"{path} has no markdown beside it")
  with open(path) as f:
    text = bench_report.markdown(json.load(f))
  with open(md) as f:
    assert text == f.read()


def test_gpt_is_scanned_float16_and_matches_torch():
  """The GPT: one scanned block, float16 matmuls; torch's module computes the same loss."""
  import jax
  import jax.numpy as jnp
  import torch

  cfg = bench_gpt.TINY_GPT
  params = bench_gpt.init_params(cfg)
  x, y = bench_gpt.make_batch(cfg)
  assert sum(int(np.prod(p.shape)) for p in jax.tree_util.tree_leaves(params)) == (
    bench_gpt.n_params(cfg)
  )
  assert bench_gpt.n_params(bench_gpt.GPT2_SMALL) == 124_475_904
  hlo = jax.jit(lambda p: bench_gpt.loss_fn(p, x, y, cfg)).lower(params).as_text()
  assert "f16" in hlo and "stablehlo.while" in hlo  # lax.scan over the layers
  loss32 = float(jax.jit(lambda p: bench_gpt.loss_fn(p, x, y, cfg, jnp.float32))(params))
  model = bench_gpt.torch_model(cfg, params, "cpu")
  with torch.no_grad():
    logits = model(torch.tensor(np.array(x), dtype=torch.long))
    ref = torch.nn.functional.cross_entropy(
      logits.view(-1, cfg.vocab), torch.tensor(np.array(y), dtype=torch.long).view(-1)
    )
  assert loss32 == pytest.approx(float(ref), rel=1e-5)
  assert abs(loss32 - np.log(cfg.vocab)) < 0.5


def test_large_benchmark_runs_tiny_and_renders(tmp_path):
  """The GPU script end to end on a tiny GPT (CPU): JSON and markdown, torch eager included."""
  import json

  spec = importlib.util.spec_from_file_location("bench_large", os.path.join(_DIR, "bench_large.py"))
  large = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(large)
  names = ["float16", "dynamic_loss_scale", "bfloat16", "autocast_dynamic_loss_scale"]
  names += ["torch_eager", "torch_compile"]
  with standard_promotion():
    large.main(
      ["--tiny", "--out", str(tmp_path), "--name", "t", "--rounds", "2", "--variants", *names]
    )
  payload = json.loads((tmp_path / "t.json").read_text())
  results = payload["results"]
  assert set(results) == {
    "float16",
    "dynamic_loss_scale",
    "bfloat16",
    "autocast_dynamic_loss_scale",
    "torch_eager",
  }
  assert results["autocast_dynamic_loss_scale"]["final"]["skipped_steps"] == 0
  assert "off-GPU" in payload["skipped"]["torch_compile"]
  assert results["float16"]["ratio_median"] == 1.0
  assert results["dynamic_loss_scale"]["final"]["skipped_steps"] == 0
  for r in results.values():
    assert r["tokens_per_s"] > 0 and abs(r["final_loss"] - np.log(128)) < 0.5
  assert (tmp_path / "t.md").read_text() == bench_report.markdown(payload)


def test_rope_gpt_hand_cast_is_the_autocast_computation():
  """The rotary GPT: its hand-cast model (torch's casts) and autocast of its float32 model
  compute the same loss and gradients up to float16 rounding; the mask is -inf."""
  import jax
  import jax.numpy as jnp

  import jax_lossscale as jls

  model = TINY["rope"]
  params = model.init_params(0)
  x, y = model.make_batch(1)
  assert "rope-gpt" in bench.QUICK_MODELS
  assert "-inf" in jax.make_jaxpr(model.plain_loss_fn)(params, x, y).pretty_print()
  auto = jls.autocast(model.plain_loss_fn, jnp.float16)
  hand_loss, hand_grads = jax.jit(jax.value_and_grad(model.loss_fn))(params, x, y)
  auto_loss, auto_grads = jax.jit(jax.value_and_grad(auto))(params, x, y)
  plain_loss = jax.jit(model.plain_loss_fn)(params, x, y)
  assert hand_loss.dtype == auto_loss.dtype == np.float32
  assert float(hand_loss) == pytest.approx(float(auto_loss), rel=1e-3)
  assert float(plain_loss) == pytest.approx(float(auto_loss), rel=1e-3)
  for h, a in zip(jax.tree_util.tree_leaves(hand_grads), jax.tree_util.tree_leaves(auto_grads)):
    np.testing.assert_allclose(h, a, atol=2e-2 * float(np.max(np.abs(h))) + 1e-6)


def test_large_autocast_attention_is_dot_product_attention(monkeypatch):
  """bench_large's float32 model calls jax.nn.dot_product_attention (implementation None):
  under autocast, lowered for CUDA it asks for cuDNN with float16 inputs; for the CPU the XLA
  implementation runs on float32 inputs."""
  import jax
  import jax.numpy as jnp

  import jax_lossscale as jls

  spec = importlib.util.spec_from_file_location("bench_large", os.path.join(_DIR, "bench_large.py"))
  large = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(large)
  assert large.parse_args(["--tiny"]).autocast_attention is None
  assert large.parse_args(["--tiny", "--attention", "xla"]).autocast_attention == "xla"
  cfg = bench_gpt.TINY_GPT
  params = bench_gpt.init_params(cfg)
  x, y = bench_gpt.make_batch(cfg)
  calls = []
  original = jax.nn.dot_product_attention

  def spy(q, k, v, *args, implementation=None, **kwargs):
    calls.append((np.dtype(q.dtype).name, implementation))
    if implementation == "cudnn":
      raise RuntimeError("no cuDNN off-GPU")  # the registered op falls back to XLA
    return original(q, k, v, *args, implementation=implementation, **kwargs)

  monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
  f32 = lambda p: bench_gpt.loss_fn(p, x, y, cfg, jnp.float32, None)
  with standard_promotion():
    jax.make_jaxpr(jls.autocast(f32, jnp.float16))(params)
  # The kernel is chosen for the lowering platform (lax.platform_dependent), so each branch is
  # traced: the CPU's float32 XLA attention, CUDA's cuDNN attempt (its fallback to XLA here,
  # where the spy refuses it) and the other platforms' XLA attention on the float16 inputs.
  assert set(calls) == {("float32", None), ("float16", "cudnn"), ("float16", None)}


def test_hlo_census_counts_converts_by_dtype():
  """bench_hlo's census: converts by (from, to) and the ops by (opcode, dtype)."""
  import bench_hlo
  import jax
  import jax.numpy as jnp

  f = lambda a, w: jnp.tanh(a @ w.astype(jnp.float16)).astype(jnp.float32).sum()
  a, w = jnp.ones((8, 8), jnp.float16), jnp.ones((8, 8), jnp.float32)
  c = bench_hlo.census(jax.jit(f).lower(a, w).compile().as_text())
  assert c["converts"][("f32", "f16")] >= 1 and c["converts"][("f16", "f32")] >= 1
  assert sum(n for (op, _), n in c["ops"].items() if op == "convert") == sum(c["converts"].values())


def test_retry_sync_benchmark_runs_and_renders(tmp_path, capsys):
  """The GPU host-sync measurement of retry_on_overflow runs here too (CPU: no flag variant)."""
  import bench_retry_sync

  bench_retry_sync.main(
    ["--model", "mlp-1m", "--steps", "2", "--rounds", "1", "--out", str(tmp_path)]
  )
  text = (tmp_path / "retry-sync-cpu.md").read_text()
  assert "| as compiled | scaled |" in text and "| as compiled | retry |" in text


def test_compile_benchmark_runs_tiny_and_renders():
  """bench_compile_gpt on a tiny GPT (CPU): every variant compiles; the report renders its goals."""
  compile_gpt = load_benchmark_module("bench_compile_gpt")
  with standard_promotion():
    res = compile_gpt.run(2, "cpu", 1, cfg=bench_gpt.TINY_GPT)
  lines = {v: res["median"][v]["hlo_lines"] for v in compile_gpt.VARIANTS}
  # the scaler adds its check and skip to plain AdamW; the retry holds the backward twice
  assert lines["adamw"] < lines["scaler"] < lines["retry"]
  for name, r in res["ratios"].items():
    a, b = {**compile_gpt.GOALS, **compile_gpt.EXTRA}[name][:2]
    assert r["rounds"] == [
      x["compile"] / y["compile"] for x, y in zip(res["rounds"][a], res["rounds"][b])
    ]
  payload = {
    "kind": "compile-gpt",
    "machine": bench_report.machine_info(),
    "settings": {
      "args": "--tiny",
      "rounds": 1,
      "variants": list(compile_gpt.VARIANTS),
      "goals": {k: list(v) for k, v in compile_gpt.GOALS.items()},
      "extra": compile_gpt.EXTRA,
    },
    "results": [res],
  }
  text = bench_report.markdown(payload)
  assert text.count("| GPT, 2 blocks | cpu |") == len(compile_gpt.VARIANTS) + len(res["ratios"])
  assert "<= 1.2: " in text and "<= 1.5: " in text


def test_cpu_step_anatomy_counts_each_weights_passes():
  """cpu_step_anatomy on the 1M MLP: plain Adam's passes over a weight, and the scaler's more."""
  anatomy = load_benchmark_module("cpu_step_anatomy")
  model = bench_models.MODELS["mlp-1m"]
  size = 512 * 1024
  with standard_promotion():
    (base, n_base), (scaled, n_scaled) = (
      anatomy.passes(anatomy.compiled_text(v, model), size) for v in ("baseline", "jax_lossscale")
    )
  assert n_base == n_scaled == 2  # the 512x1024 and 1024x512 weights' gradients
  # plain Adam: the gradient's matmul, then the new mu, nu and params, each one fusion
  assert [r["opcode"] for r in base].count("dot") == 2 and len(base) == 4 * 2
  assert sum(r["read"] + r["written"] for r in base) == 44 * 2
  # the scaler reads and writes more: at least its finiteness check's read of each gradient
  assert sum(r["read"] + r["written"] for r in scaled) >= (44 + 4) * 2
  assert any(r["op"] == "is_finite" for r in scaled)
