"""benchmarks/rl_grpo.py: GRPO in tunix in float16 with the scaler (where google-tunix is installed).

The float16 facts the RL guide states: tunix's attention mask constant is -inf in float16 and
turns a left-padded prompt's forward into NaN everywhere; float16's lowest as the mask fixes
it, and a short GRPO run through tunix's unedited learner then applies every step.
"""

from __future__ import annotations

from helpers import load_benchmark_module
from helpers import standard_promotion
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("tunix", reason="google-tunix is not installed")
pytest.importorskip("grain.python", reason="grain (a tunix dependency) is not installed")

# tunix 0.1.7 on JAX 0.10's deprecations
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture
def qwen3_mask():
  """tunix's Qwen3 module, its mask constant restored after the test."""
  from tunix.models.qwen3 import model as qwen3

  saved = qwen3.K_MASK
  yield qwen3
  qwen3.K_MASK = saved


def _padded_forward(rl_grpo, dtype):
  model = rl_grpo._model(dtype, 0, 22, rl_grpo.Settings(layers=2, embed=32))
  tokens = jnp.array([[0, 0, 5, 6, 7, 8]])  # a prompt left-padded with two pad tokens
  valid = tokens != 0
  positions = jnp.maximum(jnp.cumsum(valid, -1) - 1, 0)
  mask = valid[:, None, :] & jnp.tril(jnp.ones((6, 6), bool))[None]
  logits, _ = model(tokens, positions, None, mask)
  return np.asarray(logits, np.float32)


def test_tunix_mask_is_nan_in_float16_and_float16s_lowest_fixes_it(qwen3_mask):
  rl_grpo = load_benchmark_module("rl_grpo")
  with standard_promotion():
    # tunix's -2.38e38 overflows float16: -inf, with no more than numpy's warning
    with pytest.warns(RuntimeWarning, match="overflow"):
      assert jnp.float16(qwen3_mask.K_MASK) == -jnp.inf
    nan16 = np.isnan(_padded_forward(rl_grpo, jnp.float16))  # and no warning in the model
    nan32 = np.isnan(_padded_forward(rl_grpo, jnp.float32))
    # the pad rows (fully masked), then from the second layer on every position: 0 x NaN
    assert nan16.all() and not nan32.any()
    rl_grpo.float16_safe_mask()
    fixed16 = _padded_forward(rl_grpo, jnp.float16)
    fixed32 = _padded_forward(rl_grpo, jnp.float32)
  assert np.isfinite(fixed16).all()
  # the real tokens' logits: float16 agrees with float32 within float16's rounding
  np.testing.assert_allclose(fixed16[0, 2:], fixed32[0, 2:], atol=0.05)


def test_a_short_float16_grpo_run_applies_every_step(qwen3_mask, tmp_path):
  rl_grpo = load_benchmark_module("rl_grpo")
  import jax

  promotion = jax.config.jax_numpy_dtype_promotion
  jax.config.update("jax_numpy_dtype_promotion", "standard")  # tunix's threads
  try:
    s = rl_grpo.Settings(steps=3, batch=2, generations=2, layers=1, embed=32)
    run = rl_grpo.run("float16", 0, s)
  finally:
    jax.config.update("jax_numpy_dtype_promotion", promotion)
  assert len(run["rewards"]) == 3 and all(0.0 <= r <= 1.0 for r in run["rewards"])
  assert run["skips"] == 0 and run["final_scale"] == 2.0**16
  # the report and the picture of a run shorter than the plot's 20-step window
  rl_grpo.plot({"runs": [run]}, str(tmp_path / "r.png"))
  assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
