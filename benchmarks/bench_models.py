"""The benchmark models: float16 compute, float32 params, batch ``BATCH``.

Each model is a :class:`Model`: a params initialiser, a batch maker and a
loss ``loss_fn(params, x, y) -> float32 scalar``. Two families:

* MLPs (``mlp-*``, ``deep-*``): tanh layers, one ``(w, b)`` pair per layer;
  the leaf count (6 or 200 or 800) is what stresses compile time.
* ``transformer``: a decoder-only character LM (2 layers, d_model 64,
  4 heads, context 64): float16 matmuls, float32 layernorm statistics,
  softmax and cross-entropy, float32 residual stream; the attention scale and
  mask in float16 and the softmax's input cast up, as ``torch.autocast`` does.
* ``rope-gpt``: a rotary-embedding decoder (2 layers, d_model 128, sequence
  128, batch 8), causal mask ``jnp.where(mask, scores, -jnp.inf)``; its
  hand-cast form makes exactly ``torch.autocast(float16)``'s casts (see
  :func:`rope_loss_fn`).

The hand-cast ``loss_fn`` of the MLPs, the transformer and ``rope-gpt`` makes
the casts ``torch.autocast`` makes on their float32 model (``plain_loss_fn``),
so they are the references of the ``jls_autocast`` variant; the ``gpt``'s
attention keeps its scores in float32 from the matmul (as a fused attention
kernel accumulates), which torch's eager autocast does not.
* ``gpt``: the GPT-2-style decoder of ``bench_gpt.py`` scaled down (4
  layers, d_model 256, sequence 128, vocab 2048, batch 8), layers under
  ``lax.scan``, AdamW: the forward and backward carry the step's weight, as
  in real training.
"""

from __future__ import annotations

import math
from typing import Any
from typing import Callable
from typing import NamedTuple

import bench_gpt
import bench_variants
import jax
import jax.numpy as jnp
import numpy as np
import optax

BATCH = 32
COMPUTE = jnp.float16


class Model(NamedTuple):
  name: str
  label: str
  init_params: Callable[[int], Any]  # seed -> params (float32 pytree)
  make_batch: Callable[[int], tuple[jax.Array, jax.Array]]  # seed -> (x, y)
  loss_fn: Callable[[Any, jax.Array, jax.Array], jax.Array]  # float32 scalar
  config: dict[str, Any]  # what the JSON records about the model
  make_tx: Callable[[], Any] | None = None  # the optimizer (None: optax.adam)
  # The same model written for float32 (no casts), for the jls.autocast variant; None: none.
  plain_loss_fn: Callable[[Any, jax.Array, jax.Array], jax.Array] | None = None


# ----------------------------------------------------------------------------- MLP


def mlp_init_params(widths: list[int], seed: int = 0) -> dict[str, Any]:
  rng = np.random.default_rng(seed)
  params = {}
  for i, (d_in, d_out) in enumerate(zip(widths[:-1], widths[1:])):
    w = rng.standard_normal((d_in, d_out), dtype=np.float32) / np.float32(np.sqrt(d_in))
    params[f"layer_{i:03d}"] = {
      "w": jnp.asarray(w, jnp.float32),
      "b": jnp.zeros((d_out,), jnp.float32),
    }
  return params


def mlp_make_batch(widths: list[int], seed: int = 1) -> tuple[jax.Array, jax.Array]:
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((BATCH, widths[0]), dtype=np.float32), COMPUTE)
  y = jnp.asarray(rng.integers(0, widths[-1], size=(BATCH,)), jnp.int32)
  return x, y


def mlp_loss_fn(params, x, y, dtype=COMPUTE):
  """Cross-entropy of a tanh MLP computed in float16 (float32 loss); ``dtype=float32``: the
  float32 model the autocast variant runs."""
  h = x.astype(dtype)
  names = sorted(params)
  for i, name in enumerate(names):
    layer = params[name]
    h = h @ layer["w"].astype(dtype) + layer["b"].astype(dtype)
    if i + 1 < len(names):
      h = jnp.tanh(h)
  logits = h.astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def mlp(name: str, label: str, widths: list[int]) -> Model:
  return Model(
    name=name,
    label=label,
    init_params=lambda seed=0: mlp_init_params(widths, seed),
    make_batch=lambda seed=1: mlp_make_batch(widths, seed),
    loss_fn=mlp_loss_fn,
    config={"widths": widths},
    plain_loss_fn=mlp_plain_loss_fn,
  )


def mlp_plain_loss_fn(params, x, y):
  return mlp_loss_fn(params, x, y, jnp.float32)


# ----------------------------------------------------------------------------- transformer

LM = {"vocab": 128, "context": 64, "d_model": 64, "heads": 4, "layers": 2, "mlp": 4}


def lm_init_params(seed: int = 0, **cfg) -> dict[str, Any]:
  c = {**LM, **cfg}
  d, v, t, f = c["d_model"], c["vocab"], c["context"], c["mlp"] * c["d_model"]
  rng = np.random.default_rng(seed)

  def dense(d_in, d_out):
    w = rng.standard_normal((d_in, d_out), dtype=np.float32) / np.float32(np.sqrt(d_in))
    return jnp.asarray(w, jnp.float32)

  def norm():
    return {"scale": jnp.ones((d,), jnp.float32), "bias": jnp.zeros((d,), jnp.float32)}

  params = {
    "embed": jnp.asarray(0.02 * rng.standard_normal((v, d), dtype=np.float32)),
    "pos": jnp.asarray(0.02 * rng.standard_normal((t, d), dtype=np.float32)),
    "ln_f": norm(),
    "head": dense(d, v),
  }
  for i in range(c["layers"]):
    params[f"block_{i}"] = {
      "ln1": norm(),
      "qkv": dense(d, 3 * d),
      "proj": dense(d, d),
      "ln2": norm(),
      "fc1": dense(d, f),
      "fc1_b": jnp.zeros((f,), jnp.float32),
      "fc2": dense(f, d),
      "fc2_b": jnp.zeros((d,), jnp.float32),
    }
  return params


def lm_make_batch(seed: int = 1, **cfg) -> tuple[jax.Array, jax.Array]:
  """Random printable-ASCII sequences: next-character prediction targets."""
  c = {**LM, **cfg}
  rng = np.random.default_rng(seed)
  tokens = rng.integers(32, 127, size=(BATCH, c["context"] + 1))
  return jnp.asarray(tokens[:, :-1], jnp.int32), jnp.asarray(tokens[:, 1:], jnp.int32)


def _layernorm(h, p, dtype=COMPUTE):
  """``bench_gpt.layernorm`` of a ``{"scale", "bias"}`` dict: statistics in float32, output
  in ``dtype`` for the next matmul."""
  return bench_gpt.layernorm(h, p["scale"], p["bias"], dtype)


def _matmul(h, w, dtype=COMPUTE):
  return h @ w.astype(dtype)


def lm_plain_loss_fn(params, x, y):
  """The LM written for float32 (every cast a no-op), for the autocast variant."""
  return lm_loss_fn(params, x, y, dtype=jnp.float32)


def _unmarked(h, name):
  return h


def lm_loss_fn(params, x, y, heads: int = LM["heads"], dtype=COMPUTE, mark=_unmarked):
  """Mean next-token cross-entropy (float32) of the decoder-only LM (matmuls in ``dtype``).

  ``mark(h, name)`` (the identity by default) sees the residual stream after the embedding
  (``"embed"``) and after each block (its name), and the logits (``"logits"``): where
  ``benchmarks/bench_layer_scales.py`` puts its layer boundaries and activation taps.
  """
  t = x.shape[1]
  h = mark(params["embed"][x] + params["pos"][:t], "embed")  # float32 residual stream
  mask = jnp.tril(jnp.ones((t, t), bool))
  blocks = sorted(k for k in params if k.startswith("block_"))
  for name in blocks:
    p = params[name]
    b, _, d = h.shape
    qkv = _matmul(_layernorm(h, p["ln1"], dtype), p["qkv"], dtype)  # float16
    q, k, v = jnp.split(qkv.reshape(b, t, 3, heads, d // heads), 3, axis=2)
    q, k, v = (a[:, :, 0].transpose(0, 2, 1, 3) for a in (q, k, v))  # b h t dh
    # As torch.autocast: the scale (a 0-d float32 array does not promote) and the mask in
    # float16, the softmax in float32 (torch's fp32 list casts its input up).
    scale = jnp.asarray(np.sqrt(d // heads), dtype)
    fill = jnp.asarray(-1e9 if dtype == jnp.float32 else -np.inf, dtype)  # -1e9 is -inf in f16
    logits = (q @ k.transpose(0, 1, 3, 2)) / scale
    logits = jnp.where(mask, logits, fill)
    attn = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(dtype)
    out = (attn @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
    h = h + _matmul(out, p["proj"], dtype).astype(jnp.float32)
    m = _matmul(_layernorm(h, p["ln2"], dtype), p["fc1"], dtype) + p["fc1_b"].astype(dtype)
    m = jax.nn.gelu(m)
    h = h + (_matmul(m, p["fc2"], dtype) + p["fc2_b"].astype(dtype)).astype(jnp.float32)
    h = mark(h, name)
  logits = mark(_matmul(_layernorm(h, params["ln_f"], dtype), params["head"], dtype), "logits")
  logits = logits.astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def transformer(name: str, label: str) -> Model:
  return Model(
    name=name,
    label=label,
    init_params=lambda seed=0: lm_init_params(seed),
    make_batch=lambda seed=1: lm_make_batch(seed),
    loss_fn=lm_loss_fn,
    config={"transformer": dict(LM), "batch": BATCH},
    plain_loss_fn=lm_plain_loss_fn,
  )


# ----------------------------------------------------------------------------- GPT


def gpt(name: str, label: str, cfg: bench_gpt.GPTConfig) -> Model:
  """The GPT-2-style decoder of ``bench_gpt`` (float16 compute, AdamW), at its own batch."""
  return Model(
    name=name,
    label=label,
    init_params=lambda seed=0: bench_gpt.init_params(cfg, seed),
    make_batch=lambda seed=1: bench_gpt.make_batch(cfg, seed),
    loss_fn=lambda p, x, y: bench_gpt.loss_fn(p, x, y, cfg, COMPUTE),
    config={"gpt": cfg._asdict(), "batch": cfg.batch, "optimizer": "adamw"},
    make_tx=bench_variants.adamw,
    plain_loss_fn=lambda p, x, y: bench_gpt.loss_fn(p, x, y, cfg, jnp.float32),
  )


# ----------------------------------------------------------------------------- rotary GPT

ROPE = {"vocab": 512, "seq": 128, "d_model": 128, "heads": 4, "layers": 2, "mlp": 4, "batch": 8}


def rope_init_params(seed: int = 0, **cfg) -> dict[str, Any]:
  """Pre-LayerNorm decoder with rotary positions (no position table), no biases, untied head."""
  c = {**ROPE, **cfg}
  d, v, f = c["d_model"], c["vocab"], c["mlp"] * c["d_model"]
  rng = np.random.default_rng(seed)

  def normal(*shape, std=0.02):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * np.float32(std))

  def norm():
    return {"scale": jnp.ones((d,), jnp.float32), "bias": jnp.zeros((d,), jnp.float32)}

  params = {"embed": normal(v, d), "ln_f": norm(), "head": normal(d, v)}
  for i in range(c["layers"]):
    params[f"block_{i}"] = {
      "ln1": norm(),
      "qkv": normal(d, 3 * d),
      "proj": normal(d, d),
      "ln2": norm(),
      "fc1": normal(d, f),
      "fc2": normal(f, d),
    }
  return params


def rope_make_batch(seed: int = 1, **cfg) -> tuple[jax.Array, jax.Array]:
  c = {**ROPE, **cfg}
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, c["vocab"], size=(c["batch"], c["seq"] + 1))
  return jnp.asarray(tokens[:, :-1], jnp.int32), jnp.asarray(tokens[:, 1:], jnp.int32)


def rope_tables(t: int, head_dim: int, base: float = 10000.0):
  """cos and sin of ``positions x inverse frequencies`` (float32, as torch's rotary modules
  compute them: ``inv_freq = 1 / base ** (arange(0, dh, 2) / dh)``, ``outer(arange(t),
  inv_freq)``, the angles repeated for both halves)."""
  inv_freq = 1.0 / (base ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  positions = jnp.arange(t, dtype=jnp.float32)
  angles = positions[:, None] * inv_freq[None, :]  # torch.outer: a product, not a matmul
  angles = jnp.concatenate([angles, angles], axis=-1)
  return jnp.cos(angles), jnp.sin(angles)


def _rotate_half(x):
  x1, x2 = jnp.split(x, 2, axis=-1)
  return jnp.concatenate([-x2, x1], axis=-1)


def _rope(x, cos, sin, up):
  """``x * cos + rotate_half(x) * sin``; ``up``: the float32 casts torch's promotion makes
  (a float16 ``x`` times the float32 table), after ``rotate_half``, which keeps the dtype."""
  return up(x) * cos + up(_rotate_half(x)) * sin


def rope_loss_fn(params, x, y, dtype=COMPUTE, heads: int = ROPE["heads"]):
  """Mean next-token cross-entropy of the rotary GPT; ``dtype=float32``: the float32 model.

  With ``dtype=float16`` the casts are exactly those of ``torch.autocast(float16)`` on the
  same model written in torch (nanoGPT's attention, LLaMA's rotary embedding): matmuls in
  float16; LayerNorm, the rotary tables and the residual stream in float32; the rotary
  products ``q * cos`` in float32 (a float16 tensor times a float32 one promotes), cast
  to float16 by the score matmul; the scale ``* (1 / sqrt(dh))`` (a Python float) and the
  causal mask ``where(mask, scores, -inf)`` in float16; the softmax and the loss in
  float32 (torch's fp32 list casts their inputs up), the SiLU in float16.
  """
  half = dtype != jnp.float32
  b, t = x.shape
  d = params["embed"].shape[1]
  dh = d // heads
  cos, sin = rope_tables(t, dh)  # (t, dh) float32
  mask = jnp.tril(jnp.ones((t, t), bool))
  up = (lambda a: a.astype(jnp.float32)) if half else (lambda a: a)
  h = params["embed"][x]  # float32 residual stream
  for name in sorted(k for k in params if k.startswith("block_")):
    p = params[name]
    a = _layernorm(h, p["ln1"], dtype)
    qkv = (a @ p["qkv"].astype(dtype)).reshape(b, t, 3, heads, dh)
    q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))  # b h t dh
    q, k = _rope(q, cos, sin, up), _rope(k, cos, sin, up)  # float32, as torch promotes
    scores = q.astype(dtype) @ k.astype(dtype).transpose(0, 1, 3, 2)
    scores = scores * (1.0 / math.sqrt(dh))  # a Python float: float16 under torch
    scores = jnp.where(mask, scores, -jnp.inf)  # masked_fill(-inf): float16 under torch
    attn = jax.nn.softmax(up(scores), axis=-1)  # torch's softmax: float32
    out = (attn.astype(dtype) @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
    h = h + up(out @ p["proj"].astype(dtype))
    m = jax.nn.silu(_layernorm(h, p["ln2"], dtype) @ p["fc1"].astype(dtype))
    h = h + up(m @ p["fc2"].astype(dtype))
  logits = up(_layernorm(h, params["ln_f"], dtype) @ params["head"].astype(dtype))
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def rope_gpt(name: str, label: str, **cfg) -> Model:
  c = {**ROPE, **cfg}
  return Model(
    name=name,
    label=label,
    init_params=lambda seed=0: rope_init_params(seed, **c),
    make_batch=lambda seed=1: rope_make_batch(seed, **c),
    loss_fn=lambda p, x, y: rope_loss_fn(p, x, y, COMPUTE, c["heads"]),
    config={"rope_gpt": c, "batch": c["batch"]},
    plain_loss_fn=lambda p, x, y: rope_loss_fn(p, x, y, jnp.float32, c["heads"]),
  )


# ----------------------------------------------------------------------------- registry

MODELS: dict[str, Model] = {
  m.name: m
  for m in [
    mlp("mlp-1m", "MLP ~1M params, 6 leaves", [512, 1024, 512, 10]),
    mlp("deep-1m", "100 layers ~1M params, 200 leaves", [100] * 101),
    mlp("mlp-30m", "MLP ~30M params, 6 leaves", [2048, 4096, 4096, 1024]),
    mlp("deep-30m", "100 layers ~30M params, 200 leaves", [548] * 101),
    transformer("transformer", "char-LM transformer ~0.12M params, 2 layers, 25 leaves"),
    gpt(
      "gpt",
      "GPT decoder 3.7M params, 4 layers, d 256, seq 128, batch 8, AdamW, 16 leaves",
      bench_gpt.CPU_GPT,
    ),
    rope_gpt(
      "rope-gpt",
      "rotary GPT 0.53M params, 2 layers, d 128, seq 128, batch 8, where(mask, s, -inf)",
    ),
    # Not in the default set: more leaves, for compile-time scaling.
    mlp("deep400-1m", "400 layers ~1M params, 800 leaves", [50] * 401),
  ]
}
DEFAULT_MODELS = ["mlp-1m", "deep-1m", "mlp-30m", "deep-30m", "transformer", "gpt", "rope-gpt"]
QUICK_MODELS = ["mlp-1m", "deep-1m", "transformer", "rope-gpt"]
