"""``jax.nn.dot_product_attention`` under autocast: its kernel chosen for the lowering platform.

Autocast runs the attention in the lower dtype (torch's ``scaled_dot_product_attention``).
Which kernel it gets is decided by the platform the step is lowered for
(``jax.lax.platform_dependent``), not by the process's default backend at trace time: a step
traced on a CPU host and lowered for CUDA gets cuDNN's fused kernel, as on a GPU.

``implementation=None`` keeps JAX's semantics (a kernel is picked; nothing raises): lowered
for CUDA it is cuDNN's fused attention where cuDNN takes these inputs (as torch's SDPA picks
flash attention), else JAX's XLA implementation, and the reason is logged (logger
``jax_lossscale.autocast``, level INFO). Lowered for the CPU, the XLA implementation computes
in float32 and returns the half dtype (XLA:CPU compiles no float16 contraction with float32
accumulation). An explicit ``implementation="cudnn"`` that cannot be met raises, as JAX's.
"""

from __future__ import annotations

from collections.abc import Callable
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_lossscale._autocast._values import is_eligible

logger = logging.getLogger("jax_lossscale.autocast")

#: What JAX's cuDNN attention raises at trace time when it cannot take the call: shapes or
#: head dims it does not support (NotImplementedError), no cuDNN or a too-old one
#: (RuntimeError), inputs it rejects (ValueError).
CUDNN_UNAVAILABLE = (NotImplementedError, RuntimeError, ValueError)

_HALF = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))


def attention(
  original: Callable[..., Any],
  query: Any,
  key: Any,
  value: Any,
  bias: Any,
  mask: Any,
  implementation: str | None,
  kwargs: dict[str, Any],
) -> Any:
  """``original`` (JAX's attention) on half inputs, its kernel routed by the lowering platform."""
  half = np.dtype(query.dtype) in _HALF
  # JAX's own attention mixes dtypes internally (its float32 softmax), so it runs under
  # JAX's standard promotion whatever the caller's mode.
  with jax.numpy_dtype_promotion("standard"):
    if not half or implementation == "cudnn":
      return original(query, key, value, bias, mask, implementation=implementation, **kwargs)

    def xla(q: Any, k: Any, v: Any, b: Any, m: Any) -> Any:
      return original(q, k, v, b, m, implementation=implementation, **kwargs)

    def cpu(q: Any, k: Any, v: Any, b: Any, m: Any) -> Any:
      up = [
        None if a is None else a.astype(jnp.float32) if is_eligible(a.dtype) else a
        for a in (q, k, v, b)
      ]
      out = original(*up, m, implementation=implementation, **kwargs)
      return jax.tree.map(lambda o: o.astype(q.dtype), out)

    def cuda(q: Any, k: Any, v: Any, b: Any, m: Any) -> Any:
      try:
        out = original(q, k, v, b, m, implementation="cudnn", **kwargs)
      except CUDNN_UNAVAILABLE as e:
        logger.info(
          "autocast: dot_product_attention%s lowered for CUDA gets JAX's XLA implementation, "
          "not cuDNN's fused kernel: %s: %s",
          _shapes(q, k, v),
          type(e).__name__,
          e,
        )
        return xla(q, k, v, b, m)
      logger.debug(
        "autocast: dot_product_attention%s lowered for CUDA gets cuDNN's fused kernel",
        _shapes(q, k, v),
      )
      return out

    branches: dict[str, Callable[..., Any]] = {"cpu": cpu, "default": xla}
    if implementation is None:
      branches["cuda"] = cuda
    return jax.lax.platform_dependent(query, key, value, bias, mask, **branches)


def _shapes(*arrays: Any) -> str:
  return "(" + ", ".join(f"{np.dtype(a.dtype).name}{list(a.shape)}" for a in arrays) + ")"
