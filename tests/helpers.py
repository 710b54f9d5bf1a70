"""Helpers shared by the test files: ``from helpers import ...``.

Plain functions and constants only; the fixtures and pytest hooks live in
``tests/conftest.py`` (which sets the eight CPU devices and strict dtype promotion
before any test module, and so before this one, is imported).

* :func:`import_optional`, :func:`import_torch`: an optional test dependency,
  skipped where it is missing, a failure in CI (``CI=true``) for the ones in
  :data:`REQUIRED_IN_CI` (those ``make test`` installs); :func:`in_ci`.
* :func:`standard_promotion`: standard dtype promotion around third-party code
  (``optax.adam``) that is not clean under strict promotion.
* :func:`slow_batch`, :func:`calibrated_iterations`: a long device computation that
  returns its input, for proving that code does not wait for the device (see
  ``tests/test_entry_points_async.py``).
* :func:`has_cuda`: whether JAX sees a CUDA device.
* :func:`make_nnx_optimizer`, :func:`nnx_update`: ``nnx.Optimizer`` built and stepped
  the same way on every Flax version the package supports.
* :func:`bits`, :func:`assert_bits_equal`: every leaf as its raw bits, and two trees
  compared bit for bit (NaN payloads and -0.0 included; optionally their tree structure
  and dtypes too).
* :data:`ROOT`, :func:`python_blocks`: the repository, and the ``python`` blocks of a
  markdown page (the docs' code, run by ``tests/test_docs.py`` and the guides' tests).
* :func:`load_benchmark_module`: a module of ``benchmarks/`` (with that folder on
  ``sys.path``, as its scripts run), for code that lives beside its benchmark.
* :func:`rand`, :func:`transformer_params`, :func:`transformer_layers`,
  :func:`transformer_tokens`, :data:`TORCH_CUDA_LAYER_DTYPES`: a one-block decoder that
  returns every layer's output, and each layer's dtype under CUDA ``torch.autocast``
  (``tests/autocast/test_api_autocast.py``, ``tests/autocast/test_torch_policy.py``).
* :func:`tanh_custom_vjp`: ``tanh`` as a user's ``jax.custom_vjp`` (its output saved as the
  residual), counting its backward's calls (``tests/autocast/``).
* :func:`tap_number`, :func:`block_counts`: an automatic tap's program-order counter, and
  ``check_underflow``'s counts per block of a scanned model or its unrolled twin
  (``tests/test_underflow_scan.py``, ``tests/test_underflow_scan_flax.py``).
* :data:`TABLE`, :func:`scaled_by_table` (and by hand), :func:`eqn_named`, :func:`half`,
  :func:`not_checked`: an ``autocast_op`` closing over an array (a constant its rule hoists),
  one equation of a jaxpr, and ``check_underflow``'s unchecked counts
  (``tests/autocast/test_rules_{calls,loops,branches,custom}.py``).
* :data:`DEVIATIONS`: the autocast zoo's cases where autocast deliberately differs from
  torch (``tests/autocast/test_zoo.py``, ``tests/autocast/test_guide.py``).
"""

import importlib
import inspect
import os
import pathlib
import re
import sys
import time

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import pytest

import jax_lossscale as jls

#: The repository's root.
ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCHMARKS_DIR = os.path.join(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"
)

_FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)


def python_blocks(text: str) -> list[tuple[int, str]]:
  """(line number, code) of each ```` ```python ```` block of a markdown text."""
  return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in _FENCE.finditer(text)]


def load_benchmark_module(name: str):
  """Imports ``benchmarks/<name>.py``, putting ``benchmarks/`` on ``sys.path`` once."""
  if BENCHMARKS_DIR not in sys.path:
    sys.path.insert(0, BENCHMARKS_DIR)
  return importlib.import_module(name)


def bits(tree):
  """Every leaf as its raw bits (bit-identity, NaN payloads and -0.0 included)."""
  return [
    np.asarray(x).view(f"u{np.asarray(x).dtype.itemsize}") for x in jax.tree_util.tree_leaves(tree)
  ]


def assert_bits_equal(a, b, *, structure=False, dtypes=False):
  """``a`` and ``b`` have as many leaves, each of the same shape, itemsize and bits.

  ``structure=True``: the same tree structure too; ``dtypes=True``: each pair of leaves of
  the same dtype too (else float16 and bfloat16 leaves of the same bits are equal).
  """
  if structure:
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
  la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
  assert len(la) == len(lb)
  if dtypes:
    for x, y in zip(la, lb):
      assert np.asarray(x).dtype == np.asarray(y).dtype
  for x, y in zip(bits(la), bits(lb)):
    np.testing.assert_array_equal(x, y, strict=True)


def make_nnx_optimizer(model, tx):
  """``nnx.Optimizer(model, tx, wrt=nnx.Param)``; ``wrt`` is required from Flax 0.11 on."""
  from flax import nnx

  if "wrt" in inspect.signature(nnx.Optimizer.__init__).parameters:
    return nnx.Optimizer(model, tx, wrt=nnx.Param)
  return nnx.Optimizer(model, tx)  # Flax < 0.11


def nnx_update(optimizer, model, grads):
  """``optimizer.update(model, grads)`` (Flax >= 0.11) or ``update(grads)``."""
  params = inspect.signature(optimizer.update).parameters.values()
  if sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params) >= 2:
    return optimizer.update(model, grads)
  return optimizer.update(grads)


def has_cuda() -> bool:
  try:
    return any(d.platform == "gpu" for d in jax.devices())
  except RuntimeError:
    return False


#: Optional test dependencies that ``make test`` installs (the ``test`` extra),
#: by import name. In CI a test that needs one of them fails when it is missing.
REQUIRED_IN_CI = (
  "torch",
  "hypothesis",
  "orbax",
  "sklearn",
  "matplotlib",
  "flax",
  "equinox",
  "chex",
  "jmp",
  "tqdm",
  "jax_resnet",
  "jraph",
  "transformers",
  "yaml",
  "jax_plugins",  # jax-cuda12-plugin (the gpu-plan extra): tests/test_gpu_plan.py
)


def in_ci() -> bool:
  """Whether the suite runs in CI (``CI`` set to ``1``, ``true`` or ``yes``)."""
  return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def required_in_ci(name: str) -> bool:
  """Whether a missing ``name`` fails the run: in CI and in :data:`REQUIRED_IN_CI`.

  ``JAX_LOSSSCALE_CI_OPTIONAL`` (space- or comma-separated import names) exempts
  some of them: ``make test-compat`` sets it to what its venv leaves out (torch),
  so every other required dependency still fails there when missing. ``.ci/run``
  never sets it.
  """
  top = name.split(".")[0]
  exempt = os.environ.get("JAX_LOSSSCALE_CI_OPTIONAL", "").replace(",", " ").split()
  return in_ci() and top in REQUIRED_IN_CI and top not in exempt


def import_optional(name: str):
  """Imports module ``name``; skips the test if it is missing, but fails in CI.

  Use it instead of ``pytest.importorskip`` for the dependencies in
  :data:`REQUIRED_IN_CI`: a missing install step in CI must not turn a whole
  file of tests into silent skips.
  """
  try:
    return importlib.import_module(name)
  except ImportError as e:
    if required_in_ci(name):
      pytest.fail(f"{name} is required in CI (it is in the test extra): {e}", pytrace=False)
    pytest.skip(f"{name} is not installed", allow_module_level=True)


def import_torch():
  """Imports torch; skips the test outside CI if torch is missing, fails in CI."""
  return import_optional("torch")


def standard_promotion():
  """Standard dtype promotion, for third-party code that is not strict-clean.

  ``optax.adam`` computes ``b1 ** count`` (a Python float to an int32 power),
  which strict promotion rejects; use this context around steps that run Adam.
  jax_lossscale's own code runs under strict promotion everywhere else.
  """
  return jax.numpy_dtype_promotion("standard")


@jax.jit
def _slow_batch(x, n):
  def body(_, m):
    return jnp.tanh(m @ m) * np.float32(0.5)

  m = jax.lax.fori_loop(0, n, body, jnp.eye(256, dtype=jnp.float32))
  # Depends on the loop's result, equals x (m is finite and bounded).
  return x + jnp.zeros_like(x) * m[0, 0]


def slow_batch(x, n):
  """``x`` unchanged, after ``n`` dependent 256x256 matmuls (a long device computation).

  Whatever is computed from the result cannot be ready before the loop ends;
  so code that returns while the result is not ready has not waited for it
  (on CPU ``jax.transfer_guard`` never fires for device-resident values, so
  this is how "no host sync" is proven).
  """
  return _slow_batch(x, n)


def calibrated_iterations(x, seconds=1.0):
  """Loop length for which :func:`slow_batch` runs about ``seconds``."""
  n = 64
  _slow_batch(x, n).block_until_ready()  # compile
  t0 = time.perf_counter()
  _slow_batch(x, n).block_until_ready()
  dt = max(time.perf_counter() - t0, 1e-4)
  return int(min(max(n * seconds / dt, 64), 1_000_000))


# -- the one-block decoder of tests/autocast/test_api_autocast.py and tests/autocast/test_torch_policy.py ------

_F16, _F32 = np.dtype(jnp.float16), np.dtype(jnp.float32)


def tanh_custom_vjp(calls: list | None = None):
  """``tanh`` as a ``jax.custom_vjp`` whose forward saves its output and whose backward
  computes ``g * (1 - y * y)``, appending to ``calls`` (if given) each time it is traced."""

  @jax.custom_vjp
  def tanh(x):
    return jnp.tanh(x)

  def fwd(x):
    y = jnp.tanh(x)
    return y, y

  def bwd(y, g):
    if calls is not None:
      calls.append(1)
    return (g * (1 - y * y),)

  tanh.defvjp(fwd, bwd)
  return tanh


def rand(key, shape, scale=1.0):
  """float32 ``scale * N(0, 1)`` of ``shape`` from ``jax.random.key(key)``."""
  return scale * jax.random.normal(jax.random.key(key), shape, jnp.float32)


def _layer_norm(x, g, b, eps=1e-5):
  mean = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + eps) * g + b


def _cross_entropy(logits, labels):
  logp = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=-1))


def transformer_params(d=8, v=11, seed=0):
  """The params of :func:`transformer_layers` (float32, from keys ``seed``, ``seed + 1``, ...)."""
  keys = iter(range(seed, seed + 100))
  return {
    "emb": rand(next(keys), (v, d)),
    "ln1_g": jnp.ones(d),
    "ln1_b": jnp.zeros(d),
    "wqkv": rand(next(keys), (d, 3 * d), d**-0.5),
    "bqkv": rand(next(keys), (3 * d,), 0.1),
    "wo": rand(next(keys), (d, d), d**-0.5),
    "bo": rand(next(keys), (d,), 0.1),
    "ln2_g": jnp.ones(d),
    "ln2_b": jnp.zeros(d),
    "w1": rand(next(keys), (d, 4 * d), d**-0.5),
    "b1": rand(next(keys), (4 * d,), 0.1),
    "w2": rand(next(keys), (4 * d, d), (4 * d) ** -0.5),
    "b2": rand(next(keys), (d,), 0.1),
    "wout": rand(next(keys), (d, v), d**-0.5),
  }


def transformer_layers(p, tokens, labels, approximate_gelu=False):
  """A one-block decoder; returns every layer's output, by name."""
  out = {}
  x = out["embedding"] = p["emb"][tokens]
  h = out["ln1"] = _layer_norm(x, p["ln1_g"], p["ln1_b"])
  qkv = out["qkv_linear"] = h @ p["wqkv"] + p["bqkv"]
  q, k, v = jnp.split(qkv, 3, axis=-1)
  s = out["scores_matmul"] = jnp.einsum("td,sd->ts", q, k) / np.sqrt(q.shape[-1])
  mask = jnp.tril(jnp.ones(s.shape, dtype=bool))
  s = jnp.where(mask, s, -1e4)
  a = out["softmax"] = jax.nn.softmax(s, axis=-1)
  o = out["attn_matmul"] = a @ v
  o = out["out_linear"] = o @ p["wo"] + p["bo"]
  x = out["residual1"] = x + o
  h = out["ln2"] = _layer_norm(x, p["ln2_g"], p["ln2_b"])
  m = out["fc1_linear"] = h @ p["w1"] + p["b1"]
  m = out["gelu"] = jax.nn.gelu(m, approximate=approximate_gelu)
  m = out["fc2_linear"] = m @ p["w2"] + p["b2"]
  x = out["residual2"] = x + m
  logits = out["logits_linear"] = x @ p["wout"]
  out["cross_entropy"] = _cross_entropy(logits, labels)
  return out


#: The output dtype of each layer under torch.autocast("cuda", torch.float16), from
#: the lists of aten/src/ATen/autocast_mode.h (torch 2.13.0, commit cf30153c4c13).
TORCH_CUDA_LAYER_DTYPES = {
  "embedding": _F32,  # embedding: in no list, float32 weight -> float32
  "ln1": _F32,  # fp32: layer_norm
  "qkv_linear": _F16,  # lower_precision_fp: linear
  "scores_matmul": _F16,  # lower_precision_fp: matmul (/ a Python scalar keeps it)
  "softmax": _F32,  # fp32_set_opt_dtype: softmax
  "attn_matmul": _F16,  # lower_precision_fp: matmul
  "out_linear": _F16,  # lower_precision_fp: linear
  "residual1": _F32,  # add: float32 + float16 promotes
  "ln2": _F32,  # fp32: layer_norm
  "fc1_linear": _F16,  # lower_precision_fp: linear
  "gelu": _F16,  # gelu: in no list, float16 in -> float16
  "fc2_linear": _F16,  # lower_precision_fp: linear
  "residual2": _F32,  # add: promotes
  "logits_linear": _F16,  # lower_precision_fp: linear (no bias)
  "cross_entropy": _F32,  # fp32: nll_loss, fp32_set_opt_dtype: log_softmax
}


def transformer_tokens(t=6, v=11):
  """Tokens and next-token labels for :func:`transformer_layers`."""
  tokens = jnp.arange(t, dtype=jnp.int32) % v
  return tokens, (tokens + 1) % v


# -- the autocast zoo (tests/autocast/test_zoo.py) ---------------------------------------

#: Where autocast deliberately differs from torch, each stated in docs/guides/autocast.md
#: (``tests/autocast/test_zoo.py``'s cases, checked there and in ``tests/autocast/test_guide.py``):
#: case -> (autocast's dtype for the outputs that differ, why, the guide's words).
DEVIATIONS: dict[str, tuple[dict[str, np.dtype], str, str]] = {
  "mean": (
    {"y": _F32},
    "jnp.mean is reduce_sum (torch's sum: fp32_set_opt_dtype) then div",
    "`jnp.mean` is float32 (`reduce_sum` then `div`); `torch.mean` is float16.",
  ),
  "eqx_linear_unbatched": (
    {"y": _F32},
    "W @ x + b on a vector adds a bias of the output's own rank, which the bias rule "
    "does not take for a bias",
    "An unbatched `equinox.nn.Linear` (`W @ x + b` with `x` a vector) adds a bias of the "
    "output's own rank: it promotes.",
  ),
  "fori_loop": (
    {"y": _F32},
    "a loop carry is cast back to its declared dtype (float32) at each step boundary",
    "A `while` or `scan` carry keeps its declared dtype",
  ),
  "while_bias": (
    {"y": _F32},
    "a loop carry is cast back to its declared dtype (float32) at each step boundary",
    "A `while` or `scan` carry keeps its declared dtype",
  ),
  "scan_bias": (
    {"carry": _F32},
    "a loop carry is cast back to its declared dtype (float32); the per-step outputs keep "
    "the body's float16",
    "A `while` or `scan` carry keeps its declared dtype",
  ),
}


def all_eqns(jaxpr):
  """Every equation of ``jaxpr`` and of the jaxprs in its params, depth first."""
  for eqn in jaxpr.eqns:
    yield eqn
    # jax.extend.core has it from jax 0.10 on, jax._src.core before.
    jaxprs_in_params = getattr(jex, "jaxprs_in_params", None)
    for sub in (jaxprs_in_params or jax._src.core.jaxprs_in_params)(eqn.params):
      yield from all_eqns(sub)


#: ``GradScaler.state_dict()`` of torch's defaults.
TORCH_DEFAULTS = {
  "scale": 65536.0,
  "growth_factor": 2.0,
  "backoff_factor": 0.5,
  "growth_interval": 2000,
  "_growth_tracker": 0,
}


# -- check_underflow's per-layer counts (tests/test_underflow_scan*.py) ------------------


def tap_number(name):
  """The program-order counter of an automatic tap: ``n`` of ``.../<primitive>#<n>``."""
  return int(name.rsplit("#", 1)[1])


def block_counts(report, blocks):
  """Per block, its activation taps' ``(nonzero, lost unscaled, lost scaled)``, in the
  block's order; and the other activation taps' (those after the blocks: the logits').

  In a scanned model, block ``i`` is iteration ``i`` of the first scan (``scan#0[i]``); in
  its unrolled twin, the taps in program order are ``blocks`` blocks of the same number of
  taps, then the others.
  """
  acts = report.looked_at()["activations"]
  per_block, rest = [[] for _ in range(blocks)], []
  inside = [k for k in acts if "scan#0[" in k]
  if inside:
    for k in sorted(inside, key=tap_number):
      per_block[int(k.split("scan#0[", 1)[1].split("]", 1)[0])].append(k)
    rest = [k for k in acts if k not in inside]
  else:
    ordered = sorted(acts, key=tap_number)
    per = (len(ordered) - 1) // blocks
    per_block = [ordered[i * per : (i + 1) * per] for i in range(blocks)]
    rest = ordered[blocks * per :]

  def counts(k):
    return int(report.nonzero[k]), int(report.lost_unscaled[k]), int(report.lost_scaled[k])

  return [[counts(k) for k in b] for b in per_block], [counts(k) for k in rest]


def assert_worst_layer_inside_scan(report, unrolled) -> str:
  """A scanned model's check_underflow verdict names its worst activation, an op inside the
  scan, with nothing left unchecked; its unrolled twin's worst is that op's same fraction.
  Returns the verdict."""
  fractions = report.fractions()
  worst = max(report.looked_at()["activations"], key=fractions.get)
  assert worst.startswith("activations/scan#0[")  # a block's op, not the logits
  verdict = report.verdict()
  assert f"worst {worst}: {fractions[worst]:.2%}" in verdict
  assert "not checked" not in verdict
  assert max(unrolled.fractions().values()) == fractions[worst]
  return verdict


# -- the higher-order rules' tests (tests/autocast/test_rules_{calls,loops,branches,custom}.py)

TABLE = jnp.arange(1.0, 5.0, dtype=jnp.float32)


@jls.autocast_op(rule="float32")
def scaled_by_table(h):
  """A float32 op closing over an array: under autocast each interpreted body that calls
  it holds ``TABLE`` as a constant, which its handler hoists into a leading input."""
  return h * TABLE


def scaled_by_table_by_hand(h16):
  """:func:`scaled_by_table` of a float16 ``h16``, cast by hand."""
  return h16.astype(np.float32) * TABLE


def eqn_named(fun, *args, name, jit_name=None):
  """The one ``name`` equation of ``fun``'s jaxpr (nested too); for a ``jit``, the one
  named ``jit_name``."""
  found = [
    e
    for e in all_eqns(jax.make_jaxpr(fun)(*args).jaxpr)
    if e.primitive.name == name and (jit_name is None or str(e.params["name"]) == jit_name)
  ]
  assert len(found) == 1, found
  return found[0]


def half(x):
  """``x`` in float16."""
  return x.astype(np.float16)


def not_checked(report):
  """``report.not_checked`` as plain ints, to compare with ``==``."""
  return {k: tuple(int(v) for v in n) for k, n in report.not_checked.items()}


def rand_dtype(seed, shape, dtype=jnp.float32):
  """A standard normal array of ``shape`` from key ``seed``, drawn in float32, cast to ``dtype``."""
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def eqns_named(closed, name):
  """The ``name`` equations of the closed jaxpr ``closed``, in its sub-jaxprs too, in order."""
  out = []

  def walk(jaxpr):
    for e in jaxpr.eqns:
      if e.primitive.name == name:
        out.append(e)
      for p in e.params.values():
        for q in p if isinstance(p, (tuple, list)) else (p,):
          if hasattr(q, "eqns"):
            walk(q)
          elif hasattr(q, "jaxpr") and hasattr(q.jaxpr, "eqns"):
            walk(q.jaxpr)

  walk(closed.jaxpr)
  return out


def assert_equal_in_dtype(a, b):
  """``a`` and ``b`` have one dtype and equal values (compared in float32)."""
  assert np.dtype(a.dtype) == np.dtype(b.dtype), (a.dtype, b.dtype)
  np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def matmul16(x, w):
  """The float16 matmul autocast runs for ``x @ w``."""
  return x.astype(jnp.float16) @ w.astype(jnp.float16)
