"""What XLA compiles a donated train step into: no up-front copy of the optimizer state.

A skipped step must leave the optimizer state bit-identical, so it is
selected with ``jnp.where``. Written naively, XLA on CPU copies every moment
buffer at the start of the step (see ``jax_lossscale/_scaler/_skip.py``); these tests
read the compiled HLO and count full-size copies. The naive formulation is
compiled too, as a control that the count detects the copies.
"""

import re

from helpers import standard_promotion
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_lossscale as jls
from jax_lossscale import flax as jls_flax
from jax_lossscale._scaler._skip import LARGE

pytestmark = pytest.mark.skipif(
  jax.default_backend() != "cpu", reason="the copies are an XLA:CPU property"
)

WIDTHS = [256, 512, 256, 10]  # two weight matrices of 2 * LARGE elements
BIG = LARGE  # smaller leaves are left to XLA (copying them is cheap)
_COPY = re.compile(r"=\s*\w+\[([0-9,]*)\]\{[^}]*\}\s+copy\(")


def _params():
  rng = np.random.default_rng(0)
  return {
    f"l{i}": {
      "w": jnp.asarray(rng.standard_normal((a, b)), jnp.float32) / np.float32(np.sqrt(a)),
      "b": jnp.zeros((b,), jnp.float32),
    }
    for i, (a, b) in enumerate(zip(WIDTHS[:-1], WIDTHS[1:]))
  }


def _batch():
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((8, WIDTHS[0])), jnp.float16)
  y = jnp.asarray(rng.integers(0, WIDTHS[-1], 8), jnp.int32)
  return x, y


def _loss(params, x, y):
  h = x
  for i in range(len(WIDTHS) - 1):
    layer = params[f"l{i}"]
    h = h @ layer["w"].astype(jnp.float16) + layer["b"].astype(jnp.float16)
    if i < len(WIDTHS) - 2:
      h = jnp.tanh(h)
  return optax.softmax_cross_entropy_with_integer_labels(h.astype(jnp.float32), y).mean()


def _entry_lines(compiled):
  lines = compiled.as_text().splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith("ENTRY"))
  end = next(i for i in range(start, len(lines)) if lines[i].startswith("}"))
  return lines[start:end]


def _big_copies(compiled) -> int:
  """Full-size copies in the step itself (copies inside fusions are layout changes)."""
  count = 0
  for line in _entry_lines(compiled):
    m = _COPY.search(line)
    if m and m.group(1) and np.prod([int(d) for d in m.group(1).split(",")]) >= BIG:
      count += 1
  return count


def _compile(step, state):
  x, y = _batch()
  with standard_promotion():  # optax.adam is not strict-promotion clean
    return jax.jit(step, donate_argnums=(0,)).lower(state, x, y).compile()


def _naive_step(tx):
  """dynamic scaling written as Flax's examples do: plain where on the new state."""

  def step(state, x, y):
    params, opt_state, scale = state
    grads = jax.grad(lambda p: _loss(p, x, y) * scale)(params)
    grads = jax.tree_util.tree_map(lambda g: g * (1 / scale), grads)
    finite = jls.all_finite(grads)
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    pick = lambda a, b: jax.tree_util.tree_map(lambda u, v: jnp.where(finite, u, v), a, b)
    return (pick(new_params, params), pick(new_opt_state, opt_state), scale)

  return step


def _compile_dynamic_loss_scale_step():
  tx = jls.dynamic_loss_scale(optax.adam(1e-3))
  params = _params()

  def step(state, x, y):
    params, opt_state = state
    grads = jax.grad(lambda p: jls.scale_loss(_loss(p, x, y), opt_state))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return _compile(step, (params, tx.init(params)))


def test_control_naive_where_copies_the_moments():
  tx = optax.adam(1e-3)
  params = _params()
  compiled = _compile(_naive_step(tx), (params, tx.init(params), jnp.float32(1024)))
  assert _big_copies(compiled) >= 2  # the detector sees XLA's copies of mu / nu


def test_dynamic_loss_scale_step_has_no_state_copy():
  assert _big_copies(_compile_dynamic_loss_scale_step()) == 0


def test_flax_train_state_step_has_no_state_copy():
  state = jls_flax.TrainState.create(
    apply_fn=None,
    params=_params(),
    tx=optax.adam(1e-3),
    dynamic_scale=jls.DynamicScaleState.create(),
  )

  def step(state, x, y):
    out = state.value_and_grad(_loss)(state.params, x, y)
    return state.apply_gradients(grads=out.grads, finite=out.finite)

  assert _big_copies(_compile(step, state)) == 0


def test_ordering_follows_the_compiled_platform_not_the_default_backend(monkeypatch):
  """A step jitted onto CPU devices on a host whose default backend is another one.

  The old check asked ``jax.default_backend()``: with it saying "gpu" the CPU
  step lost its ordering and XLA:CPU copied every moment again. The platform
  the step is lowered for decides now.
  """
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  cpu = jax.devices("cpu")[0]
  tx = jls.dynamic_loss_scale(optax.adam(1e-3))
  params = jax.device_put(_params(), cpu)

  def step(state, x, y):
    params, opt_state = state
    grads = jax.grad(lambda p: jls.scale_loss(_loss(p, x, y), opt_state))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  x, y = jax.device_put(_batch(), cpu)
  with standard_promotion():
    compiled = jax.jit(step, donate_argnums=(0,)).lower((params, tx.init(params)), x, y).compile()
  assert _big_copies(compiled) == 0
  assert "conditional(" not in compiled.as_text()  # the platform choice is gone by then


def _ordering_ops(platforms, params=None) -> int:
  """``or`` ops (the ordering flags' ``bits | 1``) in the step exported for ``platforms``."""
  tx = jls.dynamic_loss_scale(optax.adam(1e-3))
  params = _params() if params is None else params

  def step(params, opt_state, grads):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  with standard_promotion():
    exported = jax.export.export(jax.jit(step), platforms=platforms)(
      params, tx.init(params), params
    )
  return exported.mlir_module().count("stablehlo.or ")


def test_other_platforms_get_plain_selects():
  """Lowered for CUDA (here, without a GPU) the skip is plain wheres; for CPU it is ordered."""
  plain = _ordering_ops(["cuda"])
  assert _ordering_ops(["cpu"]) >= plain + 2  # one flag per large leaf (two here)
  # Exported for both, both variants are kept until the compiler's platform is known.
  assert _ordering_ops(["cpu", "cuda"]) >= plain + 2


def test_a_leaf_of_exactly_large_elements_is_ordered_and_one_fewer_is_not():
  """The threshold is inclusive: ``LARGE`` elements get an ordering flag on CPU."""
  ors = lambda n: _ordering_ops(["cpu"], {"w": jnp.zeros(n, jnp.float32)})
  plain = ors(8)
  assert ors(LARGE - 1) == plain
  assert ors(LARGE) == plain + 1


def test_unscaling_does_not_copy_the_reciprocal_into_every_fusion():
  """The compiled step grows by a bounded factor over plain Adam's, not by the long division.

  The reciprocal of the scale is ~200 scalar integer ops; XLA:CPU copied them
  into each fusion that unscales a gradient until they ended in a division
  (100 leaves: 33.8k lines against plain Adam's 5.7k; 12.8k with it).
  """

  def lines(tx, n=100):
    params = {f"l{i:03d}": jnp.zeros((4,), jnp.float32) for i in range(n)}

    def step(params, opt_state, grads):
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    with standard_promotion():
      compiled = jax.jit(step).lower(params, tx.init(params), params).compile()
    return len(compiled.as_text().splitlines())

  plain, scaled = lines(optax.adam(0.1)), lines(jls.dynamic_loss_scale(optax.adam(0.1)))
  assert scaled <= 3 * plain, (plain, scaled)
