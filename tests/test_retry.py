"""Retry on overflow (``jls.retry_on_overflow``, ``TrainState.retry_value_and_grad``).

The guarantee: a step that retries is, bit for bit, the run in which each
overflowing batch is fed again by hand at the backed-off scale (params, the
optimizer's state and every counter of the scaler), and ``max_retries=0`` is
today's step. Checked at every entry point the retry supports: the Optax
wrapper, ``multi_steps``, the Flax ``TrainState``, ``nnx.Optimizer``,
Equinox, ``shard_map`` with ``axis_name``, and autocast.
"""

from __future__ import annotations

import contextlib
import functools

from flax import nnx
from helpers import import_optional
from helpers import standard_promotion
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import jax_lossscale as jls
from jax_lossscale import flax as jls_flax
from jax_lossscale._scaler import _retry as jls_retry

F16 = jnp.float16
_UINT = {2: np.uint16, 4: np.uint32}


#: Every float16 op rounds to float16, as in torch. XLA:GPU's default (excess precision) may keep
#: a fused float16 intermediate in float32: measured on an H200, a float16 cotangent of 65536
#: then does not overflow, and two programs' SGD steps differ by one ulp. Both are XLA's
#: arithmetic, not the retry's, so the tests below that count overflows or compare two
#: programs bit for bit compile with this off (XLA:CPU gives the same results either way).
ROUND_EVERY_OP = {"xla_allow_excess_precision": False}


def _bits(tree):
  out = []
  for x in jax.tree_util.tree_leaves(tree):
    x = np.asarray(x)
    out.append(x.view(_UINT[x.dtype.itemsize]) if x.dtype.kind == "f" else x)
  return out


def assert_bits_equal(a, b):
  assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
  for x, y in zip(_bits(a), _bits(b)):
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(x, y)


def assert_same_program_results(a, b):
  """Two programs' results: bit for bit on XLA:CPU. XLA:GPU autotunes each program's matrix
  products on its own, and two programs can take algorithms that round a float16 gradient
  differently: measured on an H200, one leaf of the SGD storm below came out 1 to 3 float16
  ulps apart (relative 5e-4 to 1.6e-3) in one run of two. There, floating leaves are compared
  to 2^-8 relative and every integer leaf (the counters) exactly."""
  if jax.default_backend() != "gpu":
    return assert_bits_equal(a, b)
  assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype
    if x.dtype.kind == "f":
      np.testing.assert_allclose(x, y, rtol=2**-8, atol=1e-8)
    else:
      np.testing.assert_array_equal(x, y)


def counters(tree):
  s = jls.get_scale_state(tree)
  return (float(s.scale), int(s.growth_tracker), int(s.skipped_steps), int(s.consecutive_skips))


# A float16 loss whose backward overflows while scale * c >= 65520: with c = 4 at
# 2**16 the gradient is inf at 65536, 32768 and 16384 and finite (32768) at 8192.
UNROLLED = jls_retry.UNROLLED_RETRIES


def linear_loss(w, c):
  return jnp.sum(w.astype(F16) * c.astype(F16))


@pytest.mark.parametrize(
  ("max_retries", "retries", "applied", "scale", "skipped"),
  [
    (0, 0, False, 32768.0, 1),  # today's skip
    (1, 1, False, 16384.0, 2),
    (2, 2, False, 8192.0, 3),
    (3, 3, True, 8192.0, 3),  # the third retry, at 8192, is finite
    (5, 3, True, 8192.0, 3),  # no retry after a finite attempt
    (UNROLLED + 4, 3, True, 8192.0, 3),  # the same past the unrolled retries (a while loop)
  ],
)
def test_each_attempt_is_one_step_of_the_torch_rule(
  maybe_jit, max_retries, retries, applied, scale, skipped
):
  tx = jls.dynamic_loss_scale(optax.sgd(1.0), growth_interval=2)
  w = jnp.ones(2)
  c = jnp.full(2, 4.0)

  def step(w, opt_state):
    opt_state, out = jls.retry_on_overflow(linear_loss, opt_state, max_retries=max_retries)(w, c)
    updates, opt_state = tx.update(out.grads, opt_state, w)
    return optax.apply_updates(w, updates), opt_state, out

  new_w, opt_state, out = maybe_jit(step)(w, tx.init(w))
  assert out.retries.dtype == jnp.int32 and int(out.retries) == retries
  assert out.value.dtype == F16 and float(out.value) == 8.0
  # The counters of the sequence: `skipped` overflows, then a clean step if applied.
  assert counters(opt_state) == (scale, int(applied), skipped, 0 if applied else skipped)
  if applied:
    np.testing.assert_array_equal(new_w, w - 4.0)  # the batch, applied once
  else:
    assert_bits_equal(new_w, w)


@pytest.mark.parametrize("max_retries", [UNROLLED - 1, UNROLLED, UNROLLED + 1, UNROLLED + 4])
def test_retries_run_out_alike_unrolled_or_in_a_while_loop(max_retries):
  """Up to UNROLLED retries are fixed-trip conds, more a while loop: both stop at max_retries."""
  tx = jls.dynamic_loss_scale(optax.sgd(1.0), init_scale=2.0**40)
  w, c = jnp.ones(2), jnp.full(2, 4.0)
  opt_state, out = jax.jit(jls.retry_on_overflow(linear_loss, tx.init(w), max_retries=max_retries))(
    w, c
  )
  retry = jls.retry_on_overflow(linear_loss, tx.init(w), max_retries=max_retries)
  assert ("while" in str(jax.make_jaxpr(retry)(w, c))) == (max_retries > UNROLLED)
  # Every attempt, from 2**40 down to 2**(40 - max_retries), overflows (>= 16384); the state
  # is advanced past those before the last, whose gradients the update then skips.
  assert int(out.retries) == max_retries
  assert counters(opt_state) == (2.0 ** (40 - max_retries), 0, max_retries, max_retries)
  assert not np.isfinite(np.asarray(out.grads)).all()
  updates, opt_state = tx.update(out.grads, opt_state, w)
  assert counters(opt_state) == (2.0 ** (39 - max_retries), 0, max_retries + 1, max_retries + 1)
  assert_bits_equal(optax.apply_updates(w, updates), w)


def mlp_loss(params, x, y):
  h = jax.nn.relu(x.astype(F16) @ params["w1"].astype(F16) + params["b1"].astype(F16))
  out = (h @ params["w2"].astype(F16)).astype(jnp.float32)
  return jnp.mean((out - y) ** 2) + 0.0 * jnp.sum(params["edge"])


def mlp_params():
  k1, k2 = jax.random.split(jax.random.key(0))
  tiny = float(np.finfo(np.float32).smallest_subnormal)
  return {
    "w1": jax.random.normal(k1, (8, 16)) * 0.3,
    "b1": jnp.zeros(16),
    "w2": jax.random.normal(k2, (16, 1)) * 0.3,
    "edge": jnp.array([tiny, -tiny, -0.0, 0.0, 1.0]),  # subnormals and -0.0
  }


def storm():
  """Batches whose gradients overflow at 2**16 by 0 to 5 halvings."""
  keys = jax.random.split(jax.random.key(1), 10)
  gains = [0.1, 0.1, 1.0, 0.1, 3.0, 0.1, 0.1, 300.0, 0.1, 1.0]
  for key, gain in zip(keys, gains):
    x = jax.random.normal(key, (32, 8)) * gain
    yield x, jnp.sum(x, axis=1, keepdims=True) * 0.1


def refeed_by_hand(step, params, state, batch, max_retries):
  """The reference: today's step, fed the batch again while the rule backs off."""
  for _ in range(max_retries + 1):
    before = jls.get_scale_state(state)
    params, state = step(params, state, *batch)
    after = jls.get_scale_state(state)
    if int(after.skipped_steps) == int(before.skipped_steps):
      break  # applied
    if float(after.scale) == float(before.scale):
      break  # the rule did not back off: no retry
  return params, state


@pytest.mark.parametrize("max_retries", [0, 2, 4])
@pytest.mark.parametrize("optimizer", ["sgd-one-jit", "adam-update-jitted-apart"])
def test_a_storm_with_retries_equals_refeeding_the_batches_by_hand(max_retries, optimizer):
  """Params, optimizer state and every counter, bit for bit, batch after batch.

  With SGD the whole step is one jit (on a GPU, two programs: see
  :func:`assert_same_program_results`). With Adam the gradients and the update are
  jitted apart, and both runs share the update's program: XLA:CPU may round Adam's
  division differently by one ulp in two different programs (measured: a step with
  a retry loop against one without, on a batch that did not retry), which says
  nothing about the retry.
  """
  one_jit = optimizer == "sgd-one-jit"
  tx = jls.dynamic_loss_scale(optax.sgd(1e-2) if one_jit else optax.adam(1e-3), growth_interval=3)

  def update(params, opt_state, grads):
    with standard_promotion():  # optax.adam's b1 ** count
      updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def grads_of(params, opt_state, x, y):
    return jax.grad(lambda p: jls.scale_loss(mlp_loss(p, x, y), opt_state))(params)

  def retried(params, opt_state, x, y):
    retry = jls.retry_on_overflow(mlp_loss, opt_state, max_retries=max_retries)
    return retry(params, x, y)

  if one_jit:

    @functools.partial(jax.jit, compiler_options=ROUND_EVERY_OP)
    def plain_step(params, opt_state, x, y):
      return update(params, opt_state, grads_of(params, opt_state, x, y))

    @functools.partial(jax.jit, compiler_options=ROUND_EVERY_OP)
    def retry_step(params, opt_state, x, y):
      opt_state, out = retried(params, opt_state, x, y)
      return *update(params, opt_state, out.grads), out.retries

  else:
    update_jit, grads_jit, retried_jit = jax.jit(update), jax.jit(grads_of), jax.jit(retried)

    def plain_step(params, opt_state, x, y):
      return update_jit(params, opt_state, grads_jit(params, opt_state, x, y))

    def retry_step(params, opt_state, x, y):
      opt_state, out = retried_jit(params, opt_state, x, y)
      return *update_jit(params, opt_state, out.grads), out.retries

  params = ref_params = mlp_params()
  opt_state = ref_state = tx.init(params)
  all_retries = []
  for batch in storm():
    params, opt_state, retries = retry_step(params, opt_state, *batch)
    ref_params, ref_state = refeed_by_hand(plain_step, ref_params, ref_state, batch, max_retries)
    compare = assert_same_program_results if one_jit else assert_bits_equal
    compare((params, opt_state), (ref_params, ref_state))
    all_retries.append(int(retries))
  if one_jit:
    assert retry_step._cache_size() == 1  # no recompilation
  skipped = int(jls.get_scale_state(opt_state).skipped_steps)
  applied = int(opt_state.inner_state[0].count) if not one_jit else None
  if max_retries == 0:
    assert all_retries == [0] * 10 and skipped > 0
  else:
    assert max(all_retries) == max_retries  # a batch ran out of retries
    assert sum(r > 0 for r in all_retries) >= 3
  if applied is not None:  # each attempt is applied (once per batch at most) or skipped
    assert applied + skipped == 10 + sum(all_retries)


def test_max_retries_zero_builds_no_loop_and_gives_jax_grad_bit_for_bit():
  params = mlp_params()
  opt_state = jls.dynamic_loss_scale(optax.sgd(0.1)).init(params)
  x, y = next(storm())
  retry = jls.retry_on_overflow(mlp_loss, opt_state, max_retries=0)
  jaxpr = jax.make_jaxpr(retry)(params, x, y)
  assert "while" not in str(jaxpr) and "cond" not in str(jaxpr) and "scan" not in str(jaxpr)
  new_state, out = retry(params, x, y)
  ref = jax.grad(lambda p: jls.scale_loss(mlp_loss(p, x, y), opt_state))(params)
  assert_bits_equal(out.grads, ref)
  assert_bits_equal(new_state, opt_state)
  assert "cond" in str(jax.make_jaxpr(jls.retry_on_overflow(mlp_loss, opt_state))(params, x, y))


@pytest.mark.parametrize(
  "make",
  [
    pytest.param(lambda: jls.static_loss_scale(optax.sgd(1.0), 2.0**16), id="static"),
    pytest.param(lambda: jls.dynamic_loss_scale(optax.sgd(1.0), hysteresis=2), id="hysteresis"),
    pytest.param(
      lambda: jls.dynamic_loss_scale(optax.sgd(1.0), init_scale=2.0**16, min_scale=2.0**16),
      id="min_scale",
    ),
  ],
)
def test_no_retry_where_the_rule_keeps_the_scale(maybe_jit, make):
  tx = make()
  w, c = jnp.ones(2), jnp.full(2, 4.0)
  state = tx.init(w)
  new_state, out = maybe_jit(jls.retry_on_overflow(linear_loss, state, max_retries=3))(w, c)
  assert int(out.retries) == 0
  assert_bits_equal(new_state, state)


def test_hysteresis_retries_once_the_budget_is_spent():
  tx = jls.dynamic_loss_scale(optax.sgd(1.0), hysteresis=2)
  w, c = jnp.ones(2), jnp.full(2, 4.0)
  state = tx.init(w)
  for expected in [0, 3]:  # the first overflow is tolerated, the second backs off
    state, out = jls.retry_on_overflow(linear_loss, state, max_retries=3)(w, c)
    assert int(out.retries) == expected
    _, state = tx.update(out.grads, state, w)
  assert counters(state)[0] == 8192.0


def test_multi_steps_rescales_the_accumulated_gradients_exactly():
  """A retried micro-batch: the window equals one run at the final scale from its start."""

  def make(scale):
    return jls.multi_steps(jls.dynamic_loss_scale(optax.sgd(0.5), init_scale=scale), 3)

  w = jnp.array([1.0, -0.0, 2.0])
  micro = [jnp.full(3, 8.0), jnp.full(3, 200.0), jnp.full(3, 3.0)]  # 200 * 1024 overflows

  def run(tx, retry):
    state, p = tx.init(w), w
    retries = []
    for c in micro:
      if retry:
        state, out = jls.retry_on_overflow(linear_loss, state)(p, c)
        grads = out.grads
        retries.append(int(out.retries))
      else:
        grads = jax.grad(lambda q, c=c, s=state: jls.scale_loss(linear_loss(q, c), s))(p)
      with standard_promotion():  # optax.MultiSteps mixes int32 and floats
        updates, state = tx.update(grads, state, p)
      p = optax.apply_updates(p, updates)
    return p, state, retries

  p, state, retries = run(make(1024.0), retry=True)
  ref_p, ref_state, _ = run(make(256.0), retry=False)
  assert retries == [0, 2, 0]
  assert_bits_equal(p, ref_p)
  # The mean of the window (optax's accumulation rounds it by version: to 1e-6).
  np.testing.assert_allclose(p, w - 0.5 * (8.0 + 200.0 + 3.0) / 3, rtol=1e-6)
  assert counters(state) == (256.0, 1, 2, 0)
  assert counters(ref_state) == (256.0, 1, 0, 0)


def test_multi_steps_accumulator_is_untouched_without_a_retry():
  tx = jls.multi_steps(jls.dynamic_loss_scale(optax.sgd(0.5), init_scale=1024.0), 3)
  w = jnp.zeros(2)
  state = tx.init(w)
  tiny = float(np.finfo(np.float32).smallest_subnormal)
  acc = jnp.array([tiny, -0.0])  # flushed by any multiply on XLA:CPU
  state = state._replace(acc_grads=acc)
  new_state, out = jax.jit(jls.retry_on_overflow(linear_loss, state))(w, jnp.ones(2))
  assert int(out.retries) == 0
  assert_bits_equal(new_state.acc_grads, acc)


def test_a_retry_rescales_only_the_float_leaves_of_the_accumulator():
  # Two retries take the scale from 1024 to 256: the float gradients accumulated so far
  # are multiplied by 1/4, an integer leaf beside them (a count) is left as it is.
  tx = jls.multi_steps(jls.dynamic_loss_scale(optax.sgd(0.5), init_scale=1024.0), 3)
  w = jnp.zeros(2)
  acc = {"g": jnp.array([8.0, -12.0]), "n": jnp.array([3, 7], jnp.int32)}
  state = tx.init(w)._replace(acc_grads=acc)
  new_state, out = jax.jit(jls.retry_on_overflow(linear_loss, state))(w, jnp.full(2, 200.0))
  assert int(out.retries) == 2 and counters(new_state)[0] == 256.0
  assert_bits_equal(new_state.acc_grads, {"g": jnp.array([2.0, -3.0]), "n": acc["n"]})


def test_keyword_arguments_reach_the_loss_in_every_attempt():
  state = jls.dynamic_loss_scale(optax.sgd(0.5), init_scale=2.0**16).init(jnp.zeros(2))
  w, c = jnp.array([1.0, 2.0]), jnp.full(2, 4.0)
  by_keyword = lambda w, *, c: linear_loss(w, c)
  kw_state, kw = jls.retry_on_overflow(by_keyword, state, max_retries=3)(w, c=c)
  pos_state, pos = jls.retry_on_overflow(linear_loss, state, max_retries=3)(w, c)
  assert int(kw.retries) == int(pos.retries) == 3
  assert_bits_equal((kw_state, kw), (pos_state, pos))


def test_train_state_retry_equals_refeeding_by_hand():
  params = mlp_params()

  def create():
    return jls_flax.TrainState.create(
      apply_fn=None,
      params=params,
      tx=optax.adam(1e-3),
      dynamic_scale=jls.DynamicScaleState.create(growth_interval=3),
    )

  @jax.jit
  def plain_step(state, x, y):
    out = state.value_and_grad(mlp_loss)(state.params, x, y)
    with standard_promotion():
      return None, state.apply_gradients(grads=out.grads, finite=out.finite)

  @jax.jit
  def retry_step(state, x, y):
    state, out = state.retry_value_and_grad(mlp_loss, max_retries=3)(state.params, x, y)
    with standard_promotion():
      return state.apply_gradients(grads=out.grads, finite=out.finite)

  state = ref = create()
  step = lambda _, s, x, y: plain_step(s, x, y)
  for batch in storm():
    state = retry_step(state, *batch)
    _, ref = refeed_by_hand(step, None, ref, batch, 3)
    assert_bits_equal(state, ref)
  assert int(state.dynamic_scale.skipped_steps) >= 5
  assert int(state.step) + int(state.dynamic_scale.skipped_steps) > 10  # retries happened


def test_train_state_retry_of_zero_is_value_and_grad_bit_for_bit():
  state = jls_flax.TrainState.create(apply_fn=None, params=mlp_params(), tx=optax.sgd(0.1))
  x, y = list(storm())[3]
  new, out = state.retry_value_and_grad(mlp_loss, max_retries=0)(state.params, x, y)
  ref = state.value_and_grad(mlp_loss)(state.params, x, y)
  assert_bits_equal(out, ref)
  assert_bits_equal(new, state)


def test_train_state_retry_passes_argnums_has_aux_and_keyword_arguments():
  state = jls_flax.TrainState.create(
    apply_fn=None,
    params={"w": jnp.ones(2)},
    tx=optax.sgd(0.1),
    dynamic_scale=jls.DynamicScaleState.create(init_scale=8.0),
  )
  loss_fn = lambda p, x, *, k: (k * jnp.sum(p["w"] * x**2), 2 * x)
  x = jnp.array([1.0, 3.0])
  fn = state.retry_value_and_grad(loss_fn, max_retries=2, argnums=1, has_aux=True)
  new, out = fn(state.params, x, k=2.0)
  assert float(out.value) == 20.0
  np.testing.assert_array_equal(out.aux, np.array([2.0, 6.0], np.float32))
  np.testing.assert_array_equal(out.grads, np.array([4.0, 12.0], np.float32))  # d/dx
  assert bool(out.finite) and float(new.dynamic_scale.scale) == 8.0


def test_train_state_retry_averages_the_gradients_over_axis_name():
  state = jls_flax.TrainState.create(apply_fn=None, params=jnp.ones(3), tx=optax.sgd(0.1))

  def per_example(w, x):
    _, out = state.retry_value_and_grad(lambda w: jnp.sum(w * x), axis_name="batch")(w)
    return out.grads, out.finite

  x = jnp.arange(12, dtype=jnp.float32).reshape(4, 3)
  grads, finite = jax.vmap(per_example, in_axes=(None, 0), axis_name="batch")(state.params, x)
  # pmean over the axis: every example holds the mean gradient.
  np.testing.assert_array_equal(grads, np.broadcast_to(np.mean(np.asarray(x), 0), (4, 3)))
  assert np.all(np.asarray(finite))


def test_nnx_optimizer_retries_and_keeps_its_variables():
  model = nnx.Linear(2, 1, dtype=F16, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, jls.dynamic_loss_scale(optax.sgd(0.1)), wrt=nnx.Param)
  x = jnp.full((2, 2), 2.0, F16)

  @nnx.jit
  def step(model, optimizer, x):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params):
      return jnp.sum(nnx.merge(graphdef, params, rest)(x))

    optimizer.opt_state, out = jls.retry_on_overflow(loss_fn, optimizer.opt_state)(params)
    optimizer.update(model, out.grads)
    return out.retries

  kernel = np.asarray(model.kernel[...])
  # d/dkernel = sum over the batch of x = 4 per element: 4 * S overflows down to 8192.
  assert int(step(model, optimizer, x)) == 3
  assert counters(optimizer.opt_state) == (8192.0, 1, 3, 0)
  assert isinstance(jls.get_scale_state(optimizer.opt_state).scale, nnx.Variable)
  np.testing.assert_allclose(np.asarray(model.kernel[...]), kernel - 0.4, rtol=1e-3)


def test_equinox_model_partitioned_retries():
  eqx = import_optional("equinox")
  model = eqx.nn.Linear(2, 1, key=jax.random.key(0))
  params, static = eqx.partition(model, eqx.is_array)
  tx = jls.dynamic_loss_scale(optax.sgd(0.1))
  opt_state = tx.init(params)
  x = jnp.full((2, 2), 2.0)

  @functools.partial(jax.jit, compiler_options=ROUND_EVERY_OP)
  def step(params, opt_state):
    def loss_fn(params):
      m = eqx.combine(params, static)
      return jnp.sum(jax.vmap(m)(x).astype(F16))

    opt_state, out = jls.retry_on_overflow(loss_fn, opt_state)(params)
    updates, opt_state = tx.update(out.grads, opt_state, params)
    return eqx.apply_updates(params, updates), opt_state, out.retries

  new, opt_state, retries = step(params, opt_state)
  assert int(retries) == 1  # the float16 loss's cotangent: 65536 overflows, 32768 does not
  np.testing.assert_allclose(new.weight, params.weight - 0.1 * 4.0, rtol=1e-6)


def test_autocast_loss_retries():
  def plain(w, x):  # float32 as written; autocast runs the matmul in float16
    return jnp.sum(x @ w)

  w, x = jnp.ones((4, 1)), jnp.full((8, 4), 0.25)
  tx = jls.dynamic_loss_scale(optax.sgd(1e-3))
  state = tx.init(w)
  new_state, out = jax.jit(jls.retry_on_overflow(jls.autocast(plain), state))(w, x)
  # The float32 sum's cotangent reaches the float16 matmul as the scale (inf at 65536),
  # and d/dw = 2 * scale in float16 (inf at 32768): finite from 16384 down.
  assert int(out.retries) == 2
  assert out.grads.dtype == jnp.float32
  assert counters(new_state)[0] == 16384.0
  np.testing.assert_array_equal(out.grads, np.full((4, 1), 2.0 * 16384.0))
  assert bool(jnp.all(jnp.isfinite(out.grads)))


def test_shard_map_takes_one_retry_decision_on_every_device():
  if jax.device_count() < 8:  # a one-GPU machine (make gpu-check); CPU runs have eight
    pytest.skip("needs eight devices")
  mesh = jax.make_mesh((8,), ("d",))
  sharded = lambda x: jax.device_put(x, jax.sharding.NamedSharding(mesh, P("d")))
  tx = jls.dynamic_loss_scale(optax.sgd(1.0), axis_name="d")
  state = tx.init(jnp.ones(2))
  w = sharded(jnp.ones((8, 2)))  # a copy per device: its gradient is the device's own
  c = sharded(jnp.ones((8, 2)).at[5].set(4.0))  # only device 5 overflows, down to 8192

  def per_device(w, state, c):
    state, out = jls.retry_on_overflow(linear_loss, state, axis_name="d")(w[0], c[0])
    grads = jax.lax.pmean(out.grads, "d")
    updates, state = tx.update(grads, state, w[0])
    return optax.apply_updates(w[0], updates)[None], state, out.retries

  f = jax.jit(
    jax.shard_map(
      per_device, mesh=mesh, in_specs=(P("d"), P(), P("d")), out_specs=(P("d"), P(), P())
    )
  )
  new_w, state, retries = f(w, state, c)
  assert int(retries) == 3
  assert counters(state) == (8192.0, 1, 3, 0)
  np.testing.assert_array_equal(new_w, np.full((8, 2), 1.0 - (7 * 1.0 + 4.0) / 8))


def test_bad_arguments_are_refused_naming_them():
  state = jls.DynamicScaleState.create()
  with pytest.raises(ValueError, match="max_retries"):
    jls.retry_on_overflow(linear_loss, state, max_retries=-1)
  with pytest.raises(TypeError, match="max_retries"):
    jls.retry_on_overflow(linear_loss, state, max_retries=2.0)
  with pytest.raises(TypeError, match="fun must be callable"):
    jls.retry_on_overflow(None, state)
  with pytest.raises(ValueError, match="No DynamicScaleState"):
    jls.retry_on_overflow(linear_loss, {"a": jnp.zeros(1)})
  ts = jls_flax.TrainState.create(apply_fn=None, params=jnp.ones(1), tx=optax.sgd(1.0))
  with pytest.raises(ValueError, match="max_retries"):
    ts.retry_value_and_grad(linear_loss, max_retries=-2)
  with pytest.raises(TypeError, match="has_aux=True"):
    jls.retry_on_overflow(linear_loss, state, has_aux=True)(jnp.ones(1), jnp.ones(1))


def test_aux_and_argnums_come_from_the_last_attempt():
  state = jls.DynamicScaleState.create()

  def fun(c, w):
    return linear_loss(w, c), {"scale_seen": jnp.float32(1.0)}

  new, out = jls.retry_on_overflow(fun, state, argnums=(0, 1), has_aux=True)(
    jnp.full(2, 4.0), jnp.ones(2)
  )
  assert isinstance(out.grads, tuple) and len(out.grads) == 2
  np.testing.assert_array_equal(out.grads[1], np.full(2, 4.0 * 8192.0))
  np.testing.assert_array_equal(out.grads[0], np.full(2, 8192.0))
  assert out.aux == {"scale_seen": jnp.float32(1.0)}
  assert float(new.scale) == 8192.0


def _probe_loss():
  """A loss whose scaled-loss gradient at scale S is ``float16(true * S)`` with forced values.

  ``mask`` (1.0 where a value is forced) and ``vals`` (the forced inf/NaN) poison the
  float16 gradient at any scale, as ``torch_side_by_side.Step.scaled`` does.
  """

  @jax.custom_vjp
  def probe(params, true, mask, vals):
    return jnp.zeros([], jnp.float32)

  def fwd(params, true, mask, vals):
    return probe(params, true, mask, vals), (true, mask, vals)

  def bwd(res, ct):
    true, mask, vals = res
    grads = [
      jnp.where(m > 0, v.astype(F16), (t * ct).astype(F16)).astype(jnp.float32)
      for t, m, v in zip(true, mask, vals)
    ]
    zeros = lambda xs: [jnp.zeros_like(x) for x in xs]
    return grads, zeros(true), zeros(mask), zeros(vals)

  probe.defvjp(fwd, bwd)
  return probe


def test_retries_equal_torch_gradscaler_fed_each_overflowing_batch_again():
  """The real torch.amp.GradScaler, its batch re-fed by hand on the host, against one jitted step."""
  torch = import_optional("torch")
  import torch_side_by_side as sbs

  max_retries = 3
  config = {"init_scale": 2.0**15, "growth_interval": 3}
  seq = sbs.make_sequence(seed=11, steps=40, magnitudes=(1e-3, 2.0), overflow_runs=4, max_run=1)

  # torch: the batch fed again while the step was skipped and the scale backed off.
  params = [torch.zeros(s, dtype=torch.float32, requires_grad=True) for s in sbs.SHAPES]
  opt = torch.optim.SGD(params, lr=1.0)
  scaler = torch.amp.GradScaler("cpu", **config)
  torch_trace = []
  for batch in seq:
    retries = 0
    while True:
      scaler.scale(torch.ones(()))
      before = scaler.get_scale()
      for p, g in zip(params, batch.scaled(before)):
        p.grad = torch.tensor(g.astype(np.float32))
      scaler.unscale_(opt)
      found = sum(
        v.item() for v in scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values()
      )
      scaler.step(opt)
      scaler.update()
      if not found or retries == max_retries or scaler.get_scale() == before:
        break
      retries += 1
    torch_trace.append(
      (
        retries,
        np.float32(scaler.get_scale()),
        int(scaler._growth_tracker.item()),
        [p.detach().numpy().copy() for p in params],
      )
    )

  # jax: one jitted step per batch.
  tx = jls.dynamic_loss_scale(optax.sgd(1.0), **config)
  probe = _probe_loss()

  @jax.jit
  def step(params, state, true, mask, vals):
    retry = jls.retry_on_overflow(probe, state, max_retries=max_retries)
    state, out = retry(params, true, mask, vals)
    updates, state = tx.update(out.grads, state, params)
    return optax.apply_updates(params, updates), state, out.retries

  jparams = [jnp.zeros(s, jnp.float32) for s in sbs.SHAPES]
  state = tx.init(jparams)
  total_retries = 0
  for t, batch in enumerate(seq):
    mask = [np.zeros(s, np.float32) for s in sbs.SHAPES]
    vals = [np.zeros(s, np.float32) for s in sbs.SHAPES]
    for i, pos, value in batch.poison:
      mask[i].reshape(-1)[pos] = 1.0
      vals[i].reshape(-1)[pos] = value
    jparams, state, retries = step(jparams, state, batch.true, mask, vals)
    t_retries, t_scale, t_tracker, t_params = torch_trace[t]
    assert int(retries) == t_retries, f"batch {t}"
    s = jls.get_scale_state(state)
    sbs.assert_same_bits(s.scale, t_scale, f"batch {t}: scale")
    assert int(s.growth_tracker) == t_tracker, f"batch {t}"
    for i, (p, q) in enumerate(zip(jparams, t_params)):
      sbs.assert_same_bits(p, q, f"batch {t}: param leaf {i}", flush=True)
    total_retries += t_retries
  assert total_retries >= 5  # natural overflows after growth, and forced ones
  assert any(r == max_retries for r, *_ in torch_trace)  # a forced inf outlasts the retries


@pytest.mark.parametrize("axis_type", ["explicit", "auto"])
@pytest.mark.parametrize("wrapper", ["dynamic", "multi_steps"])
def test_sharded_params_retry_as_unsharded_ones_and_keep_their_sharding(axis_type, wrapper):
  """Under plain jit on a mesh (Explicit and Auto axes): the same bits as on one device."""
  if jax.device_count() < 8:
    pytest.skip("needs eight devices")
  from jax.sharding import AxisType
  from jax.sharding import NamedSharding

  kind = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}[axis_type]
  mesh = jax.make_mesh((8,), ("d",), axis_types=(kind,))
  tiny = float(np.finfo(np.float32).smallest_subnormal)
  w = jnp.ones(16).at[3].set(tiny).at[12].set(-0.0)  # in the shards of devices 1 and 6
  c = jnp.ones(16).at[5].set(4.0)  # device 2's shard overflows down to 8192
  inner = optax.sgd(0.5)
  tx = (
    jls.dynamic_loss_scale(inner)
    if wrapper == "dynamic"
    else jls.multi_steps(jls.dynamic_loss_scale(inner), 2)
  )

  def run(w, c):
    @jax.jit
    def step(w, state):
      state, out = jls.retry_on_overflow(linear_loss, state)(w, c)
      with standard_promotion():  # optax.MultiSteps mixes int32 and floats
        updates, state = tx.update(out.grads, state, w)
      return optax.apply_updates(w, updates), state, out.retries

    state, retries = tx.init(w), []
    for _ in range(2):
      w, state, r = step(w, state)
      retries.append(int(r))
    return w, state, retries

  ref_w, ref_state, ref_retries = run(w, c)
  shard = NamedSharding(mesh, P("d"))
  ctx = jax.set_mesh(mesh) if kind == AxisType.Explicit else contextlib.nullcontext()
  with ctx:
    new_w, state, retries = run(jax.device_put(w, shard), jax.device_put(c, shard))
  assert retries == ref_retries == [3, 0]
  assert_bits_equal((new_w, state), (ref_w, ref_state))
  assert new_w.sharding.spec == P("d")
