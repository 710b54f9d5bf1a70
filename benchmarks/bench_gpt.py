"""A GPT-2-style decoder in plain JAX (and the same architecture in PyTorch) for the benchmarks.

Pre-LayerNorm blocks (causal self-attention, GELU MLP), learned positions,
the output head tied to the token embedding, as GPT-2. Float32 params; the
matmuls run in the compute dtype; LayerNorm statistics, softmax and the
cross-entropy in float32; the residual stream stays float32, as under
``torch.autocast`` (a float32 embedding plus float16 block outputs is float32).

The layers' params are stacked on a leading axis and the blocks run under
``lax.scan``, so the compiled step holds one block, whatever the depth
(GPT-2 small compiles in seconds, not minutes).

* :data:`CPU_GPT`: 4 layers, d_model 256, sequence 128 (``make bench``).
* :data:`GPT2_SMALL`: 12 layers, d_model 768, 12 heads, sequence 1024, vocab
  50304 (GPT-2's 50257 padded to a multiple of 64), ~124M params
  (``make gpu-bench-large``).
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax


class GPTConfig(NamedTuple):
  vocab: int
  seq: int
  d_model: int
  heads: int
  layers: int
  batch: int
  mlp: int = 4


CPU_GPT = GPTConfig(vocab=2048, seq=128, d_model=256, heads=4, layers=4, batch=8)
GPT2_SMALL = GPTConfig(vocab=50304, seq=1024, d_model=768, heads=12, layers=12, batch=16)
TINY_GPT = GPTConfig(vocab=128, seq=16, d_model=32, heads=2, layers=2, batch=2)


def n_params(cfg: GPTConfig) -> int:
  d, f, L = cfg.d_model, cfg.mlp * cfg.d_model, cfg.layers
  block = 4 * d + d * 3 * d + 3 * d + d * d + d + d * f + f + f * d + d
  return cfg.vocab * d + cfg.seq * d + 2 * d + L * block


def init_params(cfg: GPTConfig, seed: int = 0) -> dict[str, Any]:
  """GPT-2's initialisation: N(0, 0.02), residual projections N(0, 0.02 / sqrt(2 L))."""
  rng = np.random.default_rng(seed)
  d, f, L = cfg.d_model, cfg.mlp * cfg.d_model, cfg.layers

  def normal(*shape, std=0.02):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * np.float32(std))

  proj_std = 0.02 / np.sqrt(2 * L)
  blocks = {
    "ln1_scale": jnp.ones((L, d), jnp.float32),
    "ln1_bias": jnp.zeros((L, d), jnp.float32),
    "qkv_w": normal(L, d, 3 * d),
    "qkv_b": jnp.zeros((L, 3 * d), jnp.float32),
    "proj_w": normal(L, d, d, std=proj_std),
    "proj_b": jnp.zeros((L, d), jnp.float32),
    "ln2_scale": jnp.ones((L, d), jnp.float32),
    "ln2_bias": jnp.zeros((L, d), jnp.float32),
    "fc1_w": normal(L, d, f),
    "fc1_b": jnp.zeros((L, f), jnp.float32),
    "fc2_w": normal(L, f, d, std=proj_std),
    "fc2_b": jnp.zeros((L, d), jnp.float32),
  }
  return {
    "embed": normal(cfg.vocab, d),
    "pos": normal(cfg.seq, d, std=0.01),
    "ln_f_scale": jnp.ones((d,), jnp.float32),
    "ln_f_bias": jnp.zeros((d,), jnp.float32),
    "blocks": blocks,
  }


def make_batch(cfg: GPTConfig, seed: int = 1) -> tuple[jax.Array, jax.Array]:
  """Random tokens ``(x, y)`` of shape ``(batch, seq)``: next-token targets."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, cfg.vocab, size=(cfg.batch, cfg.seq + 1))
  return jnp.asarray(tokens[:, :-1], jnp.int32), jnp.asarray(tokens[:, 1:], jnp.int32)


def layernorm(h, scale, bias, dtype):
  """Statistics in float32; the output in ``dtype`` for the next matmul (every benchmark
  model's LayerNorm: ``bench_models`` calls it too)."""
  h = h.astype(jnp.float32)
  mean = h.mean(-1, keepdims=True)
  var = jnp.square(h - mean).mean(-1, keepdims=True)
  return ((h - mean) * jax.lax.rsqrt(var + 1e-5) * scale + bias).astype(dtype)


@jax.custom_vjp
def _scores(q, k):
  """``q . k`` over the head dim, ``(b, h, q, k)``, accumulated and returned in float32.

  Its backward runs in the inputs' dtype with float32 accumulation, as torch's matmul backward
  under autocast (the float32 cotangent of the scores cast to float16 first): without it, JAX's
  transpose would run both backward dots on the float32 cotangent, in float32.
  """
  return jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)


def _scores_fwd(q, k):
  return _scores(q, k), (q, k)


def _scores_bwd(res, g):
  q, k = res
  g = g.astype(q.dtype)
  dq = jnp.einsum("bhqk,bkhd->bqhd", g, k, preferred_element_type=jnp.float32)
  dk = jnp.einsum("bhqk,bqhd->bkhd", g, q, preferred_element_type=jnp.float32)
  return dq.astype(q.dtype), dk.astype(k.dtype)


_scores.defvjp(_scores_fwd, _scores_bwd)


def _attention(q, k, v, implementation):
  """Causal attention of ``(batch, seq, heads, head_dim)`` arrays, softmax in float32.

  ``"xla"``: written out (einsum, mask, float32 softmax); anything else, ``None``
  included, is ``jax.nn.dot_product_attention(..., implementation=implementation)``: with
  ``None`` JAX picks the kernel, and under ``jls.autocast`` the registered op picks cuDNN's
  fused kernel on a GPU for half inputs.
  """
  if implementation == "xla":
    t, dh = q.shape[1], q.shape[-1]
    logits = _scores(q, k)
    logits = logits * np.float32(1 / np.sqrt(dh))
    mask = jnp.tril(jnp.ones((t, t), bool))
    logits = jnp.where(mask, logits, np.float32(-1e9))
    probs = jax.nn.softmax(logits, axis=-1).astype(q.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)
  return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)


def loss_fn(params, x, y, cfg: GPTConfig, dtype=jnp.float16, attention: str | None = "xla"):
  """Mean next-token cross-entropy (float32) with the matmuls in ``dtype``."""
  b, t = x.shape
  d, nh = cfg.d_model, cfg.heads
  embed = params["embed"]
  h = embed[x] + params["pos"][:t]  # float32 residual stream

  def block(h, p):
    a = layernorm(h, p["ln1_scale"], p["ln1_bias"], dtype)
    qkv = a @ p["qkv_w"].astype(dtype) + p["qkv_b"].astype(dtype)
    q, k, v = jnp.split(qkv.reshape(b, t, 3, nh, d // nh), 3, axis=2)
    out = _attention(q[:, :, 0], k[:, :, 0], v[:, :, 0], attention).reshape(b, t, d)
    h = h + (out @ p["proj_w"].astype(dtype) + p["proj_b"].astype(dtype)).astype(jnp.float32)
    m = layernorm(h, p["ln2_scale"], p["ln2_bias"], dtype)
    m = jax.nn.gelu(m @ p["fc1_w"].astype(dtype) + p["fc1_b"].astype(dtype), approximate=True)
    h = h + (m @ p["fc2_w"].astype(dtype) + p["fc2_b"].astype(dtype)).astype(jnp.float32)
    return h, None

  h, _ = jax.lax.scan(block, h, params["blocks"])
  h = layernorm(h, params["ln_f_scale"], params["ln_f_bias"], dtype)
  logits = (h @ embed.astype(dtype).T).astype(jnp.float32)  # the tied head
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


# ----------------------------------------------------------------------------- torch


def torch_model(cfg: GPTConfig, params: dict[str, Any], device: str):
  """The same architecture as a ``torch.nn.Module``, with the JAX params' values.

  ``forward(x)`` returns the logits; under ``torch.autocast(float16)`` the
  linear layers run in float16 and LayerNorm, softmax (inside
  ``scaled_dot_product_attention``) and the loss in float32, as above.
  """
  import torch
  from torch import nn
  import torch.nn.functional as F

  host = jax.tree_util.tree_map(np.asarray, params)
  tensor = lambda a: torch.tensor(np.ascontiguousarray(a), dtype=torch.float32)

  def linear(w, b):
    layer = nn.Linear(w.shape[0], w.shape[1])
    layer.weight.data.copy_(tensor(w.T))  # torch stores (out, in)
    layer.bias.data.copy_(tensor(b))
    return layer

  def norm(scale, bias):
    layer = nn.LayerNorm(scale.shape[0], eps=1e-5)
    layer.weight.data.copy_(tensor(scale))
    layer.bias.data.copy_(tensor(bias))
    return layer

  class Block(nn.Module):
    def __init__(self, i):
      super().__init__()
      p = {k: v[i] for k, v in host["blocks"].items()}
      self.ln1 = norm(p["ln1_scale"], p["ln1_bias"])
      self.qkv = linear(p["qkv_w"], p["qkv_b"])
      self.proj = linear(p["proj_w"], p["proj_b"])
      self.ln2 = norm(p["ln2_scale"], p["ln2_bias"])
      self.fc1 = linear(p["fc1_w"], p["fc1_b"])
      self.fc2 = linear(p["fc2_w"], p["fc2_b"])

    def forward(self, h):
      b, t, d = h.shape
      qkv = self.qkv(self.ln1(h)).view(b, t, 3, cfg.heads, d // cfg.heads)
      q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # b h t dh
      out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
      h = h + self.proj(out.transpose(1, 2).reshape(b, t, d))
      return h + self.fc2(F.gelu(self.fc1(self.ln2(h)), approximate="tanh"))

  class GPT(nn.Module):
    def __init__(self):
      super().__init__()
      self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
      self.embed.weight.data.copy_(tensor(host["embed"]))
      self.pos = nn.Parameter(tensor(host["pos"]))
      self.blocks = nn.ModuleList([Block(i) for i in range(cfg.layers)])
      self.ln_f = norm(host["ln_f_scale"], host["ln_f_bias"])

    def forward(self, x):
      h = self.embed(x) + self.pos[: x.shape[1]]
      for blk in self.blocks:
        h = blk(h)
      return F.linear(self.ln_f(h), self.embed.weight)  # the tied head

  return GPT().to(device)
