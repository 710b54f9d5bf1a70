"""The benchmark's variants compute the same training step (a tiny model, two steps each)."""

import importlib.util
import os

import numpy as np
import pytest

from conftest import standard_promotion

_PATH = os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks", "bench.py")
_spec = importlib.util.spec_from_file_location("bench", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

WIDTHS = [16, 32, 10]


@pytest.mark.parametrize("name", bench.VARIANTS)
def test_variant_trains_like_the_baseline(name):
  if name == "jmp":
    pytest.importorskip("jmp")
  params = bench.init_params(WIDTHS)
  x, y = bench.make_batch(WIDTHS)
  losses = {}
  with standard_promotion():  # optax.adam and the peers are not strict-clean
    for variant in ("baseline", name):
      v, compiled, state, _, _ = bench.compile_variant(variant, params, x, y)
      out = []
      for _ in range(3):
        state, loss = compiled(state, x, y)
        out.append(float(loss))
      losses[variant] = out
      final = v.describe(state)
  # Same model, same data, same Adam: the loss trajectories agree (the scaled
  # variants differ only by float16 rounding of scaled gradients).
  np.testing.assert_allclose(losses[name], losses["baseline"], rtol=1e-3)
  assert losses["baseline"][2] < losses["baseline"][0]
  if "scale" in final:
    assert final["scale"] > 0
  assert np.isfinite(losses[name][-1])
