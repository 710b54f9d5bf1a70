"""Autocast's ``jax.nn.dot_product_attention``: its kernel chosen by the platform it is lowered for.

A step traced on this CPU machine and lowered for CUDA (``jax.export`` with
``platforms=["cuda"]``; no GPU or CUDA plugin needed) must get cuDNN's fused attention, as on a
GPU; lowered for the CPU, the XLA implementation in float32. ``implementation=None`` falls
back to the XLA implementation where cuDNN cannot take the inputs, as JAX's does, and logs
why; an explicit ``implementation="cudnn"`` that cannot be met raises, as JAX's does, and an
explicit ``implementation="xla"`` is XLA's there too. The keyword arguments reach the kernel
of each platform (``jit`` traces every branch), and what autocast does not cast (a float64
bias) reaches JAX's attention as it is.
"""

import contextlib
import logging
import re

import jax
from jax._src.cudnn import fused_attention_stablehlo
import jax.numpy as jnp
import numpy as np
import pytest

import jax_lossscale as jls

CUDNN = "__cudnn$fmha"


@contextlib.contextmanager
def cudnn_version(version=91000):
  """JAX's trace-time cuDNN version check answered (this machine has no cuDNN)."""
  saved = fused_attention_stablehlo.check_cudnn_version
  fused_attention_stablehlo.check_cudnn_version = lambda: version
  try:
    yield
  finally:
    fused_attention_stablehlo.check_cudnn_version = saved


def _qkv(head_dim=64):
  rng = np.random.default_rng(0)
  return [jnp.asarray(rng.normal(size=(2, 128, 4, head_dim)), jnp.float32) for _ in range(3)]


def _model(**kwargs):
  def f(q, k, v):
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True, **kwargs)
    return jnp.sum(out.astype(jnp.float32))

  return f


def _lowered(fun, args, platform):
  """The StableHLO text of ``jit(fun)`` lowered for ``platform``, with its gradient."""
  step = jax.jit(jax.value_and_grad(fun, argnums=(0, 1, 2)))
  return step.trace(*args).lower(lowering_platforms=(platform,)).as_text()


def test_lowered_for_cuda_gets_cudnn_fused_attention_from_a_cpu_host():
  assert jax.default_backend() == "cpu"
  with cudnn_version():
    text = _lowered(jls.autocast(_model(), jnp.float16), _qkv(), "cuda")
  # The forward and the backward kernel, on float16 inputs.
  assert f'"{CUDNN}Softmax"' in text or f"{CUDNN}" in text
  assert text.count(CUDNN) >= 2
  assert "Backward" in text
  assert "xf16>" in text


def test_lowered_for_the_cpu_gets_the_float32_xla_attention():
  with cudnn_version():
    text = _lowered(jls.autocast(_model(), jnp.float16), _qkv(), "cpu")
  assert CUDNN not in text
  # XLA:CPU's attention computes in float32 (its einsums' operands are float32).
  assert "stablehlo.dot_general" in text


def test_lowered_for_cuda_falls_back_to_xla_and_logs_why(caplog):
  caplog.set_level(logging.INFO, logger="jax_lossscale.autocast")
  with cudnn_version():  # a head dim of 12 is no multiple of 8: cuDNN cannot take it
    text = _lowered(jls.autocast(_model(), jnp.float16), _qkv(head_dim=12), "cuda")
  assert CUDNN not in text
  records = [r for r in caplog.records if r.name == "jax_lossscale.autocast"]
  assert len(records) >= 1
  message = records[0].getMessage()
  assert records[0].levelno == logging.INFO
  assert "XLA implementation" in message and "NotImplementedError" in message
  assert "head dim" in message and "float16[2, 128, 4, 12]" in message


def test_no_cudnn_is_a_logged_reason_too(caplog):
  caplog.set_level(logging.INFO, logger="jax_lossscale.autocast")
  text = _lowered(jls.autocast(_model(), jnp.float16), _qkv(), "cuda")
  assert CUDNN not in text
  records = [r for r in caplog.records if r.name == "jax_lossscale.autocast"]
  assert records  # one each time the CUDA branch is traced (the forward, its derivative)
  assert all("RuntimeError" in r.getMessage() and "cuDNN" in r.getMessage() for r in records)


def test_explicit_cudnn_that_cannot_be_met_raises_as_jax():
  q, k, v = _qkv()
  half = [a.astype(jnp.float16) for a in (q, k, v)]
  with pytest.raises(RuntimeError) as jax_error:  # no cuDNN on this machine
    jax.jit(_model(implementation="cudnn")).lower(*half)
  with pytest.raises(RuntimeError) as ours:
    jax.jit(jls.autocast(_model(implementation="cudnn"), jnp.float16)).lower(q, k, v)
  assert str(ours.value) == str(jax_error.value)
  q, k, v = _qkv(head_dim=12)
  half = [a.astype(jnp.float16) for a in (q, k, v)]
  with cudnn_version():
    with pytest.raises(NotImplementedError) as jax_error:
      jax.jit(_model(implementation="cudnn")).lower(*half)
    with pytest.raises(NotImplementedError) as ours:
      jax.jit(jls.autocast(_model(implementation="cudnn"), jnp.float16)).lower(q, k, v)
  assert str(ours.value) == str(jax_error.value)


def test_cpu_values_unchanged(maybe_jit):
  """On the CPU the routed op computes what it did: float32 XLA attention, in float16."""
  q, k, v = _qkv()
  f = maybe_jit(
    jls.autocast(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True), jnp.float16)
  )
  out = f(q, k, v)
  assert out.dtype == jnp.float16
  half = [a.astype(jnp.float16).astype(jnp.float32) for a in (q, k, v)]
  with jax.numpy_dtype_promotion("standard"):
    expected = jax.nn.dot_product_attention(*half, is_causal=True).astype(jnp.float16)
  # One float16 rounding apart at most (the fused softmax's order of operations).
  np.testing.assert_allclose(
    np.asarray(out, np.float32), np.asarray(expected, np.float32), rtol=2**-10, atol=2**-24
  )


def test_its_keyword_arguments_reach_jaxs_attention_in_every_dtype():
  # is_causal (any keyword JAX's attention takes) is passed on by the registration, on the
  # half path (the CPU's float32 kernel) and on the path of float32 inputs alike.
  q, k, v = _qkv()
  with jax.numpy_dtype_promotion("standard"):
    causal = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    full = jax.nn.dot_product_attention(q, k, v)
  assert float(jnp.max(jnp.abs(causal - full))) > 0.1  # the argument changes the result
  for dtype, tol in ((jnp.float32, 1e-6), (jnp.float16, 2e-2)):
    f = jls.autocast(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True), dtype)
    out = np.asarray(f(q, k, v), np.float32)
    np.testing.assert_allclose(out, np.asarray(causal), rtol=tol, atol=tol, err_msg=str(dtype))


def _cudnn_configs(text):
  """The backend configs of the cuDNN attention calls in a lowered module's text."""
  return re.findall(rf'custom_call @{re.escape(CUDNN)}\w*\(.*?backend_config = "(.*?)"', text)


def test_lowered_for_cuda_cudnn_gets_the_keyword_arguments():
  # is_causal and scale reach cuDNN's kernel: its call is the one JAX's own cuDNN attention
  # makes on the float16 inputs (a causal mask, the scale given).
  def attention(**implementation):
    return lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=True, scale=0.25, **implementation
    )

  q, k, v = _qkv()
  half = [a.astype(jnp.float16) for a in (q, k, v)]
  with cudnn_version():
    ours = jax.jit(jls.autocast(attention(), jnp.float16)).trace(q, k, v)
    theirs = jax.jit(attention(implementation="cudnn")).trace(*half)
    ours, theirs = (s.lower(lowering_platforms=("cuda",)).as_text() for s in (ours, theirs))
  (config,) = _cudnn_configs(theirs)
  assert r"\22mask_type\22: \22CAUSAL\22" in config and r"\22fmha_scale\22: 0.25" in config
  assert _cudnn_configs(ours) == [config]


def test_an_explicit_xla_implementation_lowered_for_cuda_is_not_cudnn():
  with cudnn_version():  # cuDNN would take these inputs
    text = _lowered(jls.autocast(_model(implementation="xla"), jnp.float16), _qkv(), "cuda")
  assert CUDNN not in text
  assert "stablehlo.dot_general" in text


@pytest.mark.parametrize("implementation", [None, "xla"])
def test_return_residual_gives_jaxs_pair_in_the_half_dtype(maybe_jit, implementation):
  # return_residual (a keyword that changes what the attention returns) reaches JAX's
  # attention on every platform's branch: jit traces them all.
  def f(q, k, v):
    return jax.nn.dot_product_attention(
      q, k, v, is_causal=True, return_residual=True, implementation=implementation
    )

  q, k, v = _qkv(head_dim=8)
  out, residual = maybe_jit(jls.autocast(f, jnp.float16))(q, k, v)
  assert (out.dtype, residual.dtype) == (jnp.float16, jnp.float16)
  assert (out.shape, residual.shape) == (q.shape, q.shape[:-1])
  half = [a.astype(jnp.float16).astype(jnp.float32) for a in (q, k, v)]
  with jax.numpy_dtype_promotion("standard"):
    expected = jax.nn.dot_product_attention(*half, is_causal=True, return_residual=True)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(expected[0].astype(jnp.float16)))
  np.testing.assert_array_equal(np.asarray(residual), np.asarray(expected[1].astype(jnp.float16)))


def test_a_float64_bias_reaches_jaxs_attention_uncast(maybe_jit):
  # Autocast never casts float64 (as torch): with x64 on, a float64 bias is added to the
  # float32 logits of the CPU's attention in float64. Here that sum rounds up to the next
  # float32 (2**24 + 1 + 2**-25 is past the tie), where the bias first rounded to float32
  # would tie to even: the logits then differ by 2.
  q = jnp.ones((1, 1, 1, 1), jnp.float32)
  k = jnp.ones((1, 2, 1, 1), jnp.float32)
  v = jnp.asarray([1.0, 0.0], jnp.float32).reshape(1, 2, 1, 1)
  attention = lambda q, k, v, b: jax.nn.dot_product_attention(q, k, v, b, scale=2.0**24)
  with jax.enable_x64(True):
    bias = jnp.asarray([1 + 2.0**-25, 0.0], jnp.float64).reshape(1, 1, 1, 2)
    out = maybe_jit(jls.autocast(attention, jnp.float16))(q, k, v, bias)
    with jax.numpy_dtype_promotion("standard"):
      expected = attention(q, k, v, bias)  # q, k and v are exact in float16
      rounded = attention(q, k, v, bias.astype(jnp.float32))
  assert out.dtype == jnp.float16
  assert float(rounded[0, 0, 0, 0]) == 0.5  # the test's premise: the float32 bias ties
  assert out[0, 0, 0, 0] == expected[0, 0, 0, 0].astype(jnp.float16) == jnp.float16(0.881)
