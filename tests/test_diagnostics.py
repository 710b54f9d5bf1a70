"""grad_diagnostics (per-leaf float16 headroom, jit-safe) and check_underflow."""

import time
from typing import NamedTuple

from helpers import calibrated_iterations
from helpers import slow_batch
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_lossscale as jls
from jax_lossscale.diagnostics import UnderflowReport

F16_SUB = float(2.0**-15)  # a float16 subnormal
F16_TINY = float(2.0**-14)  # the smallest normal float16: not counted


def _grads():
  return {
    "layers_0": {
      "attn": {"kernel": jnp.array([4.0, -0.0, F16_SUB, F16_TINY, -8.0], jnp.float16)},
    },
    "bad": jnp.array([1.0, jnp.inf, jnp.nan, -2.0], jnp.float32),
    "zeros": jnp.zeros((3,), jnp.float32),
    "big": [jnp.array([[16376.0, -1e-7]], jnp.float32)],
    "step": jnp.int32(7),  # ignored: not floating point
    "none": None,
  }


def test_leaf_names_follow_flattening_order():
  assert jls.diagnostics.grad_leaf_names(_grads()) == [
    "bad",
    "big/0",
    "layers_0/attn/kernel",
    "zeros",
  ]
  assert jls.diagnostics.grad_leaf_names(jnp.ones(2)) == ["leaf"]
  assert jls.diagnostics.grad_leaf_names({"i": jnp.int32(1)}) == []


def test_exact_values(maybe_jit):
  d = maybe_jit(jls.diagnostics.grad_diagnostics)(_grads(), jnp.float32(4.0))
  d = {k: np.asarray(v) for k, v in d.items()}
  names = jls.diagnostics.grad_leaf_names(_grads())
  assert set(d) == {
    f"{n}/{s}" for n in names for s in ("max_abs", "nonfinite", "headroom", "zero", "subnormal")
  } | {"min_headroom", "min_headroom_leaf", "nonfinite"}
  k = "layers_0/attn/kernel"
  assert d[f"{k}/max_abs"] == np.float32(2.0)  # 8 / 4, the finite maximum, unscaled
  assert d[f"{k}/nonfinite"] == 0
  # log2 of a non-power of two: XLA's and NumPy's may differ in the last bit.
  assert d[f"{k}/headroom"] == pytest.approx(np.log2(65504.0 / 8.0), rel=1e-6)
  assert d[f"{k}/zero"] == np.float32(0.2)  # -0.0 is a zero
  assert d[f"{k}/subnormal"] == np.float32(0.25)  # 2**-15 of the 4 non-zeros; 2**-14 is normal
  # inf and NaN: counted, excluded from the maximum, headroom -inf; neither zero nor small.
  assert d["bad/max_abs"] == np.float32(0.5)
  assert d["bad/nonfinite"] == 2
  assert d["bad/headroom"] == -np.inf
  assert d["bad/zero"] == 0.0 and d["bad/subnormal"] == 0.0
  # All zeros: nothing can overflow, and nothing is subnormal (no non-zero element).
  assert d["zeros/max_abs"] == 0.0 and d["zeros/headroom"] == np.inf
  assert d["zeros/zero"] == 1.0 and d["zeros/subnormal"] == 0.0
  # 65504 / 16376 == 4: exactly two doublings left.
  assert d["big/0/headroom"] == 2.0
  assert d["big/0/max_abs"] == np.float32(4094.0)
  assert d["big/0/zero"] == 0.0 and d["big/0/subnormal"] == 0.5  # -1e-7 (float32)
  assert d["min_headroom"] == -np.inf
  assert names[int(d["min_headroom_leaf"])] == "bad"
  assert d["nonfinite"] == 2
  for key, v in d.items():
    assert v.shape == (), key
    want = np.int32 if key.endswith(("nonfinite", "_leaf")) else np.float32
    assert v.dtype == want, (key, v.dtype)


def test_structural_zeros_are_not_counted_as_subnormal():
  """The embedding of a char LM: rows of characters absent from the batch are exact zeros.

  They are zero in float32 too, so they are reported as ``zero``, and the
  ``subnormal`` share (of the non-zero elements) stays 0.
  """
  rows = np.ones((10, 4), np.float32)
  rows[:3] = 0.0  # 3 of 10 characters absent: 30% exact zeros
  d = jls.diagnostics.grad_diagnostics({"embed": jnp.asarray(rows, jnp.float16)}, 1.0)
  assert float(d["embed/zero"]) == pytest.approx(0.3)
  assert float(d["embed/subnormal"]) == 0.0
  assert "embed/subnormal_or_zero" not in d


def test_overflow_step_is_documented_as_minus_inf_headroom_and_total_count():
  g = {"a": jnp.array([1.0, jnp.inf], jnp.float16), "b": jnp.array([jnp.nan, jnp.nan, 1.0])}
  d = jax.jit(jls.diagnostics.grad_diagnostics)(g, 2.0)
  assert float(d["a/headroom"]) == -np.inf and float(d["b/headroom"]) == -np.inf
  assert float(d["min_headroom"]) == -np.inf
  assert int(d["nonfinite"]) == 3  # the total over all leaves
  assert float(d["a/max_abs"]) == 0.5  # the finite elements only


def test_every_documented_scale_argument_gives_the_same_result():
  """``grad_diagnostics(grads, scale)`` takes a number, an array, the state or the opt_state."""
  import optax

  tx = jls.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0)
  opt_state = tx.init({"w": jnp.zeros(3)})
  g = {"w": jnp.array([16.0, 0.0, 1e-6], jnp.float32)}
  want = jls.diagnostics.grad_diagnostics(g, 8.0).flat()
  for scale in (
    8,
    jnp.float32(8.0),
    jls.get_scale_state(opt_state),
    jls.get_scale_state(opt_state).scale,
    opt_state,
  ):
    got = jax.jit(jls.diagnostics.grad_diagnostics)(g, scale).flat()
    assert got.keys() == want.keys()
    for k in want:
      np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  assert want["w/max_abs"] == 2.0


def test_result_is_a_small_pytree_with_the_flat_keys():
  """Returned from jit it is one vector per statistic, not one scalar per leaf and statistic."""
  g = {f"l{i:02d}": jnp.ones((3,)) * i for i in range(20)}
  d = jax.jit(jls.diagnostics.grad_diagnostics)(g, 1.0)
  assert len(jax.tree_util.tree_leaves(d)) == 8
  assert len(d) == 20 * 5 + 3 and len(list(d)) == len(d)
  assert float(d["l07/max_abs"]) == 7.0 and int(d["min_headroom_leaf"]) == 19
  assert dict(d).keys() == d.flat().keys()
  with pytest.raises(KeyError):
    d["l07/nope"]
  # Carried through lax.scan, the stacked values are indexed on their last axis.
  _, logs = jax.lax.scan(
    lambda c, s: (c, jls.diagnostics.grad_diagnostics(g, s)), 0, jnp.array([1.0, 2.0])
  )
  np.testing.assert_array_equal(np.asarray(logs["l07/max_abs"]), [7.0, 3.5])


class _Dense(NamedTuple):
  kernel: jax.Array
  bias: jax.Array


def test_attribute_keys_are_named_without_a_dot():
  """Leaves under a NamedTuple field or an Equinox module attribute: ``dense/kernel``."""
  import equinox as eqx

  tree = {"dense": _Dense(jnp.ones((2, 2)), jnp.zeros(2))}
  assert jls.diagnostics.grad_leaf_names(tree) == ["dense/kernel", "dense/bias"]
  linear = eqx.nn.Linear(2, 3, key=jax.random.key(0))
  assert jls.diagnostics.grad_leaf_names({"head": linear}) == ["head/weight", "head/bias"]
  d = jls.diagnostics.grad_diagnostics(tree, 1.0)
  assert "dense/kernel/max_abs" in d and float(d["dense/kernel/max_abs"]) == 1.0


def test_limiting_leaf_without_overflow(maybe_jit):
  g = _grads()
  del g["bad"]
  d = maybe_jit(jls.diagnostics.grad_diagnostics)(g, jls.DynamicScaleState.create(init_scale=4.0))
  assert float(d["min_headroom"]) == 2.0
  assert jls.diagnostics.grad_leaf_names(g)[int(d["min_headroom_leaf"])] == "big/0"
  assert int(d["nonfinite"]) == 0
  # Doubling the scale (and so the scaled gradients) twice reaches exactly 65504.
  g4 = jax.tree_util.tree_map(lambda x: x * 4 if jnp.issubdtype(x.dtype, jnp.floating) else x, g)
  d4 = maybe_jit(jls.diagnostics.grad_diagnostics)(g4, jnp.float32(16.0))
  assert float(d4["min_headroom"]) == 0.0
  assert float(d4["big/0/max_abs"]) == 4094.0  # the true magnitude does not change


def test_scale_from_an_optimizer_state():
  import optax

  tx = jls.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0)
  opt_state = tx.init({"w": jnp.zeros(2)})
  d = jax.jit(jls.diagnostics.grad_diagnostics)({"w": jnp.array([16.0, 0.0])}, opt_state)
  assert float(d["w/max_abs"]) == 2.0
  r = jls.diagnostics.check_underflow(
    _elementwise_loss, {"w": jnp.ones(1)}, jnp.ones(1), scale=opt_state
  )
  assert float(r.scale) == 8.0


def test_headroom_negative_above_float16_max_in_float32_grads():
  d = jls.diagnostics.grad_diagnostics({"w": jnp.array([65504.0 * 8], jnp.float32)}, 1.0)
  assert float(d["w/headroom"]) == -3.0


def test_empty_and_int_only_trees():
  for tree in ({}, {"i": jnp.int32(1)}, [None]):
    d = jls.diagnostics.grad_diagnostics(tree, 1.0)
    assert set(d) == {"min_headroom", "min_headroom_leaf", "nonfinite"}
    assert float(d["min_headroom"]) == np.inf and int(d["min_headroom_leaf"]) == -1


def test_duplicate_names_raise():
  with pytest.raises(ValueError, match="two leaves named 'a/b'"):
    jls.diagnostics.grad_diagnostics({"a/b": jnp.ones(1), "a": {"b": jnp.ones(1)}}, 1.0)


def test_bfloat16_leaves():
  g = {"b": jnp.array([256.0, 0.0], jnp.bfloat16)}
  d = jls.diagnostics.grad_diagnostics(g, 2.0)
  assert float(d["b/max_abs"]) == 128.0
  assert float(d["b/headroom"]) == pytest.approx(np.log2(65504 / 256), rel=1e-6)
  assert d["b/max_abs"].dtype == jnp.float32


def test_no_host_sync():
  """The call returns while the gradients it reads are still being computed."""
  diag = jax.jit(jls.diagnostics.grad_diagnostics)
  g = {"a": jnp.ones((64, 64), jnp.float16), "b": jnp.ones((8,), jnp.float32)}
  scale = jnp.float32(2.0)
  jax.block_until_ready(diag(g, scale))  # compiled for exactly the timed call's types
  n = calibrated_iterations(g["b"], seconds=3.0)
  jax.block_until_ready(slow_batch(g["b"], n))  # the loop length is a traced argument

  t0 = time.perf_counter()
  b = slow_batch(g["b"], n)
  d = diag({"a": g["a"], "b": b}, scale)
  call_s = time.perf_counter() - t0
  still_running = not b.is_ready() and not d["min_headroom"].is_ready()
  jax.block_until_ready(d)
  total_s = time.perf_counter() - t0
  assert still_running, (call_s, total_s)
  assert call_s < total_s / 2, (call_s, total_s)
  assert float(d["b/max_abs"]) == 0.5


# ----------------------------------------------------------------------------
# check_underflow


def _elementwise_loss(p, c, dtype):
  """The gradient w.r.t. ``p["w"]`` is ``c * scale`` rounded to ``dtype``, unscaled."""
  return jnp.sum(p["w"].astype(dtype).astype(jnp.float32) * c)


def test_counts_exactly_which_elements_float16_loses(maybe_jit):
  # 1e-9: below float16's smallest subnormal (flushed); 1e-7: a subnormal
  # (kept); 1e-3 kept; 0.0 is zero in float32 too (not counted).
  c = jnp.array([1e-9, 1e-7, 1e-3, 0.0], jnp.float32)
  params = {"w": jnp.ones(4, jnp.float32)}
  check = maybe_jit(lambda p, b: jls.diagnostics.check_underflow(_elementwise_loss, p, b))
  r = check(params, c)
  assert int(r.nonzero["w"]) == 3
  assert int(r.lost_unscaled["w"]) == 1
  assert int(r.lost_scaled["w"]) == 0  # 1e-9 * 2**16 is a float16 normal
  assert bool(r.finite_unscaled) and bool(r.finite_scaled)
  assert float(r.scale) == 2.0**16
  assert r.fractions() == {"w": 1 / 3} and r.fractions(scaled=True) == {"w": 0.0}
  assert r.nonzero["w"].dtype == jnp.int32
  assert r.needs_loss_scaling()
  assert r.verdict().startswith("NEEDS loss scaling: float16 without loss scaling flushes 33.33%")
  assert "0.00% at scale 2^16" in r.verdict()
  assert "w" in r.table() and "33.333%" in r.table()


def test_scaled_backward_that_overflows_is_reported():
  c = jnp.array([1e-9, 1.0], jnp.float32)  # 1.0 * 2**16 overflows float16
  r = jls.diagnostics.check_underflow(_elementwise_loss, {"w": jnp.ones(2)}, c)
  assert bool(r.finite_unscaled) and not bool(r.finite_scaled)
  assert "scale 2^16 overflows" in r.verdict()
  r = jls.diagnostics.check_underflow(_elementwise_loss, {"w": jnp.ones(2)}, c * 1e5)
  assert not bool(r.finite_unscaled)
  assert r.verdict().startswith("float16 overflows even without scaling")


def _mlp_loss(factor):
  def loss_fn(p, batch, dtype):
    x, y = batch
    h = jnp.tanh(x.astype(dtype) @ p["l1"]["w"].astype(dtype) + p["l1"]["b"].astype(dtype))
    out = h @ p["l2"]["w"].astype(dtype)
    return jnp.mean(jnp.square(out.astype(jnp.float32) - y)) * np.float32(factor)

  return loss_fn


def _mlp_setup(param_dtype=jnp.float32):
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  params = {
    "l1": {"w": jax.random.normal(k1, (8, 16)) / 3, "b": jnp.zeros(16)},
    "l2": {"w": jax.random.normal(k2, (16, 1)) / 4},
  }
  params = jax.tree_util.tree_map(lambda x: x.astype(param_dtype), params)
  x = jax.random.normal(k3, (32, 8))
  return params, (x, jnp.sin(x[:, :1]))


@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.float16])
def test_known_answer_both_ways(param_dtype):
  params, batch = _mlp_setup(param_dtype)
  # A loss of order 1: float16 keeps essentially every gradient element.
  fine = jls.diagnostics.check_underflow(_mlp_loss(1.0), params, batch)
  assert fine.total() < 0.01, fine.table()
  assert not fine.needs_loss_scaling()
  # Its two float16 matmuls' outputs had no taps: the parameters alone cannot say "no".
  assert fine.not_checked["loss_fn"].tolist() == [1, 2]
  assert fine.verdict().startswith("cannot tell from the parameter gradients alone")
  assert "; not checked: the gradients of loss_fn's 2 half-precision matmul and convolution " in (
    fine.verdict()
  )
  # The same model with a loss ~1e-9 smaller: every gradient flushes to 0
  # without scaling, none with 2**16 ... 2**40.
  tiny = jls.diagnostics.check_underflow(_mlp_loss(1e-9), params, batch, scale=2.0**40)
  assert tiny.total() == 1.0 and tiny.total(scaled=True) < 0.01, tiny.table()
  assert tiny.needs_loss_scaling()
  assert tiny.verdict().startswith("NEEDS loss scaling")
  assert set(tiny.nonzero) == {"l1/b", "l1/w", "l2/w"}
  assert tiny.total(prefix="l1/") == 1.0


def test_activation_gradients_through_taps():
  params, batch = _mlp_setup()

  def loss_fn(p, b, dtype):
    x, y = b
    h = x.astype(dtype) @ p["params"]["l1"]["w"].astype(dtype) + p["taps"].astype(dtype)
    out = jnp.tanh(h) @ p["params"]["l2"]["w"].astype(dtype)
    return jnp.mean(jnp.square(out.astype(jnp.float32) - y)) * np.float32(1e-4)

  p = {"params": params, "taps": jnp.zeros((32, 16), jnp.float32)}
  r = jls.diagnostics.check_underflow(loss_fn, p, batch)
  assert int(r.nonzero["taps"]) == 32 * 16
  # Per-example activation gradients are 1/32 of the batch-mean loss's: many flush.
  assert r.total(prefix="taps") > r.total(prefix="params")
  assert r.total(prefix="taps", scaled=True) == 0.0


def test_one_pass_per_leaf_no_leaf_sized_intermediate():
  """Each leaf is reduced in one loop: no s32/f32 copy of the leaf is written."""
  g = {"a": jnp.ones((512, 384), jnp.float16), "b": jnp.ones((1000,), jnp.float32)}
  hlo = jax.jit(jls.diagnostics.grad_diagnostics).lower(g, 2.0).compile().as_text()
  entry = hlo[hlo.index("ENTRY") :]
  for shape in ("[512,384]", "[1000]"):
    produced = [
      line
      for line in entry.splitlines()
      if "= " in line
      and shape in line.split("= ", 1)[1].split(" ", 1)[0]
      and "parameter(" not in line
    ]
    assert not produced, produced


def test_float64_leaves_are_reduced_in_float64():
  """1e39 is finite in float64 (inf in float32): not counted as non-finite."""
  import subprocess
  import sys

  code = (
    "import jax; jax.config.update('jax_enable_x64', True)\n"
    "import jax.numpy as jnp, jax_lossscale as jls\n"
    "d = jls.diagnostics.grad_diagnostics({'w': jnp.array([1e39, 0.0], jnp.float64)}, 1.0)\n"
    "print(int(d['w/nonfinite']), float(d['w/headroom']), d['w/max_abs'].dtype)\n"
  )
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.split() == ["0", "-inf", "float32"]


# ----------------------------------------------------------------------------
# check_underflow: activations, the verdict's threshold and pooling, half_dtype


def _report(nonzero, lost_unscaled, lost_scaled):
  as_arrays = lambda d: {k: jnp.int32(v) for k, v in d.items()}
  return jls.diagnostics.UnderflowReport(
    as_arrays(nonzero),
    as_arrays(lost_unscaled),
    as_arrays(lost_scaled),
    jnp.array(True),
    jnp.array(True),
    jnp.float32(2.0**16),
  )


def test_exactly_the_threshold_needs_scaling():
  r = _report({"w": 100}, {"w": 1}, {"w": 0})  # exactly 1% lost
  assert r.total() == 0.01
  assert r.needs_loss_scaling(0.01)
  assert r.verdict().startswith("NEEDS loss scaling")
  assert not _report({"w": 1000}, {"w": 9}, {"w": 0}).needs_loss_scaling(0.01)  # 0.9%


def test_total_pools_elements_over_leaves():
  """A one-element bias that is lost weighs one element, not as much as a whole kernel."""
  r = _report({"kernel": 99, "bias": 1}, {"kernel": 0, "bias": 1}, {"kernel": 0, "bias": 0})
  assert r.fractions() == {"kernel": 0.0, "bias": 1.0}
  assert r.total() == 0.01  # 1 of 100 elements (the mean of the shares would be 0.5)
  assert r.total(prefix="k") == 0.0


def test_scaled_backward_runs_in_half_dtype():
  """bfloat16 has float32's range: 1.0 * 2**16 does not overflow it, as it does float16."""
  c = jnp.array([1e-9, 1.0], jnp.float32)
  params = {"w": jnp.ones(2)}
  f16 = jls.diagnostics.check_underflow(_elementwise_loss, params, c)
  bf16 = jls.diagnostics.check_underflow(_elementwise_loss, params, c, half_dtype=jnp.bfloat16)
  assert not bool(f16.finite_scaled)
  assert bool(bf16.finite_scaled) and bool(bf16.finite_unscaled)
  assert int(bf16.lost_unscaled["w"]) == 0 and int(bf16.lost_scaled["w"]) == 0
  assert not bf16.needs_loss_scaling()


_V, _D, _B, _T = 65, 32, 16, 128  # a character vocabulary, as the Equinox nanoGPT's


def _char_lm():
  k = jax.random.split(jax.random.key(0), 3)
  params = {
    "embed": jax.random.normal(k[0], (_V, _D)),
    "head": jax.random.normal(k[1], (_D, _V)) * np.float32(3 / np.sqrt(_D)),
  }
  tokens = jax.random.randint(k[2], (_B, _T + 1), 0, 40)  # 25 characters never appear
  return params, (tokens[:, :-1], tokens[:, 1:])


def _char_lm_loss(p, batch, dtype, taps=None):
  import optax

  x, y = batch
  logits = p["embed"].astype(dtype)[x] @ p["head"].astype(dtype)
  if taps is not None:
    logits = logits + taps["logits"].astype(dtype)
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()


def test_logit_gradients_flush_while_parameter_gradients_do_not():
  """The nanoGPT-shaped case: params lose 0%, the logits' gradients ~25%: NEEDS scaling."""
  params, batch = _char_lm()
  taps = {"logits": jax.ShapeDtypeStruct((_B, _T, _V), jnp.float32)}
  r = jax.jit(lambda p, b: jls.diagnostics.check_underflow(_char_lm_loss, p, b, activations=taps))(
    params, batch
  )
  looked = r.looked_at()
  assert looked == {"params": ["embed", "head"], "activations": ["activations/logits"]}
  assert r.total(keys=looked["params"]) == 0.0
  assert 0.2 < r.total(prefix="activations/") < 0.35
  assert r.total(prefix="activations/", scaled=True) < 0.001  # 2**16 keeps almost all
  # Rows of absent characters are zero in float32 too: not counted as lost.
  assert int(r.nonzero["embed"]) == 40 * _D
  assert r.needs_loss_scaling()
  verdict = r.verdict()
  assert verdict.startswith("NEEDS loss scaling: float16 without loss scaling flushes 0.00%")
  assert "activation-gradient elements (1 leaves; worst activations/logits" in verdict
  # Without taps it looks at the parameters only, and says so.
  plain = jls.diagnostics.check_underflow(lambda p, b, dt: _char_lm_loss(p, b, dt), params, batch)
  assert not plain.needs_loss_scaling()
  assert "parameter gradients only" in plain.verdict()
  # ... and, the model computing in float16, it does not answer "no" from them: the tapped
  # check above says NEEDS for the same model and batch.
  assert plain.verdict().startswith("cannot tell from the parameter gradients alone")
  assert int(plain.not_checked["loss_fn"][1]) > 0
  assert "loss_fn" not in r.not_checked  # with taps, no such count


def test_flax_perturbations_count_as_activations():
  params, batch = _char_lm()

  def loss_fn(v, b, dtype):
    return _char_lm_loss(v["params"], b, dtype, v["perturbations"])

  variables = {"params": params, "perturbations": {"logits": jnp.zeros((_B, _T, _V))}}
  r = jls.diagnostics.check_underflow(loss_fn, variables, batch)
  assert r.looked_at()["activations"] == ["perturbations/logits"]
  assert r.needs_loss_scaling()
  assert r.not_checked == {}  # the perturbations are taps: the matmuls are not counted


def test_a_half_model_without_matmuls_or_convolutions_has_nothing_unchecked():
  # Only matmul and convolution outputs go unchecked in a hand-cast model without taps: an
  # elementwise model's parameter gradients are all there is, and the verdict can say no.
  w, x = jnp.full((8,), 0.5), jax.random.normal(jax.random.key(0), (4, 8))
  loss_fn = lambda w, x, dt: jnp.sum(jnp.tanh(x.astype(dt) * w.astype(dt)).astype(jnp.float32))
  r = jls.diagnostics.check_underflow(loss_fn, w, x)
  assert r.not_checked == {}
  assert r.verdict().startswith("does not need loss scaling here"), r.verdict()


def test_taps_inside_params_and_as_argument_are_refused():
  with pytest.raises(ValueError, match="activations"):
    jls.diagnostics.check_underflow(
      lambda p, b, dt, t: jnp.sum(p["w"]),
      {"w": jnp.ones(1), "activations": jnp.zeros(1)},
      None,
      activations={"h": jnp.zeros(1)},
    )


def _flat_report(names, nonzero, lost, scale):
  """A report built by hand: ``lost`` elements of ``nonzero`` per leaf, the same at both scales."""
  return UnderflowReport(
    nonzero={k: jnp.int32(nonzero) for k in names},
    lost_unscaled={k: jnp.int32(lost) for k in names},
    lost_scaled={k: jnp.int32(lost) for k in names},
    finite_unscaled=jnp.bool_(True),
    finite_scaled=jnp.bool_(True),
    scale=jnp.float32(scale),
  )


def test_verdict_at_scale_zero_prints_the_scale_instead_of_its_log():
  # log2(0) is undefined: the verdict writes the scale itself ("0"); it used to raise
  # ValueError (round(nan)) for check_underflow(..., scale=0.0).
  verdict = _flat_report(["w"], 4, 1, 0.0).verdict()
  assert "25.00% at scale 0" in verdict
  assert verdict.startswith("does not need loss scaling")  # scale 0 saves nothing


def test_verdict_at_an_infinite_scale_says_it_overflows():
  report = _flat_report(["w"], 4, 1, float("inf"))._replace(finite_scaled=jnp.bool_(False))
  assert "scale inf overflows (the dynamic scaler backs off from it)" in report.verdict()


def test_verdict_writes_a_power_of_two_scale_as_a_power():
  assert "at scale 2^16" in _flat_report(["w"], 4, 0, 2.0**16).verdict()
  assert "at scale 1000" in _flat_report(["w"], 4, 0, 1000.0).verdict()


def test_verdict_calls_parameter_gradients_parameter_gradients():
  verdict = _flat_report(["w", "b"], 8, 2, 2.0**16).verdict()
  assert "of the non-zero parameter-gradient elements (2 leaves; worst w: 25.00%)" in verdict
  assert "activation-gradient" not in verdict


def test_a_missing_key_raises_key_error_naming_the_whole_key():
  """``KeyError(key)`` for the key asked for, not for the part of it that was not found."""
  d = jls.diagnostics.grad_diagnostics({"w": jnp.ones(2)}, 1.0)
  for key in ("w/nope", "nope/max_abs", "nope"):
    with pytest.raises(KeyError) as raised:
      d[key]
    assert raised.value.args == (key,)
    assert key not in d and d.get(key) is None


def test_a_zero_size_leaf_gets_finite_shares_not_nan():
  """No element: no zero and no subnormal share (0, not 0/0), nothing to overflow."""
  g = {"empty": jnp.ones((0, 3), jnp.float16), "w": jnp.array([4094.0, 0.0])}
  d = jls.diagnostics.grad_diagnostics(g, 1.0).flat()
  assert {k: float(v) for k, v in d.items() if k.startswith("empty/")} == {
    "empty/max_abs": 0.0,
    "empty/nonfinite": 0.0,
    "empty/headroom": np.inf,
    "empty/zero": 0.0,
    "empty/subnormal": 0.0,
  }
  assert float(d["w/zero"]) == 0.5 and float(d["min_headroom"]) == 4.0  # 65504 / 4094 == 16
  assert int(d["min_headroom_leaf"]) == 1  # "w": the empty leaf's headroom is +inf


def test_leaves_with_no_non_zero_gradient_have_share_zero_in_the_table_and_verdict():
  """An unused param and a zero-size one: 0 of 0 elements lost is a share of 0, not an error.

  The worst leaf is the one losing most, not the last name; the table's last column is the
  scaled backward's, and its first column is as wide as the longest name.
  """
  params = {"w": jnp.ones(2), "unused": jnp.ones(3), "zero_size": jnp.ones((0, 2))}
  r = jls.diagnostics.check_underflow(_elementwise_loss, params, jnp.array([1e-9, 1e-3]))
  assert {k: int(v) for k, v in r.nonzero.items()} == {"unused": 0, "w": 2, "zero_size": 0}
  assert r.fractions() == {"unused": 0.0, "w": 0.5, "zero_size": 0.0}
  assert r.fractions(scaled=True) == {"unused": 0.0, "w": 0.0, "zero_size": 0.0}
  assert r.verdict() == (
    "NEEDS loss scaling: float16 without loss scaling flushes 50.00% of the non-zero "
    "parameter-gradient elements (3 leaves; worst w: 50.00%); 0.00% at scale 2^16 "
    "(parameter gradients only: pass activations= taps to check activations)."
  )
  assert r.table().splitlines() == [
    "leaf          nonzero  lost, scale 1  lost, scaled",
    "unused              0         0.000%        0.000%",
    "w                   2        50.000%        0.000%",
    "zero_size           0         0.000%        0.000%",
  ]


def test_a_none_param_is_left_out():
  # An absent optional bias (None) is no leaf: w is checked as without it.
  params = {"w": jnp.ones(2), "b": None}
  r = jls.diagnostics.check_underflow(_elementwise_loss, params, jnp.array([1e-9, 1e-3]))
  assert {k: int(v) for k, v in r.nonzero.items()} == {"w": 2}
  assert r.fractions() == {"w": 0.5} and r.fractions(scaled=True) == {"w": 0.0}


class _Scaled(NamedTuple):
  w: jax.Array
  act: object  # a function: a non-array leaf


def test_params_holding_a_function_are_checked_through_their_arrays():
  # An Equinox-style module: its function is held static, its arrays differentiated.
  params = _Scaled(jnp.ones(2), jax.nn.relu)
  loss = lambda p, c, dtype: jnp.sum(p.act(p.w.astype(dtype)).astype(jnp.float32) * c)
  r = jls.diagnostics.check_underflow(loss, params, jnp.array([1e-9, 1e-3]))
  assert {k: int(v) for k, v in r.nonzero.items()} == {"w": 2}
  assert r.fractions() == {"w": 0.5} and r.fractions(scaled=True) == {"w": 0.0}


def test_params_holding_a_function_and_a_none_are_checked():
  # eqx.nn.MLP(..., use_bias=False): functions (the activations) and None (the biases).
  params = {"s": _Scaled(jnp.ones(2), jax.nn.relu), "b": None}
  loss = lambda p, c, dtype: jnp.sum(p["s"].act(p["s"].w.astype(dtype)).astype(jnp.float32) * c)
  r = jls.diagnostics.check_underflow(loss, params, jnp.array([1e-9, 1e-3]))
  assert r.fractions() == {"s/w": 0.5}


def test_a_model_without_float_params_is_reported_as_such():
  r = jls.diagnostics.check_underflow(lambda p, b, dtype: jnp.float32(0.0), {}, None)
  assert r.nonzero == {} and r.fractions() == {} and r.total() == 0.0
  assert not r.needs_loss_scaling()
  assert r.verdict() == (
    "does not need loss scaling here (threshold 1.00%): float16 without loss scaling flushes "
    "no gradient elements (no float leaves) (parameter gradients only: pass activations= "
    "taps to check activations)."
  )
  assert r.table() == "leaf     nonzero  lost, scale 1  lost, scaled"  # 'leaf' is the width


def test_each_group_is_judged_on_its_own_elements():
  """1 of 100 activation-gradient elements lost is 1% of the activations (needs scaling),
  though it is 0.5% of all 200 elements; the verdict with taps names both groups."""
  r = _report(
    {"w": 100, "activations/h": 100}, {"w": 0, "activations/h": 1}, {"w": 0, "activations/h": 0}
  )
  assert r.total() == 0.005
  assert r.needs_loss_scaling(0.01)
  assert r.verdict() == (
    "NEEDS loss scaling: float16 without loss scaling flushes 0.00% of the non-zero "
    "parameter-gradient elements (1 leaves; worst w: 0.00%); 0.00% at scale 2^16; and 1.00% of "
    "the non-zero activation-gradient elements (1 leaves; worst activations/h: 1.00%); 0.00% at "
    "scale 2^16."
  )


def test_a_group_that_scaling_does_not_help_does_not_need_it():
  """The params lose 5% with and without scaling: scaling saves nothing there, even though the
  activations' 0% brings the scaled share over all leaves down to 2.5%."""
  r = _report(
    {"w": 100, "activations/h": 100}, {"w": 5, "activations/h": 0}, {"w": 5, "activations/h": 0}
  )
  assert r.total(scaled=True) == 0.025
  assert not r.needs_loss_scaling(0.01)
  assert r.verdict().startswith("does not need loss scaling here (threshold 1.00%)")


def test_untapped_params_under_a_params_key_keep_their_full_names():
  """Only the taps' wrapping (``{"params": ..., "activations": ...}``) is taken off the names:
  Flax variables passed as they are keep the ``params/`` of grad_leaf_names."""

  def loss_fn(v, c, dtype):
    return _elementwise_loss(v["params"], c, dtype)

  variables = {"params": {"w": jnp.ones(2)}}
  r = jls.diagnostics.check_underflow(loss_fn, variables, jnp.array([1e-9, 1e-3]))
  assert list(r.nonzero) == jls.diagnostics.grad_leaf_names(variables) == ["params/w"]
  assert r.fractions() == {"params/w": 0.5}


def test_the_reference_casts_half_params_to_float32_and_keeps_the_rest_as_they_are():
  """A float16 param is float32 in the reference; a weak-typed float32 scalar stays weak."""
  seen = {}

  def loss_fn(p, c, dtype):
    seen[np.dtype(dtype).name] = {
      k: (jax.typeof(v).dtype, jax.typeof(v).weak_type) for k, v in p.items()
    }
    return jnp.sum(p["h"].astype(dtype).astype(jnp.float32) * c * p["s"])

  jls.diagnostics.check_underflow(loss_fn, {"h": jnp.ones(2, jnp.float16), "s": 2.0}, jnp.ones(2))
  assert seen == {
    "float32": {"h": (np.dtype("float32"), False), "s": (np.dtype("float32"), True)},
    "float16": {"h": (np.dtype("float16"), False), "s": (np.dtype("float32"), True)},
  }


def test_counts_are_int32_under_enable_x64():
  """As documented, and as without x64 (a bool sum would be int64 there)."""
  with jax.enable_x64(True):
    params = {"w": jnp.ones(2, jnp.float32)}
    r = jls.diagnostics.check_underflow(
      _elementwise_loss, params, jnp.array([1e-9, 1e-3], jnp.float32)
    )
    for field in (r.nonzero, r.lost_unscaled, r.lost_scaled):
      assert field["w"].dtype == jnp.int32
    assert (int(r.nonzero["w"]), int(r.lost_unscaled["w"]), int(r.lost_scaled["w"])) == (2, 1, 0)
