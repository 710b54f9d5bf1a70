"""autocast against torch, layer by layer, on CPU.

torch's CPU autocast list is not its CUDA list (on CPU, softmax and layer_norm run in
float16), so the CUDA policy is emulated on torch CPU with explicit ``.half()`` and
``.float()``, op by op, as ``aten/src/ATen/autocast_mode.cpp`` registers it for CUDA:
``lower_precision_fp`` ops cast their floating inputs to float16, ``fp32`` ops to float32,
``fp32_set_opt_dtype`` ops get ``dtype=torch.float32``, other ops take their inputs as
they come (and promote). Where the CPU and CUDA lists agree (``linear``, ``matmul``,
``conv2d``) the emulation is checked against ``torch.autocast("cpu")`` itself.

Tolerances: both sides round the same float32 values to float16 and compute each
float16 matmul with float32 accumulation, rounding the output once; they can differ by
the summation order, one float16 ulp (2**-10 relative) of an output, which the next
layers carry along. Measured on this block: at most one float16 ulp per layer output
(the worst, 3.9e-3 = 2**-8 on logits of magnitude 4.8; 1.8e-5 on the loss). The bound
used, 1e-2 absolute plus 1e-2 relative, is 2.5 such ulps.
"""

import math

from conftest import import_torch
from helpers import TORCH_CUDA_LAYER_DTYPES
from helpers import rand as _rand
from helpers import transformer_layers
from helpers import transformer_params
from helpers import transformer_tokens as _tokens
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_lossscale._autocast import autocast

torch = import_torch()
F = torch.nn.functional

_TORCH_TO_NP = {torch.float16: np.dtype(jnp.float16), torch.float32: np.dtype(jnp.float32)}


def _t(x):
  return torch.from_numpy(np.array(x))


def torch_cuda_policy_layers(p, tokens, labels):
  """The block of ``helpers.transformer_layers``, as CUDA autocast runs it."""
  T = {k: _t(v) for k, v in p.items()}
  d = T["ln1_g"].shape[0]
  out = {}
  tokens, labels = _t(tokens).long(), _t(labels).long()
  x = out["embedding"] = F.embedding(tokens, T["emb"])  # in no list
  h = out["ln1"] = F.layer_norm(x.float(), (d,), T["ln1_g"], T["ln1_b"], 1e-5)  # fp32
  qkv = out["qkv_linear"] = F.linear(h.half(), T["wqkv"].T.half(), T["bqkv"].half())
  q, k, v = qkv.split(d, dim=-1)
  s = out["scores_matmul"] = torch.matmul(q.half(), k.half().T) / math.sqrt(d)
  mask = torch.tril(torch.ones(s.shape, dtype=torch.bool))
  s = s.masked_fill(~mask, -1e4)
  a = out["softmax"] = torch.softmax(s, dim=-1, dtype=torch.float32)  # fp32_set_opt_dtype
  o = out["attn_matmul"] = torch.matmul(a.half(), v.half())
  o = out["out_linear"] = F.linear(o.half(), T["wo"].T.half(), T["bo"].half())
  x = out["residual1"] = x + o  # promotes
  h = out["ln2"] = F.layer_norm(x.float(), (d,), T["ln2_g"], T["ln2_b"], 1e-5)
  m = out["fc1_linear"] = F.linear(h.half(), T["w1"].T.half(), T["b1"].half())
  m = out["gelu"] = F.gelu(m)  # in no list: float16 in, float16 out
  m = out["fc2_linear"] = F.linear(m.half(), T["w2"].T.half(), T["b2"].half())
  x = out["residual2"] = x + m
  logits = out["logits_linear"] = F.linear(x.half(), T["wout"].T.half())
  out["cross_entropy"] = F.cross_entropy(logits.float(), labels)  # fp32: nll_loss
  return out


def test_transformer_block_matches_torch_cuda_policy_layer_by_layer():
  p = transformer_params()
  tokens, labels = _tokens()
  ours = jax.jit(autocast(transformer_layers))(p, tokens, labels)
  theirs = torch_cuda_policy_layers(p, tokens, labels)
  assert sorted(ours) == sorted(theirs)
  for name in ours:
    assert _TORCH_TO_NP[theirs[name].dtype] == TORCH_CUDA_LAYER_DTYPES[name], name
    assert np.dtype(ours[name].dtype) == TORCH_CUDA_LAYER_DTYPES[name], name
    a = np.asarray(ours[name].astype(jnp.float32))
    b = theirs[name].float().numpy()
    np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-2, err_msg=name)


def test_the_block_loss_and_gradients_are_close_to_torch():
  p = transformer_params(seed=3)
  tokens, labels = _tokens()

  def loss(p):
    return transformer_layers(p, tokens, labels)["cross_entropy"]

  value, grads = jax.jit(jax.value_and_grad(autocast(loss)))(p)
  T = {k: _t(v).requires_grad_(True) for k, v in p.items()}
  torch_loss = torch_cuda_policy_layers_from(T, tokens, labels)
  torch_loss.backward()
  np.testing.assert_allclose(float(value), float(torch_loss.detach()), rtol=2e-3)
  for k in p:
    assert grads[k].dtype == p[k].dtype
    ref = T[k].grad.numpy()
    np.testing.assert_allclose(grads[k], ref, rtol=0, atol=2e-2 * float(np.abs(ref).max()) + 1e-4)


def torch_cuda_policy_layers_from(T, tokens, labels):
  """The cross-entropy of the emulated block, from torch params (for backward)."""
  p = {k: v for k, v in T.items()}
  d = p["ln1_g"].shape[0]
  tokens, labels = _t(tokens).long(), _t(labels).long()
  x = F.embedding(tokens, p["emb"])
  h = F.layer_norm(x.float(), (d,), p["ln1_g"], p["ln1_b"], 1e-5)
  qkv = F.linear(h.half(), p["wqkv"].T.half(), p["bqkv"].half())
  q, k, v = qkv.split(d, dim=-1)
  s = torch.matmul(q, k.T) / math.sqrt(d)
  s = s.masked_fill(~torch.tril(torch.ones(s.shape, dtype=torch.bool)), -1e4)
  a = torch.softmax(s, dim=-1, dtype=torch.float32)
  o = F.linear(torch.matmul(a.half(), v), p["wo"].T.half(), p["bo"].half())
  x = x + o
  h = F.layer_norm(x.float(), (d,), p["ln2_g"], p["ln2_b"], 1e-5)
  m = F.gelu(F.linear(h.half(), p["w1"].T.half(), p["b1"].half()))
  x = x + F.linear(m, p["w2"].T.half(), p["b2"].half())
  return F.cross_entropy(F.linear(x.half(), p["wout"].T.half()).float(), labels)


def test_emulated_linear_matmul_and_conv_equal_torch_cpu_autocast():
  # The lists agree on CPU for these ops: the emulation is torch's own autocast.
  x, w, b = _t(_rand(0, (4, 8))), _t(_rand(1, (8, 5))), _t(_rand(2, (5,)))
  img, k, kb = _t(_rand(3, (1, 3, 6, 6))), _t(_rand(4, (4, 3, 3, 3))), _t(_rand(5, (4,)))
  with torch.autocast("cpu", dtype=torch.float16):
    lin, mm, conv = F.linear(x, w.T, b), torch.matmul(x, w), F.conv2d(img, k, kb)
  assert lin.dtype == mm.dtype == conv.dtype == torch.float16
  torch.testing.assert_close(lin, F.linear(x.half(), w.T.half(), b.half()), rtol=0, atol=0)
  torch.testing.assert_close(mm, torch.matmul(x.half(), w.half()), rtol=0, atol=0)
  torch.testing.assert_close(conv, F.conv2d(img.half(), k.half(), kb.half()), rtol=0, atol=0)


@pytest.mark.parametrize("layer", ["dense", "conv"])
def test_flax_dense_and_conv_match_torch_linear_and_conv2d(layer):
  nn = pytest.importorskip("flax.linen")
  if layer == "dense":
    module, x = nn.Dense(5), _rand(0, (4, 8))
  else:
    module, x = nn.Conv(4, (3, 3), padding="VALID"), _rand(0, (1, 6, 6, 3))
  params = module.init(jax.random.key(1), x)
  ours = autocast(module.apply)(params, x)
  kernel, bias = _t(params["params"]["kernel"]), _t(params["params"]["bias"])
  with torch.autocast("cpu", dtype=torch.float16):
    if layer == "dense":
      theirs = F.linear(_t(x), kernel.T, bias)
    else:  # NHWC / HWIO in Flax, NCHW / OIHW in torch
      theirs = F.conv2d(_t(x).permute(0, 3, 1, 2), kernel.permute(3, 2, 0, 1), bias)
      theirs = theirs.permute(0, 2, 3, 1)
  assert ours.dtype == jnp.float16 and theirs.dtype == torch.float16
  np.testing.assert_allclose(
    np.asarray(ours, np.float32), theirs.float().numpy(), rtol=2e-3, atol=2e-3
  )


def torch_plain_layers(T, tokens, labels):
  """The same block written for float32, with no casts: for ``torch.autocast("cuda")``."""
  d = T["ln1_g"].shape[0]
  out = {}
  x = out["embedding"] = F.embedding(tokens, T["emb"])
  h = out["ln1"] = F.layer_norm(x, (d,), T["ln1_g"], T["ln1_b"], 1e-5)
  qkv = out["qkv_linear"] = F.linear(h, T["wqkv"].T, T["bqkv"])
  q, k, v = qkv.split(d, dim=-1)
  s = out["scores_matmul"] = torch.matmul(q, k.T) / math.sqrt(d)
  s = s.masked_fill(~torch.tril(torch.ones(s.shape, dtype=torch.bool, device=s.device)), -1e4)
  a = out["softmax"] = torch.softmax(s, dim=-1)
  o = out["attn_matmul"] = torch.matmul(a, v)
  o = out["out_linear"] = F.linear(o, T["wo"].T, T["bo"])
  x = out["residual1"] = x + o
  h = out["ln2"] = F.layer_norm(x, (d,), T["ln2_g"], T["ln2_b"], 1e-5)
  m = out["fc1_linear"] = F.linear(h, T["w1"].T, T["b1"])
  m = out["gelu"] = F.gelu(m)
  m = out["fc2_linear"] = F.linear(m, T["w2"].T, T["b2"])
  x = out["residual2"] = x + m
  logits = out["logits_linear"] = F.linear(x, T["wout"].T)
  out["cross_entropy"] = F.cross_entropy(logits, labels)
  return out


@pytest.mark.gpu
def test_transformer_block_matches_torch_cuda_autocast_layer_by_layer():
  """On a CUDA machine (``make gpu-check``): the real ``torch.autocast("cuda")``, not the
  emulation, gives every layer the dtype of the transcribed table, and autocast's values
  agree within the tolerance above. cuBLAS's reduced-precision float16 reduction is turned
  off so that both sides accumulate in float32."""
  if not torch.cuda.is_available():
    pytest.skip("torch has no CUDA device")
  p = transformer_params()
  tokens, labels = _tokens()
  ours = jax.jit(autocast(transformer_layers))(p, tokens, labels)
  T = {k: _t(v).cuda() for k, v in p.items()}
  saved = torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction
  torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
  try:
    with torch.autocast("cuda", dtype=torch.float16):
      theirs = torch_plain_layers(T, _t(tokens).long().cuda(), _t(labels).long().cuda())
  finally:
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = saved
  assert sorted(ours) == sorted(theirs)
  for name in ours:
    assert _TORCH_TO_NP[theirs[name].dtype] == TORCH_CUDA_LAYER_DTYPES[name], name
    assert np.dtype(ours[name].dtype) == TORCH_CUDA_LAYER_DTYPES[name], name
    a = np.asarray(ours[name].astype(jnp.float32))
    b = theirs[name].float().cpu().numpy()
    np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-2, err_msg=name)


def test_the_plain_torch_block_is_the_jax_block_in_float32():
  # The reference of the CUDA test above, checked where it can be: without autocast,
  # on CPU, it computes what transformer_layers computes in float32.
  p = transformer_params()
  tokens, labels = _tokens()
  ours = jax.jit(transformer_layers)(p, tokens, labels)
  T = {k: _t(v) for k, v in p.items()}
  theirs = torch_plain_layers(T, _t(tokens).long(), _t(labels).long())
  assert sorted(ours) == sorted(theirs)
  for name in ours:
    assert theirs[name].dtype == torch.float32, name
    np.testing.assert_allclose(
      np.asarray(ours[name]), theirs[name].numpy(), rtol=1e-4, atol=1e-5, err_msg=name
    )
