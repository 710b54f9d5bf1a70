"""The benchmark models: float16 compute, float32 params, batch ``BATCH``.

Each model is a :class:`Model`: a params initialiser, a batch maker and a
loss ``loss_fn(params, x, y) -> float32 scalar``. Two families:

* MLPs (``mlp-*``, ``deep-*``): tanh layers, one ``(w, b)`` pair per layer;
  the leaf count (6 or 200 or 800) is what stresses compile time.
* ``transformer``: a decoder-only character LM (2 layers, d_model 64,
  4 heads, context 64): float16 matmuls, float32 layernorm statistics,
  softmax and cross-entropy, float32 residual stream.
* ``gpt``: the GPT-2-style decoder of ``bench_gpt.py`` scaled down (4
  layers, d_model 256, sequence 128, vocab 2048, batch 8), layers under
  ``lax.scan``, AdamW: the forward and backward carry the step's weight, as
  in real training.
"""

from __future__ import annotations

from typing import Any
from typing import Callable
from typing import NamedTuple

import bench_gpt
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
  """Statistics in float32, output in float16 for the next matmul."""
  h = h.astype(jnp.float32)
  mean = h.mean(-1, keepdims=True)
  var = jnp.square(h - mean).mean(-1, keepdims=True)
  out = (h - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]
  return out.astype(dtype)


def _matmul(h, w, dtype=COMPUTE):
  return h @ w.astype(dtype)


def lm_plain_loss_fn(params, x, y):
  """The LM written for float32 (every cast a no-op), for the autocast variant."""
  return lm_loss_fn(params, x, y, dtype=jnp.float32)


def lm_loss_fn(params, x, y, heads: int = LM["heads"], dtype=COMPUTE):
  """Mean next-token cross-entropy (float32) of the decoder-only LM (matmuls in ``dtype``)."""
  t = x.shape[1]
  h = params["embed"][x] + params["pos"][:t]  # float32 residual stream
  mask = jnp.tril(jnp.ones((t, t), bool))
  blocks = sorted(k for k in params if k.startswith("block_"))
  for name in blocks:
    p = params[name]
    b, _, d = h.shape
    qkv = _matmul(_layernorm(h, p["ln1"], dtype), p["qkv"], dtype)  # float16
    q, k, v = jnp.split(qkv.reshape(b, t, 3, heads, d // heads), 3, axis=2)
    q, k, v = (a[:, :, 0].transpose(0, 2, 1, 3) for a in (q, k, v))  # b h t dh
    logits = (q @ k.transpose(0, 1, 3, 2)).astype(jnp.float32) / np.float32(np.sqrt(d // heads))
    logits = jnp.where(mask, logits, np.float32(-1e9))
    attn = jax.nn.softmax(logits, axis=-1).astype(dtype)  # float32 softmax
    out = (attn @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
    h = h + _matmul(out, p["proj"], dtype).astype(jnp.float32)
    m = _matmul(_layernorm(h, p["ln2"], dtype), p["fc1"], dtype) + p["fc1_b"].astype(dtype)
    m = jax.nn.gelu(m)
    h = h + (_matmul(m, p["fc2"], dtype) + p["fc2_b"].astype(dtype)).astype(jnp.float32)
  logits = _matmul(_layernorm(h, params["ln_f"], dtype), params["head"], dtype).astype(jnp.float32)
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
    make_tx=lambda: optax.adamw(1e-4, weight_decay=0.1),
    plain_loss_fn=lambda p, x, y: bench_gpt.loss_fn(p, x, y, cfg, jnp.float32),
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
    # Not in the default set: more leaves, for compile-time scaling.
    mlp("deep400-1m", "400 layers ~1M params, 800 leaves", [50] * 401),
  ]
}
DEFAULT_MODELS = ["mlp-1m", "deep-1m", "mlp-30m", "deep-30m", "transformer", "gpt"]
QUICK_MODELS = ["mlp-1m", "deep-1m", "transformer"]
