"""torch.amp's surface beyond one loss and one optimizer (issue 16, item 7).

* ``scale_loss`` on any nesting of losses, as ``scaler.scale(outputs)``.
* Several optimizers, one scale: ``dynamic_loss_scale(optax.multi_transform(...))``
  against torch's ``scaler.step(opt0); scaler.step(opt1); scaler.update()``, bit for bit,
  overflow steps included; the one documented difference (torch skips only the optimizer whose
  gradients overflowed, the one wrapper skips every group) pinned down; the misuse that can be
  detected (several scalers in the state given to ``scale_loss``) refused.
"""

from helpers import import_torch
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_lossscale as jls

# --- scale_loss on pytrees ------------------------------------------------------------------


def test_scale_loss_scales_every_leaf_of_a_nested_tree(maybe_jit):
  state = jls.DynamicScaleState.create(init_scale=8.0)
  t = jnp.float32(1.5)
  h = jnp.float16(60000.0)  # * 8 overflows float16: promoted first
  b = jnp.asarray([0.25, -3.0], jnp.bfloat16)
  tree = (t, (h, t), [b, (t, {"aux": h})])
  out = maybe_jit(jls.scale_loss)(tree, state)
  assert jax.tree.structure(out) == jax.tree.structure(tree)
  want = [12.0, 480000.0, 12.0, [2.0, -24.0], 12.0, 480000.0]  # the leaves, in order
  for got, w in zip(jax.tree.leaves(out), want, strict=True):
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(w, np.float32))


def test_scale_loss_tree_leaf_is_the_single_loss_result(maybe_jit):
  state = jls.DynamicScaleState.create(init_scale=2.0**10)
  leaves = [jnp.float16(3.0), jnp.float32(-0.5), jnp.bfloat16(7.0), jnp.asarray([1.0, 2.0])]
  out = maybe_jit(jls.scale_loss)(leaves, state)
  for x, got in zip(leaves, out, strict=True):
    single = jls.scale_loss(x, state)
    assert got.dtype == single.dtype
    np.testing.assert_array_equal(np.asarray(got), np.asarray(single))


def test_scale_loss_tree_keeps_float64_under_x64():
  with jax.enable_x64(True):
    state = jls.DynamicScaleState.create(init_scale=4.0)
    out = jls.scale_loss({"a": jnp.float64(0.1), "b": jnp.float16(1.0)}, state)
    assert out["a"].dtype == jnp.float64 and float(out["a"]) == 0.1 * 4
    assert out["b"].dtype == jnp.float32 and float(out["b"]) == 4.0


@pytest.mark.parametrize(
  "bad, where",
  [
    ((jnp.float32(1.0), jnp.int32(3)), r"loss\[1\]"),
    ({"main": jnp.float32(1.0), "count": jnp.asarray([True])}, r"loss\['count'\]"),
    ([jnp.float32(1.0), (jnp.float32(2.0), jnp.uint8(1))], r"loss\[1\]\[1\]"),
  ],
)
def test_scale_loss_refuses_non_float_leaves_naming_them(bad, where):
  with pytest.raises(ValueError, match="loss must be a floating-point array.*" + where):
    jls.scale_loss(bad, jls.DynamicScaleState.create())


def test_scale_loss_refuses_an_empty_tree():
  with pytest.raises(ValueError, match="loss must hold at least one float array"):
    jls.scale_loss((), jls.DynamicScaleState.create())


def test_gradients_of_a_scaled_loss_tree_are_the_scaled_gradients(maybe_jit):
  """grad of sum(scale_loss((l0, l1))) == scale * (grad l0 + grad l1), exactly (powers of 2)."""
  tx = jls.dynamic_loss_scale(optax.sgd(0.5), init_scale=2.0**12)
  params = {"g": jnp.asarray([1.0, -2.0]), "d": jnp.asarray([0.5])}
  state = tx.init(params)

  def losses(p):
    return (jnp.sum(p["g"] * 3.0), [jnp.sum(p["d"] ** 2), jnp.sum(p["g"]) * 0.25])

  def step(params, state):
    grads = jax.grad(lambda p: sum(jax.tree.leaves(jls.scale_loss(losses(p), state))))(params)
    updates, state = tx.update(grads, state, params)
    return grads, optax.apply_updates(params, updates)

  grads, new = maybe_jit(step)(params, state)
  np.testing.assert_array_equal(grads["g"], np.float32(2.0**12) * np.asarray([3.25, 3.25]))
  np.testing.assert_array_equal(grads["d"], np.float32(2.0**12) * np.asarray([1.0]))
  np.testing.assert_array_equal(new["g"], np.asarray([1.0 - 1.625, -2.0 - 1.625], np.float32))
  np.testing.assert_array_equal(new["d"], np.asarray([0.0], np.float32))


# --- several optimizers, one scale ----------------------------------------------------------

LR = {"g": 1.0, "d": 0.5}  # powers of 2: lr * grad is exact, as torch's add(alpha=-lr) is
SHAPES = {"g": (3,), "d": (2, 2)}
CONFIG = dict(init_scale=2.0**10, growth_interval=3)


def _one_wrapper():
  """The supported form: one loss scaler over both param groups."""
  groups = optax.multi_transform({k: optax.sgd(lr) for k, lr in LR.items()}, {"g": "g", "d": "d"})
  return jls.dynamic_loss_scale(groups, **CONFIG)


def _scaled_grads(params, step, scale, poison):
  """float16(true * scale) of a seeded gradient that depends on the params, as float32 copies.

  ``poison`` names the groups whose gradients get a NaN/inf this step. Step 5 overflows
  float16 naturally in both groups.
  """
  rng = np.random.default_rng(step)
  out = {}
  for k in ("g", "d"):
    mag = np.float32(3e4 if step == 5 else 1.0)
    true = np.float32(0.5) * params[k] + mag * rng.normal(size=SHAPES[k]).astype(np.float32)
    with np.errstate(over="ignore"):
      g = (true.astype(np.float32) * np.float32(scale)).astype(np.float16).astype(np.float32)
    if k in poison:
      g.reshape(-1)[step % g.size] = np.nan if step % 2 else np.inf
    out[k] = g
  return out


def _run_both(poison_at, steps=24):
  """Torch's two SGDs under one GradScaler and the one wrapper, on the same gradients.

  Yields per step (torch params, torch scale, torch growth tracker, jax params, jax state).
  """
  torch = import_torch()
  init = {
    k: np.linspace(-1.0, 1.0, int(np.prod(s)), dtype=np.float32).reshape(s)
    for k, s in SHAPES.items()
  }
  tp = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in init.items()}
  opts = {k: torch.optim.SGD([tp[k]], lr=LR[k]) for k in ("g", "d")}
  scaler = torch.amp.GradScaler(
    "cpu", growth_interval=CONFIG["growth_interval"], init_scale=CONFIG["init_scale"]
  )
  tx = _one_wrapper()
  params = {k: jnp.asarray(v) for k, v in init.items()}
  state = tx.init(params)
  update = jax.jit(tx.update)
  for step in range(steps):
    scaler.scale(torch.tensor(1.0))  # torch's scale is made on first use
    scale = scaler.get_scale()
    assert scale == float(jls.get_scale_state(state).scale)
    poison = poison_at.get(step, ())
    torch_params = {k: tp[k].detach().numpy().copy() for k in tp}
    grads = _scaled_grads(torch_params, step, scale, poison)
    for k in ("g", "d"):
      tp[k].grad = torch.tensor(grads[k])
    scaler.step(opts["g"])
    scaler.step(opts["d"])
    scaler.update()
    jax_grads = _scaled_grads({k: np.asarray(v) for k, v in params.items()}, step, scale, poison)
    updates, state = update(jax_grads, state, params)
    params = optax.apply_updates(params, updates)
    yield step, {k: tp[k].detach().numpy() for k in tp}, scaler, params, state


@pytest.mark.torch
def test_one_wrapper_over_two_groups_matches_torchs_two_optimizers_bit_for_bit():
  """Overflow in both groups (natural at step 5, NaN/inf at 11 and 12): the same run as torch."""
  poison_at = {11: ("g", "d"), 12: ("g", "d")}
  skipped = 0
  for step, tparams, scaler, params, state in _run_both(poison_at):
    ls = jls.get_scale_state(state)
    assert float(ls.scale) == scaler.get_scale(), step
    assert int(ls.growth_tracker) == scaler._growth_tracker.item(), step
    for k in ("g", "d"):
      np.testing.assert_array_equal(np.asarray(params[k]), tparams[k], err_msg=f"{k} {step}")
    skipped = int(ls.skipped_steps)
  assert skipped == 3


@pytest.mark.torch
def test_overflow_in_one_group_skips_every_group_where_torch_steps_the_other():
  """The documented difference: torch skips only the optimizer whose gradients overflowed."""
  runs = _run_both({7: ("d",)}, steps=8)
  for step, tparams, scaler, params, state in runs:
    assert float(jls.get_scale_state(state).scale) == scaler.get_scale()  # both back off
    np.testing.assert_array_equal(np.asarray(params["d"]), tparams["d"])  # both skip "d"
    if step < 7:
      np.testing.assert_array_equal(np.asarray(params["g"]), tparams["g"])
  # At step 7 torch stepped "g" and the one wrapper did not: params differ by that one step.
  assert not np.array_equal(np.asarray(params["g"]), tparams["g"])
  assert int(jls.get_scale_state(state).skipped_steps) == 2  # step 5 (natural) and step 7


def test_scale_loss_refuses_a_state_with_two_scalers():
  """Two wrappers inside one multi_transform: which scale the loss needs is ambiguous."""
  tx = optax.multi_transform(
    {"g": jls.dynamic_loss_scale(optax.sgd(1.0)), "d": jls.dynamic_loss_scale(optax.sgd(1.0))},
    {"g": "g", "d": "d"},
  )
  state = tx.init({"g": jnp.zeros(2), "d": jnp.zeros(1)})
  with pytest.raises(ValueError, match=r"holds 2 loss scalers.*ONE dynamic_loss_scale\(optax"):
    jls.scale_loss(jnp.float32(1.0), state)
  with pytest.raises(ValueError, match="holds 2 loss scalers"):
    jax.jit(jls.scale_loss)((jnp.float32(1.0), jnp.float32(2.0)), state)
  # Each sub-state on its own is fine (separate scalers, each loss through its own).
  sub = state.inner_states["d"].inner_state
  assert float(jls.scale_loss(jnp.float32(1.0), sub)) == 65536.0
