"""``benchmarks/rl_mismatch.py``: the sampler's token probabilities against the trainer's.

Its statistics on hand-computed inputs, and, where ``google-tunix`` is installed (it is not a
test dependency), its core function on a one-layer tunix Qwen3: tunix's ``Sampler`` and its
``compute_per_token_logps`` on the same weights agree to float32 rounding in float32, and the
half-precision models hold half-precision params cast from the same float32 master weights.
"""

from helpers import load_benchmark_module
from helpers import standard_promotion
import numpy as np
import pytest

rl_mismatch = load_benchmark_module("rl_mismatch")


def test_summarize_on_hand_computed_probabilities():
  logp_s = np.log([[0.5, 0.25, 0.125, 0.125]])
  logp_t = np.log([[0.25, 0.25, 0.125, 0.0625]])
  st = rl_mismatch.summarize(logp_s, logp_t)
  # |dp| = [0.25, 0, 0, 0.0625]
  assert st["token_max"] == 0.25
  assert st["token_median"] == pytest.approx(0.03125, rel=1e-12)
  assert st["token_zero_fraction"] == 0.5
  # One sequence: log 2 + 0 + 0 + log 2.
  assert st["seq_mean"] == pytest.approx(2 * np.log(2), rel=1e-12)
  assert st["seq_abs_max"] == pytest.approx(2 * np.log(2), rel=1e-12)
  assert st["slope_per_1k_tokens"] == pytest.approx(-2 * np.log(2) / 4 * 1000, rel=1e-12)
  same = rl_mismatch.summarize(logp_t, logp_t)
  assert same["token_max"] == same["seq_abs_max"] == 0.0 and same["token_zero_fraction"] == 1.0


def _synthetic(scale):
  """Raw arrays as the child saves them: float32 exact, the half dtypes off by ``scale``."""
  rng = np.random.default_rng(0)
  logp = np.log(rng.uniform(0.01, 1.0, (4, 8))).astype(np.float32)
  raw = {}
  for d, err in zip(rl_mismatch.DTYPES, [0.0, 8 * scale, scale], strict=True):
    raw[f"{d}/tokens"] = np.zeros((4, 8), np.int32)
    raw[f"{d}/logp_sampler"] = logp
    raw[f"{d}/logp_trainer"] = (logp - err * rng.uniform(0.5, 1.0, logp.shape)).astype(np.float32)
  return raw


def test_report_and_plot(tmp_path):
  raws = {s: _synthetic(1e-3) for s in rl_mismatch.SETTINGS}
  runs = {
    s: {
      "jax": "0",
      "tunix": "0",
      "seconds": 1.0,
      "stats": {
        d: rl_mismatch.summarize(raw[f"{d}/logp_sampler"], raw[f"{d}/logp_trainer"])
        for d in rl_mismatch.DTYPES
      },
    }
    for s, raw in raws.items()
  }
  md, data = rl_mismatch.report(runs, rl_mismatch.TINY, 2.0, "cmd")
  assert md.count("| float16 |") == len(rl_mismatch.SETTINGS) + 1  # + the paper's table
  for s in rl_mismatch.SETTINGS:
    assert f"`{rl_mismatch.SETTINGS[s]}`" in md
    assert data["settings"][s]["bf16_over_fp16_token_median"] == pytest.approx(8, rel=0.3)
  assert data["size"]["vocab_size"] == rl_mismatch.TINY.vocab_size
  assert data["paper_figure_5"]["bfloat16"]["kl_mu_pi"] == 7.64
  rl_mismatch.plot(raws, tmp_path / "m.png")
  assert (tmp_path / "m.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_setting_is_refused():
  with pytest.raises(ValueError, match="--settings"):
    rl_mismatch.main(["--settings", "fast"])


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # tunix 0.1.7 on JAX 0.10's deprecations
def test_measure_on_a_tiny_tunix_qwen3():
  pytest.importorskip("tunix", reason="google-tunix is not installed")
  import jax
  import jax.numpy as jnp

  size = rl_mismatch.TINY
  with standard_promotion():  # tunix's sampler is not strict-clean
    params = rl_mismatch.master_params(size)
    bf16 = rl_mismatch.model_in(size, params, jnp.bfloat16)
    result = rl_mismatch.measure(size)
  # tunix zero-initialises the MLP: re-drawn here, so the model is not a near-identity.
  gate = [x for p, x in jax.tree_util.tree_leaves_with_path(params) if "gate_proj" in str(p)]
  assert gate and all(float(jnp.std(g)) > 0.01 for g in gate)
  assert {x.dtype for x in jax.tree_util.tree_leaves(params)} == {jnp.dtype(jnp.float32)}
  assert {x.dtype for x in jax.tree_util.tree_leaves(bf16)} == {jnp.dtype(jnp.bfloat16)}

  assert tuple(result) == rl_mismatch.DTYPES
  shape = (size.num_sequences, size.gen_len)
  for r in result.values():
    assert r["tokens"].shape == r["logp_sampler"].shape == r["logp_trainer"].shape == shape
    assert r["tokens"].dtype == np.int32 and r["logp_sampler"].dtype == np.float32
    assert r["tokens"].min() >= 0 and r["tokens"].max() < size.vocab_size  # no pad, no EOS
    assert np.all(r["logp_sampler"] <= 0) and np.all(np.isfinite(r["logp_trainer"]))
  # float32: the KV-cached decode and the full forward agree to float32 rounding.
  f32 = rl_mismatch.summarize(result["float32"]["logp_sampler"], result["float32"]["logp_trainer"])
  assert f32["token_max"] < 1e-5 and f32["seq_abs_max"] < 1e-4
