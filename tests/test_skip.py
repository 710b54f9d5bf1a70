"""A skipped step leaves every bit in place: subnormals, -0.0, every float dtype, every path.

XLA on CPU flushes subnormals in float arithmetic (``x / 1.0`` is not an
identity there), so the skip must be pure selection. Checked for small leaves
and for leaves of at least ``LARGE`` elements (where ``skip_step`` orders the
state select), through the four ways users run a step: the README's one-jit
step with ``dynamic_loss_scale`` + ``optax.apply_updates``, stock Flax
``TrainState`` with the wrapper, ``jax_lossscale.flax.TrainState``, and
``nnx.Optimizer``.
"""

from flax import nnx
from flax.training import train_state
from helpers import make_nnx_optimizer as make_optimizer
from helpers import nnx_update as _update
from helpers import standard_promotion
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_lossscale as jls
from jax_lossscale import flax as jls_flax
from jax_lossscale._scaler._skip import LARGE
from jax_lossscale._scaler._skip import skip_step
from jax_lossscale._scaler._skip import skipped_updates

SIZES = {"small": 1000, "large": LARGE}
_UINT = {2: np.uint16, 4: np.uint32}


def _bits(x):
  x = np.asarray(x)
  return x.view(_UINT[x.dtype.itemsize])


def _edge_values(n: int, dtype) -> jax.Array:
  """``n`` values of ``dtype`` holding subnormals of both signs, -0.0, +0.0 and normals."""
  info = jnp.finfo(dtype)
  tiny_sub = float(info.smallest_subnormal)
  edge = np.array(
    [tiny_sub, -tiny_sub, 3 * tiny_sub, float(info.tiny) / 2, -0.0, 0.0, 1.0, -2.5],
    np.float32,
  )
  values = np.resize(edge, n).astype(dtype)
  assert np.signbit(values[4]) and values[0] != 0  # the edge values are representable
  return jnp.asarray(values)


def _assert_bits_equal(a, b, subnormals=True):
  """Bit-identical leaves; with ``subnormals=False`` subnormal expected values are not compared."""
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype
    keep = np.ones(y.shape, bool)
    if not subnormals and jnp.issubdtype(y.dtype, jnp.floating):
      keep = ~((y != 0) & (np.abs(y.astype(np.float32)) < float(jnp.finfo(y.dtype).tiny)))
    np.testing.assert_array_equal(_bits(x)[keep], _bits(y)[keep])


def _jitted(maybe_jit) -> bool:
  return maybe_jit is jax.jit


# With the updates API the user's own ``p + u`` (``optax.apply_updates``)
# adds the skipped step's -0.0. IEEE keeps ``p`` exactly, but XLA on CPU
# flushes subnormal inputs of float arithmetic to zero; under ``jit`` XLA folds
# ``p + where(finite, u, -0.0)`` into a select and keeps them, eagerly it
# cannot. jax_lossscale.flax.TrainState selects the params themselves and is
# exact either way.
_CPU_EAGER_ADD_FLUSHES = jax.default_backend() == "cpu"


@pytest.mark.parametrize("size", SIZES.values(), ids=SIZES.keys())
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_skip_step_selects_bits(maybe_jit, size, dtype):
  old = _edge_values(size, dtype)
  new = jnp.ones_like(old)
  state_old = {"mu": _edge_values(size, dtype), "n": jnp.int32(3)}
  state_new = {"mu": jnp.full_like(old, 7), "n": jnp.int32(4)}
  out, state = maybe_jit(skip_step)(jnp.array(False), new, old, state_new, state_old)
  _assert_bits_equal(out, old)
  _assert_bits_equal(state, state_old)
  out, state = maybe_jit(skip_step)(jnp.array(True), new, old, state_new, state_old)
  _assert_bits_equal(out, new)
  _assert_bits_equal(state, state_new)


def test_skipped_updates_are_negative_zero_in_each_dtype():
  u = {"a": jnp.ones(3, jnp.float16), "b": jnp.ones(2, jnp.bfloat16), "i": jnp.ones(2, jnp.int32)}
  s = skipped_updates(u)
  for k in ("a", "b"):
    assert s[k].dtype == u[k].dtype and bool(jnp.all(jnp.signbit(s[k])))
    assert bool(jnp.all(s[k] == 0))
  assert s["i"].dtype == jnp.int32 and bool(jnp.all(s["i"] == 0))


def _params(size):
  return {"w": _edge_values(size, jnp.float32), "b": _edge_values(8, jnp.float32)}


def _inf_grads(params):
  return jax.tree_util.tree_map(lambda p: jnp.full_like(p, jnp.inf), params)


@pytest.mark.parametrize("size", SIZES.values(), ids=SIZES.keys())
def test_readme_one_jit_step_keeps_every_bit(maybe_jit, size):
  tx = jls.dynamic_loss_scale(optax.adam(1e-3))
  params = _params(size)
  opt_state = tx.init(params)

  def train_step(params, opt_state, grads):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  with standard_promotion():
    new_params, new_state = maybe_jit(train_step)(params, opt_state, _inf_grads(params))
  _assert_bits_equal(
    new_params, params, subnormals=_jitted(maybe_jit) or not _CPU_EAGER_ADD_FLUSHES
  )
  _assert_bits_equal(new_state.inner_state, opt_state.inner_state)
  assert int(new_state.loss_scale.skipped_steps) == 1


@pytest.mark.parametrize("size", SIZES.values(), ids=SIZES.keys())
def test_stock_flax_trainstate_keeps_every_bit(maybe_jit, size):
  params = _params(size)
  state = train_state.TrainState.create(
    apply_fn=None, params=params, tx=jls.dynamic_loss_scale(optax.sgd(1e-3))
  )
  new = maybe_jit(lambda s, g: s.apply_gradients(grads=g))(state, _inf_grads(params))
  _assert_bits_equal(
    new.params, params, subnormals=_jitted(maybe_jit) or not _CPU_EAGER_ADD_FLUSHES
  )
  assert int(jls.get_scale_state(new.opt_state).skipped_steps) == 1


@pytest.mark.parametrize("size", SIZES.values(), ids=SIZES.keys())
def test_jls_trainstate_keeps_every_bit(maybe_jit, size):
  params = _params(size)
  state = jls_flax.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(1e-3))
  # The reproduction: apply_gradients with finite=False.
  new = maybe_jit(lambda s, g: s.apply_gradients(grads=g, finite=jnp.array(False)))(
    state, _inf_grads(params)
  )
  _assert_bits_equal(new.params, params)
  assert int(new.step) == 0
  # And through value_and_grad with an inf loss.
  loss = lambda p: jnp.sum(p["w"]) * jnp.float32(jnp.inf)

  def step(s):
    out = s.value_and_grad(loss)(s.params)
    return s.apply_gradients(grads=out.grads, finite=out.finite)

  new = maybe_jit(step)(state)
  _assert_bits_equal(new.params, params)
  assert float(new.dynamic_scale.scale) == 2.0**15


class _Edge(nnx.Module):
  def __init__(self, size):
    self.w = nnx.Param(_edge_values(size, jnp.float32))


@pytest.mark.parametrize("size", SIZES.values(), ids=SIZES.keys())
def test_nnx_optimizer_keeps_every_bit(size):
  model = _Edge(size)
  optimizer = make_optimizer(model, jls.dynamic_loss_scale(optax.sgd(1e-3)))
  before = np.asarray(model.w[...]).copy()

  @nnx.jit
  def step(model, optimizer):
    grads = nnx.grad(lambda m: jnp.sum(m.w[...]) * jnp.float32(jnp.inf))(model)
    _update(optimizer, model, grads)

  step(model, optimizer)
  # nnx.Optimizer.update returns the updates too, and XLA:CPU does not fold
  # its add there: subnormal params are flushed by that add (not by the skip).
  _assert_bits_equal(model.w[...], before, subnormals=not _CPU_EAGER_ADD_FLUSHES)
  assert int(jls.get_scale_state(optimizer.opt_state).skipped_steps) == 1
