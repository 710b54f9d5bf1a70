"""The GPU program, checked without a GPU: each step compiled for an H200 (and a V100) by XLA:GPU.

``benchmarks/gpu_plan.py`` compiles a step for a compile-only CUDA device (JAX's CUDA plugin,
the ``gpu-plan`` extra, and a target description in ``benchmarks/gpu_targets/``) and reads
back the optimized HLO's kernels, their bytes, the temporaries and the host round trips.
These tests fail when the GPU program of the scaler regresses:

* the scaler against the unscaled float16 step (``dynamic_loss_scale``,
  ``jls.flax.TrainState``, ``nnx.Optimizer``, ``multi_steps``): at most one extra read of the
  float32 gradients (:data:`GRAD_READ`, 4 bytes a parameter), no more temporary memory, no
  copy of the optimizer state (:data:`EXTRA_WRITE`), the skip's selects inside AdamW's kernels;
* no host round trip (a ``while`` of unknown trip count, a conditional, a host transfer or
  callback) in the scaler, TrainState and autocast steps;
* autocast of the float32 GPT emits the hand-cast float16 step's cuDNN fused attention, with no
  more converts and no float32 dot on the attention path.

The model is ``benchmarks/bench_gpt.py``'s GPT at GPT-2 small's widths (d_model 768, 12 heads,
sequence 1024, vocab 50304) with 2 layers and batch 2: its large leaves (the 38.6M-parameter
embedding, the blocks' matrices) are GPT-2 small's. ``make test`` runs this file in
``.venv-gpu-plan``, the one venv with the plugin, and the rest of the suite without it. In CI
the plugin is required (CI=1 fails where it is missing); elsewhere these tests skip without it.
"""

import functools
import inspect
import re

from helpers import import_optional
from helpers import load_benchmark_module
from helpers import standard_promotion
import jax
import jax.numpy as jnp
import optax
import pytest

import jax_lossscale as jls
from jax_lossscale._scaler import _retry as jls_retry

import_optional("jax_plugins.xla_cuda12")

bench_gpt = load_benchmark_module("bench_gpt")
bench_large = load_benchmark_module("bench_large")
bench_variants = load_benchmark_module("bench_variants")
gpu_plan = load_benchmark_module("gpu_plan")

pytestmark = pytest.mark.slow


CFG = bench_gpt.GPT2_SMALL._replace(layers=2, batch=2)
N_PARAMS = bench_gpt.n_params(CFG)
#: One read of the float32 gradients, a parameter: the finiteness check.
GRAD_READ = 4.0
#: The scaler's extra writes, a parameter: its scalars and the check's partial reductions,
#: far under one float32 array (a copy of any optimizer-state leaf writes 4 bytes a parameter
#: of that leaf, 4 x 38.6M bytes for the embedding's moments).
EXTRA_WRITE = 0.1
#: The scaler's own temporaries: the finiteness check's per-block flags (pred[4096] for the
#: embedding) and its scalars, 2-10 KB here; the smallest matrix leaf is 2.25 MiB.
TEMP_SLACK = 16 * 1024
#: jls.multi_steps against optax.MultiSteps, read and written a parameter (see the test).
MULTI_STEPS_EXTRA = 5.1


#: The float32 parameter leaves' shapes, as the HLO writes them ("f32[2,768,3072]").
_PARAM_SHAPES = {
  "f32[" + ",".join(map(str, a.shape)) + "]"
  for a in jax.tree_util.tree_leaves(jax.eval_shape(lambda: bench_gpt.init_params(CFG)))
}


def _abstract():
  params = jax.eval_shape(lambda: bench_gpt.init_params(CFG))
  x, y = jax.eval_shape(lambda: bench_gpt.make_batch(CFG))
  return params, x, y


def _bench_step(name, attention="xla"):
  specs = {**bench_large._jax_steps(CFG, attention), **bench_large.autocast_variants(CFG)}
  init, step, _ = specs[name][1]()
  params, x, y = _abstract()
  return step, (jax.eval_shape(init, params), x, y)


def _nnx_step(scaled):
  """A stock ``nnx.Optimizer`` (AdamW, or ``dynamic_loss_scale(AdamW)``) on the GPT's params."""
  from flax import nnx

  class GPT(nnx.Module):
    def __init__(self, params):
      self.p = nnx.data(jax.tree_util.tree_map(nnx.Param, params))

  tx = bench_variants.adamw()
  if scaled:
    tx = jls.dynamic_loss_scale(tx, init_scale=bench_variants.INIT_SCALE)
  loss = lambda p, x, y: bench_gpt.loss_fn(p, x, y, CFG, jnp.float16, "xla")

  def make(params):
    model = GPT(params)
    if "wrt" in inspect.signature(nnx.Optimizer.__init__).parameters:
      return model, nnx.Optimizer(model, tx, wrt=nnx.Param)
    return model, nnx.Optimizer(model, tx)

  params, x, y = _abstract()
  graphdef, state = nnx.split(
    nnx.eval_shape(lambda: make(jax.tree_util.tree_map(jnp.zeros_like, params)))
  )

  def step(state, x, y):
    model, optimizer = nnx.merge(graphdef, state)

    def f(model):
      p = jax.tree_util.tree_map(
        lambda v: v[...], model.p, is_leaf=lambda v: isinstance(v, nnx.Variable)
      )
      value = loss(p, x, y)
      return (jls.scale_loss(value, optimizer.opt_state) if scaled else value), value

    (_, value), grads = nnx.value_and_grad(f, has_aux=True)(model)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), value

  return step, (state, x, y)


def _multi_steps_step(scaled):
  """AdamW under ``optax.MultiSteps`` (2 micro-steps), or ``jls.multi_steps`` of the scaler."""
  adamw = bench_variants.adamw()
  if scaled:
    tx = jls.multi_steps(jls.dynamic_loss_scale(adamw, init_scale=bench_variants.INIT_SCALE), 2)
  else:
    tx = optax.MultiSteps(adamw, 2)
  loss = lambda p, x, y: bench_gpt.loss_fn(p, x, y, CFG, jnp.float16, "xla")

  def step(state, x, y):
    params, opt_state = state
    with standard_promotion():
      f = lambda p: jls.scale_loss(loss(p, x, y), opt_state) if scaled else loss(p, x, y)
      grads = jax.grad(f)(params)
      updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), None

  params, x, y = _abstract()
  with standard_promotion():
    state = jax.eval_shape(lambda p: (p, tx.init(p)), params)
  return step, (state, x, y)


_STEPS = {
  "float16": lambda: _bench_step("float16"),
  "dynamic_loss_scale": lambda: _bench_step("dynamic_loss_scale"),
  "jls_trainstate": lambda: _bench_step("jls_trainstate"),
  "nnx_float16": lambda: _nnx_step(False),
  "nnx_dynamic_loss_scale": lambda: _nnx_step(True),
  "multi_steps_float16": lambda: _multi_steps_step(False),
  "multi_steps_dynamic_loss_scale": lambda: _multi_steps_step(True),
  "handcast_cudnn": lambda: _bench_step("dynamic_loss_scale", "cudnn"),
  "autocast": lambda: _bench_step("autocast_dynamic_loss_scale"),
}


def plan(name: str, target: str = "h200") -> gpu_plan.Plan:
  """The plan of the step ``name`` for ``target``, compiled once a session."""
  return _plan(name, target)


@functools.cache
def _plan(name: str, target: str) -> gpu_plan.Plan:
  # AdamW's bias correction mixes a Python float and an int32 count (standard promotion).
  with standard_promotion(), gpu_plan.cudnn_answered(target):
    step, args = _STEPS[name]()
    return gpu_plan.compile_plan(step, args, target)


def _adam_kernels(p: gpu_plan.Plan):
  """AdamW's update kernels: those that take a square root (of the second moment) and write
  at least the smallest parameter leaf (a d_model vector; not the scaler's scalars)."""
  return p.find(lambda k: "sqrt" in k.body.split() and k.bytes_written >= 4 * CFG.d_model)


PAIRS = [
  ("dynamic_loss_scale", "float16", "h200"),
  ("jls_trainstate", "float16", "h200"),
  ("nnx_dynamic_loss_scale", "nnx_float16", "h200"),
  ("multi_steps_dynamic_loss_scale", "multi_steps_float16", "h200"),
  ("dynamic_loss_scale", "float16", "v100"),
]


@pytest.mark.parametrize("scaled,reference,target", PAIRS)
def test_scaler_costs_one_read_of_the_gradients(scaled, reference, target):
  s, r = plan(scaled, target), plan(reference, target)
  extra_read = (s.bytes_read - r.bytes_read) / N_PARAMS
  extra_write = (s.bytes_written - r.bytes_written) / N_PARAMS
  read_bound, write_bound = GRAD_READ, EXTRA_WRITE
  if scaled.startswith("multi_steps"):
    # A known miss, bounded: jls.multi_steps checks each micro-step's gradients in the kernel
    # that adds them to the accumulator (reads gradients and accumulator, writes the
    # accumulator and a flag), where optax.MultiSteps' accumulation costs 1.06 bytes a
    # parameter less of each (it zero-fills four block accumulators instead).
    read_bound, write_bound = MULTI_STEPS_EXTRA, MULTI_STEPS_EXTRA
  # One read of the float32 gradients for the finiteness check, and nothing else.
  assert 0 <= extra_read <= read_bound + 0.01, (extra_read, s.summary(), r.summary())
  # No copy of the optimizer state (or of the params, or of the gradients).
  assert extra_write <= write_bound, (extra_write, s.summary(), r.summary())
  assert s.find(lambda k: k.opcode == "copy" and k.bytes_written >= 4 * 768 * 768) == []
  # No more temporary memory than the check's per-block flags and the scaler's scalars.
  assert s.temp_bytes <= r.temp_bytes + TEMP_SLACK, (s.temp_bytes, r.temp_bytes)
  # The skip is fused into AdamW's kernels: each with its select, writing no more than the
  # reference's (XLA may group the leaves into fewer kernels), and no kernel of parameter size
  # that only selects.
  adam_s, adam_r = _adam_kernels(s), _adam_kernels(r)
  assert adam_s and adam_r
  written = lambda ks: sum(k.bytes_written * k.count for k in ks)
  assert written(adam_s) <= written(adam_r) + EXTRA_WRITE * N_PARAMS
  assert all("select" in k.body.split() for k in adam_s), [k.name for k in adam_s]
  extra, _ = gpu_plan.diff(s, r)
  lone = [
    k
    for k in extra
    if "select" in k.body.split()
    and "sqrt" not in k.body.split()
    and _PARAM_SHAPES & set(re.findall(r"f32\[[\d,]*\]", k.shape))
  ]
  assert lone == [], [(k.name, k.shape) for k in lone]


@pytest.mark.parametrize(
  "name", ["float16", "dynamic_loss_scale", "jls_trainstate", "nnx_dynamic_loss_scale", "autocast"]
)
def test_no_host_round_trip(name):
  p = plan(name)
  assert p.host_round_trips == []
  # Every loop of the step (the layers' scans) has its trip count known to XLA.
  assert re.findall(r"\bwhile\(", p.hlo) and "known_trip_count" in p.hlo


def test_the_round_trip_detector_sees_each_kind():
  """A control for the test above: a while of unknown trip count and a conditional are found.

  (A host callback cannot be lowered for CUDA without a CUDA backend in the process.)
  """
  x = jax.ShapeDtypeStruct((256, 256), jnp.float32)

  def step(x):
    x = jax.lax.while_loop(lambda v: v.sum() < 1e6, lambda v: v @ v + 1, x)
    return jax.lax.cond(x.sum() > 0, lambda v: v @ v, lambda v: jnp.tanh(v) @ v.T, x)

  p = gpu_plan.compile_plan(step, (x,), donate_argnums=())
  kinds = " ".join(p.host_round_trips)
  assert "while without a known trip count" in kinds
  assert "conditional" in kinds
  # The thunks that run: both outside any CUDA graph, both read by the host; a scan (a
  # while of known trip count) is not (its thunk runs the body n times, reading nothing).
  assert [t.split()[1] for t in p.host_predicates] == ["kWhile", "kConditional"]
  scan = lambda x: jax.lax.scan(lambda c, _: (c @ c, None), x, None, length=4)[0]
  assert gpu_plan.compile_plan(scan, (x,), donate_argnums=()).host_predicates == []


#: The compile options of the retry guide ("A step the host does not wait on"): every command
#: type this XLA puts in CUDA graphs by default, with WHILE and CONDITIONAL (conditional
#: nodes), and the loops of known trip count unrolled into the graph (a scan over layers
#: slices its weights with dynamic-slice fusions, which a graph holds only unrolled).
GRAPH_OPTIONS = {
  "xla_gpu_enable_command_buffer": (
    "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL"
  ),
  "xla_gpu_command_buffer_unroll_loops": True,
}


def _retry_plan(compiler_options=None, *, scanned=False, max_retries=3):
  """A small float16 step with jls.retry_on_overflow (``scanned``: two layers in a lax.scan)."""
  tx = jls.dynamic_loss_scale(optax.sgd(0.1))
  p0 = {"w": jax.ShapeDtypeStruct((2, 64, 64) if scanned else (64, 64), jnp.float32)}

  def loss(p, x):
    if scanned:
      layer = lambda h, w: (jnp.tanh(h @ w.astype(jnp.float16)), None)
      h, _ = jax.lax.scan(layer, x, p["w"])
    else:
      h = x @ p["w"].astype(jnp.float16)
    return jnp.sum(h.astype(jnp.float32))

  def step(state, x):
    params, opt_state = state
    opt_state, out = jls.retry_on_overflow(loss, opt_state, max_retries=max_retries)(params, x)
    updates, opt_state = tx.update(out.grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  state = (p0, jax.eval_shape(tx.init, p0))
  x = jax.ShapeDtypeStruct((8, 64), jnp.float16)
  return gpu_plan.compile_plan(step, (state, x), compiler_options=compiler_options)


def test_retry_on_overflow_as_compiled_waits_for_the_host_once():
  """By default XLA:GPU runs the retry's cond as a thunk whose branch index the host reads:
  one round trip a step (the conds inside it run only after an overflow)."""
  p = _retry_plan()
  assert not any("while without a known trip count" in h for h in p.host_round_trips)
  outer = [t for t in p.host_predicates if "kConditional" in t]
  assert outer and all("kWhile" not in t for t in p.host_predicates)


@pytest.mark.parametrize("scanned", [False, True], ids=["dense", "scan-over-layers"])
def test_retry_on_overflow_in_a_cuda_graph_leaves_the_host_nothing_to_read(scanned):
  """With the guide's options the whole step is one CUDA graph: no while or conditional
  thunk outside it, so the host never waits on a predicate (it fails if one comes back)."""
  p = _retry_plan(GRAPH_OPTIONS, scanned=scanned)
  assert p.host_predicates == []
  assert "kCommandBuffer" in p.thunks_run


def test_a_retry_while_loop_around_a_scan_stays_on_the_host():
  """The control: past UNROLLED_RETRIES the retries are a while loop of unknown trip count,
  and XLA keeps such a loop out of a CUDA graph when its body holds a loop-dependent
  dynamic-slice fusion (a scan over layers): its predicate is read by the host again."""
  max_retries = jls_retry.UNROLLED_RETRIES + 1
  dense = _retry_plan(GRAPH_OPTIONS, max_retries=max_retries)
  assert dense.host_predicates == []
  scanned = _retry_plan(GRAPH_OPTIONS, scanned=True, max_retries=max_retries)
  assert [t for t in scanned.host_predicates if "kConditional" in t]


def _fmha(p):
  return sorted(k.kind for k in p.kernels if "fmha" in k.kind.lower())


_CAST_ONLY = {"parameter", "convert", "bitcast", "copy", "transpose", "broadcast", "constant"}


def _converts(p):
  """The cast kernels (only converts and views in them): launches a step, and their bytes."""
  casts = p.find(
    lambda k: (
      (k.opcode == "convert") or ("convert" in k.body.split() and set(k.body.split()) <= _CAST_ONLY)
    )
  )
  return sum(k.count for k in casts), sum(k.bytes * k.count for k in casts)


def test_autocast_emits_the_handcast_cudnn_attention():
  a, h = plan("autocast"), plan("handcast_cudnn")
  assert _fmha(a) == _fmha(h)
  assert any("Backward" in k for k in _fmha(a)) and any("Backward" not in k for k in _fmha(a))
  (a_casts, a_bytes), (h_casts, h_bytes) = _converts(a), _converts(h)
  assert a_casts <= h_casts and a_bytes <= h_bytes, (_converts(a), _converts(h))
  # No float32 dot on the attention path (a (T, T) score or probability matrix).
  t = CFG.seq
  f32_attention = a.find(lambda k: k.flops and k.dot_dtype == "f32" and f"{t},{t}" in k.shape)
  assert f32_attention == []
  assert a.summary()["float32_dot_flops"] <= h.summary()["float32_dot_flops"]
  assert a.temp_bytes <= h.temp_bytes, (a.temp_bytes, h.temp_bytes)
  assert a.host_round_trips == []


def test_einsum_attention_backward_has_no_float32_dot():
  """bench_gpt's einsum attention: its backward dots in float16 with float32 accumulation (as
  torch's), not on the scores' float32 cotangent (JAX's transpose: 2 float32 dots a layer)."""
  p = plan("float16")
  assert p.summary()["float32_dot_flops"] == 0
  assert p.summary()["dot_flops"] > 0
