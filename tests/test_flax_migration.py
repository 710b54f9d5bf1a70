"""Coming from Flax's ``DynamicScale``: the misuses a migration meets are refused with directions.

* The half-migration: upstream's skip block kept after :meth:`TrainState.apply_gradients`
  (``new_state.replace(..., dynamic_scale=dynamic_scale)``) would write the scale state of before
  the step back, and the scale would never back off. Refused, under ``jit`` and without.
* Flax's unpacking of the old result ``(dynamic_scale, is_fin, aux, grads)`` applied to
  :class:`ScaledValueAndGrad` ``(value, aux, grads, finite)``: the ``finite`` flag passed as
  ``grads`` and the loss passed as ``dynamic_scale`` get errors that say what changed.
* ``state.dynamic_scale.value_and_grad`` (Flax's method on the scale object) says where it went.
* ``jls.flax`` is an attribute of the package, imported on first use.
* Scaling switched off in the TrainState (Flax's ``dynamic_scale=None`` path): bit-identical to
  Flax's stock TrainState.
"""

import difflib
import functools
import pathlib
import re
import subprocess
import sys

import flax.linen
import flax.training.train_state
from helpers import assert_bits_equal
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_lossscale as jls
from jax_lossscale.flax import TrainState

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _state(**kwargs):
  return TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd(0.5), **kwargs)


def _loss(params, x):
  return jnp.sum((params["w"] * x) ** 2)


def half_migrated_step(state, x):
  """Flax's ImageNet step with only the state swapped: its skip block is kept."""
  dynamic_scale = state.dynamic_scale
  out = state.value_and_grad(_loss)(state.params, x)
  is_fin = out.finite
  new_state = state.apply_gradients(grads=out.grads, finite=is_fin)
  new_state = new_state.replace(
    opt_state=jax.tree_util.tree_map(
      functools.partial(jnp.where, is_fin), new_state.opt_state, state.opt_state
    ),
    params=jax.tree_util.tree_map(
      functools.partial(jnp.where, is_fin), new_state.params, state.params
    ),
    dynamic_scale=dynamic_scale,
  )
  return new_state


def test_the_half_migration_is_refused(maybe_jit):
  state = _state()
  with pytest.raises(ValueError, match="writes back the scale state from before apply_gradients"):
    maybe_jit(half_migrated_step)(state, jnp.array([jnp.inf, 1.0]))


def test_the_half_migration_is_refused_for_a_copy_of_the_old_scale_state():
  state = _state()
  new = state.apply_gradients(grads={"w": jnp.array([jnp.inf, 1.0])})
  copy = jax.tree.map(lambda a: a, state.dynamic_scale)  # same leaves, another object
  with pytest.raises(ValueError, match="delete Flax's"):
    new.replace(dynamic_scale=copy)


def where_merged_step(state, x):
  """The half-migration that keeps the skip block but merges the scale state with
  ``jnp.where(is_fin, new, old)``, as it merges params and opt_state."""
  out = state.value_and_grad(_loss)(state.params, x)
  is_fin = out.finite
  new_state = state.apply_gradients(grads=out.grads, finite=is_fin)
  keep_if_fin = lambda new, old: jax.tree_util.tree_map(
    functools.partial(jnp.where, is_fin), new, old
  )
  return new_state.replace(
    opt_state=keep_if_fin(new_state.opt_state, state.opt_state),
    params=keep_if_fin(new_state.params, state.params),
    dynamic_scale=keep_if_fin(new_state.dynamic_scale, state.dynamic_scale),
  )


def test_the_half_migration_merging_the_scale_with_where_is_harmless(maybe_jit):
  """On the skipped step ``jnp.where(is_fin, new, old)`` selects the old scale state: its
  values are replaced by the backed-off ones, so the scale backs off as without the block."""
  merged, plain = _state(), _state()
  plain_step = maybe_jit(
    lambda s, x: s.apply_gradients(grads=s.value_and_grad(_loss)(s.params, x).grads)
  )
  merged_step = maybe_jit(where_merged_step)
  scales = []
  for x in ([jnp.inf, 1.0], [1.0, 1.0], [jnp.nan, 1.0], [1.0, 0.5]):
    merged, plain = merged_step(merged, jnp.array(x)), plain_step(plain, jnp.array(x))
    assert_bits_equal(merged.dynamic_scale, plain.dynamic_scale)
    assert_bits_equal((merged.params, merged.opt_state), (plain.params, plain.opt_state))
    scales.append(float(merged.dynamic_scale.scale))
  assert scales == [32768.0, 32768.0, 16384.0, 16384.0]  # backed off twice: not 65536 throughout
  assert int(merged.dynamic_scale.skipped_steps) == 2 and int(merged.step) == 2


def test_a_deliberate_scale_state_equal_to_another_config_is_kept():
  """Only a state with the pre-step config and values is taken as written back."""
  state = _state()
  new = state.apply_gradients(grads={"w": jnp.array([jnp.inf, 1.0])})
  other = jls.DynamicScaleState.create(growth_interval=7)  # 65536 as before, another config
  assert new.replace(dynamic_scale=other).dynamic_scale is other
  same_values = jax.tree.map(jnp.copy, state.dynamic_scale)  # new leaves, the pre-step values
  assert float(new.replace(dynamic_scale=same_values).dynamic_scale.scale) == 32768.0


def test_deliberate_scale_state_changes_still_work(maybe_jit):
  state = _state()
  new = maybe_jit(lambda s: s.apply_gradients(grads={"w": jnp.array([jnp.inf, 1.0])}))(state)
  assert float(new.dynamic_scale.scale) == 32768.0  # backed off
  fresh = jls.DynamicScaleState.create(init_scale=8.0)
  assert float(new.replace(dynamic_scale=fresh).dynamic_scale.scale) == 8.0
  assert new.replace(step=new.step).dynamic_scale is new.dynamic_scale
  # apply_gradients' own result, then any replace of it: fine.
  again = new.apply_gradients(grads={"w": jnp.ones(2)})
  assert again.replace(dynamic_scale=again.dynamic_scale).dynamic_scale is again.dynamic_scale


def test_replace_refuses_what_is_not_a_scale_state():
  state = _state()
  with pytest.raises(TypeError, match=r"dynamic_scale must be a jax_lossscale\.DynamicScaleState"):
    state.replace(dynamic_scale=None)


def test_replace_with_a_non_array_names_no_flax_unpacking():
  """Only an array (a loss or a flag, from Flax's unpacking order) gets the hint on the
  order; any other wrong value is named alone."""
  state = _state()
  with pytest.raises(TypeError) as e:
    state.replace(dynamic_scale={"scale": 8.0})
  assert str(e.value) == "dynamic_scale must be a jax_lossscale.DynamicScaleState, got dict."


def flax_imagenet_unpacking_step(state, x):
  """Flax's ImageNet lines kept after switching to ``state.value_and_grad`` (has_aux, aux[1])."""
  loss_fn = lambda p: (_loss(p, x), ({"batch_stats": x}, x))
  grad_fn = state.value_and_grad(loss_fn, has_aux=True)
  dynamic_scale, is_fin, aux, grads = grad_fn(state.params)
  _new_model_state, _logits = aux[1]  # upstream: KeyError: 1 (aux was the gradients)
  return state.apply_gradients(grads=grads, finite=is_fin), dynamic_scale


def test_flax_four_name_unpacking_is_refused_where_it_is_written(maybe_jit):
  """``dynamic_scale, is_fin, aux, grads = grad_fn(params)``: refused at that line, with what
  to write (not a ``KeyError: 1`` at ``aux[1]``, two lines later, from the gradients' dict)."""
  state = _state()
  with pytest.raises(TypeError) as e:
    maybe_jit(flax_imagenet_unpacking_step)(state, jnp.ones(2))
  msg = str(e.value)
  assert msg.startswith("ScaledValueAndGrad cannot be unpacked: read it by name.")
  assert "returns (dynamic_scale, is_fin, aux, grads)" in msg  # what changed
  assert "ScaledValueAndGrad(value, aux, grads, finite)" in msg
  assert "aux is out.aux (not Flax's (loss, aux): the loss is out.value)" in msg  # aux[1]
  assert "apply_gradients(grads=out.grads, finite=out.finite" in msg  # what to write
  # The frame that raised is the unpacking line of the step, not aux[1].
  tb = e.traceback
  step_frames = [f for f in tb if f.name == "flax_imagenet_unpacking_step"]
  assert step_frames and "= grad_fn(state.params)" in str(step_frames[-1].statement)
  # Its own order and indexing are refused too: the result is read by name only.
  out = state.value_and_grad(_loss)(state.params, jnp.ones(2))
  with pytest.raises(TypeError, match="cannot be unpacked"):
    _value, _aux, _grads, _finite = out
  with pytest.raises(TypeError, match=r"cannot be indexed \(\[0\]\): read it by name"):
    out[0]


def test_what_flax_wrote_reads_by_name():
  """What the error says to write: ``out.aux`` is Flax's ``aux[1]``, ``out.value`` its
  ``aux[0]``; the result is a pytree (returned from jit, through ``lax`` loops)."""
  state = _state()
  loss_fn = lambda p, x: (_loss(p, x), {"logits": x * 3.0})
  out = jax.jit(lambda s, x: s.value_and_grad(loss_fn, has_aux=True)(s.params, x))(
    state, jnp.ones(2)
  )
  assert isinstance(out, jls.flax.ScaledValueAndGrad)
  assert float(out.value) == 2.0 and bool(out.finite)
  np.testing.assert_array_equal(out.aux["logits"], [3.0, 3.0])
  np.testing.assert_array_equal(out.grads["w"], [2.0, 2.0])
  # value, aux, grads, finite: the fields' order
  assert [leaf.dtype for leaf in jax.tree.leaves(out)] == ["float32", "float32", "float32", "bool"]


def test_the_finite_flag_as_grads_and_a_loss_as_the_scale_state_say_what_changed():
  state = _state()
  out = state.value_and_grad(_loss)(state.params, jnp.ones(2))
  with pytest.raises(TypeError, match=r"grads is a boolean scalar.*ScaledValueAndGrad\(value"):
    state.apply_gradients(grads=out.finite)
  with pytest.raises(TypeError, match=r"got ArrayImpl.*returns \(dynamic_scale, is_fin"):
    state.replace(dynamic_scale=out.value)


def test_scale_state_value_and_grad_points_to_the_train_state():
  ds = jls.DynamicScaleState.create()
  with pytest.raises(AttributeError, match=r"TrainState\.value_and_grad"):
    ds.value_and_grad(_loss, has_aux=True)
  with pytest.raises(AttributeError, match="'DynamicScaleState' object has no attribute 'nope'"):
    ds.nope  # noqa: B018
  assert not hasattr(ds, "dtype")


def test_jls_flax_is_an_attribute_imported_on_first_use():
  code = (
    "import sys, jax_lossscale as jls\n"
    "assert 'flax' not in sys.modules and 'jax_lossscale.flax' not in sys.modules\n"
    "assert jls.flax.TrainState.__name__ == 'TrainState'\n"
    "import jax_lossscale.flax\n"
    "assert jls.flax is jax_lossscale.flax\n"
  )
  subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_jls_flax_without_flax_names_the_extra():
  code = (
    "import sys\n"
    "sys.modules['flax'] = None\n"  # flax not installed
    "import jax_lossscale as jls\n"
    "try:\n"
    "  jls.flax\n"
    "except AttributeError as e:\n"
    "  assert \"pip install 'jax-lossscale[flax]'\" in str(e), e\n"
    "  assert not hasattr(jls, 'flax')\n"
    "else:\n"
    "  raise SystemExit('no error')\n"
  )
  subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_scaling_switched_off_is_flax_stock_train_state_bit_for_bit():
  """``dynamic_scale=DynamicScaleState.create(init_scale=1.0, dynamic=False)``: Flax's float32
  path, plus the skip of a non-finite step."""
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)}
  xs = jnp.asarray(rng.normal(size=(5, 8, 4)), jnp.float32)
  loss = lambda p, x: jnp.mean(jnp.tanh(x @ p["w"]) ** 2)
  tx = optax.sgd(0.3, momentum=0.9)
  off = TrainState.create(
    apply_fn=None,
    params=params,
    tx=tx,
    dynamic_scale=jls.DynamicScaleState.create(init_scale=1.0, dynamic=False),
  )
  stock = flax.training.train_state.TrainState.create(apply_fn=None, params=params, tx=tx)

  def off_step(state, x):  # eager: op by op, so no fusion choice differs between the two
    out = state.value_and_grad(loss)(state.params, x)
    return state.apply_gradients(grads=out.grads, finite=out.finite), out.value

  def stock_step(state, x):
    value, grads = jax.value_and_grad(loss)(state.params, x)
    return state.apply_gradients(grads=grads), value

  for x in xs:
    off, a = off_step(off, x)
    stock, b = stock_step(stock, x)
    np.testing.assert_array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))
    np.testing.assert_array_equal(
      np.asarray(off.params["w"]).view(np.uint32), np.asarray(stock.params["w"]).view(np.uint32)
    )
  assert float(off.dynamic_scale.scale) == 1.0
  # Documented where a Flax user looks: the linen guide, the migration page, the docstring.
  way = "dynamic_scale=jls.DynamicScaleState.create(init_scale=1.0, dynamic=False)"
  for page in ("flax-linen.md", "flax-dynamic-scale.md"):
    assert way in (ROOT / "docs" / "guides" / page).read_text(), page
  assert "DynamicScaleState.create(init_scale=1.0, dynamic=False)" in TrainState.__doc__
  skipped, _ = off_step(off, xs[0].at[0, 0].set(jnp.inf))
  assert float(skipped.dynamic_scale.scale) == 1.0 and int(skipped.dynamic_scale.skipped_steps) == 1
  np.testing.assert_array_equal(skipped.params["w"], off.params["w"])


# docs/rule.md's Flax column, against the installed Flax.


def _rule_row(behaviour):
  text = (ROOT / "docs" / "rule.md").read_text()
  header = next(line for line in text.splitlines() if line.startswith("| behaviour |"))
  row = next(line for line in text.splitlines() if line.startswith(f"| {behaviour} |"))
  cells = lambda line: [c.strip() for c in line.strip().strip("|").split("|")]
  return dict(zip(cells(header), cells(row)))


def _flax_clean_steps_until_growth(interval, fin_steps=0, limit=40):
  """Flax's own DynamicScale: on which clean step (1-based) the scale first grows, or None."""
  from flax.training.dynamic_scale import DynamicScale

  ds = DynamicScale(growth_interval=interval, fin_steps=fin_steps)
  for k in range(1, limit + 1):
    ds, finite, _, _ = ds.value_and_grad(lambda p: p * p)(jnp.float32(1.0))
    assert bool(finite)
    if float(ds.scale) > 65536.0:
      return k
  return None


def test_rule_table_flax_column_is_what_flax_does():
  flax_column = "Flax `DynamicScale`"
  # Growth on the (N+1)-th clean step: Flax checks fin_steps == N before counting this step.
  assert _flax_clean_steps_until_growth(3) == 4
  assert _rule_row("growth happens on")[flax_column] == "(N+1)-th"
  # A tracker past the interval (a loaded state): `==` never matches again, so no growth.
  assert _flax_clean_steps_until_growth(3, fin_steps=5) is None
  cell = _rule_row("tracker >= interval (e.g. after loading a state)")[flax_column]
  assert "`==`" in cell and "never grows" in cell, cell
  # jax_lossscale grows on the N-th clean step, as torch does.
  state = jls.DynamicScaleState.create(growth_interval=3)
  for k in range(1, 4):
    state = jls.update_scale(state, jnp.array(True))
    assert (float(state.scale) > 65536.0) == (k == 3)


# The smaller findings of the guides.


@pytest.mark.skipif(jax.device_count() < 2, reason="needs several devices (conftest)")
@pytest.mark.parametrize("check_vma", [False, True], ids=["per-device-grads", "vma"])
def test_axis_name_averages_in_value_and_grad_but_only_combines_the_flag_in_the_optimizer(
  check_vma,
):
  from jax.sharding import PartitionSpec as P

  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))  # Auto axes, as the guide's
  n = jax.device_count()
  x = jnp.arange(n, dtype=jnp.float32).reshape(n, 1) + 1.0  # one row per device, all different
  params = {"w": jnp.ones(1)}
  tx = jls.dynamic_loss_scale(optax.sgd(1.0), init_scale=4.0, axis_name="data")
  opt_state = tx.init(params)
  loss = lambda p, x: jnp.sum(p["w"] * x)

  @jax.jit
  @functools.partial(
    jax.shard_map,
    mesh=mesh,
    in_specs=(P(), P(), P("data")),
    out_specs=(P("data"), P("data")),
    check_vma=check_vma,
  )
  def step(params, opt_state, x):
    local = jax.grad(lambda p: jls.scale_loss(loss(p, x), opt_state))(params)
    updates, _ = tx.update(local, opt_state)  # no pmean: each device keeps what it was given
    out = jls.flax.value_and_grad(loss, opt_state, axis_name="data")(params, x)
    return updates["w"], out.grads["w"]

  per_device, averaged = step(params, opt_state, x)
  rows = np.asarray(x)[:, 0]
  if not check_vma:  # pmap's semantics: each device's own gradient
    np.testing.assert_array_equal(per_device, -rows)  # the optimizer did not average
    np.testing.assert_array_equal(averaged, np.full(n, rows.mean()))  # value_and_grad did
  else:  # JAX sums the gradients of the replicated params itself; pmean leaves the sum
    np.testing.assert_array_equal(per_device, np.full(n, -rows.sum()))
    np.testing.assert_array_equal(averaged, np.full(n, rows.sum()))
  text = (ROOT / "docs" / "guides" / "many-devices.md").read_text()
  assert "only combines the overflow flag" in text and "also averages the gradients" in text
  assert "*sum* of the devices' gradients" in text


def test_linen_guide_keeps_the_loss_cast_when_only_apply_is_autocast():
  """``jls.autocast(model.apply)`` leaves the loss outside the policy: its log_softmax is float16."""
  model = flax.linen.Dense(10)
  params = model.init(jax.random.key(0), jnp.ones((2, 4)))
  apply = jls.autocast(model.apply)
  logits = apply(params, jnp.ones((2, 4)))
  assert logits.dtype == jnp.float16
  assert jax.nn.log_softmax(logits).dtype == jnp.float16  # outside the policy: float16 exp/log
  inside = jls.autocast(lambda p, x: jax.nn.log_softmax(model.apply(p, x)))(
    params, jnp.ones((2, 4))
  )
  assert inside.dtype == jnp.float32  # the loss inside the policy: float32
  text = (ROOT / "docs" / "guides" / "flax-linen.md").read_text()
  assert "runs in float32 under the policy anyway" not in text
  assert "Keep the `.astype(jnp.float32)` of the output before the loss" in text


# The migration page: its diff is the difference between its two train steps, which run.

_FENCE = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)


def test_the_migration_page_diff_is_the_difference_between_its_two_train_steps():
  page = (ROOT / "docs" / "guides" / "flax-dynamic-scale.md").read_text()
  blocks = _FENCE.findall(page)
  python = [code for lang, code in blocks if lang == "python"]
  (shown,) = [code for lang, code in blocks if lang == "diff"]
  before = next(b for b in python if b.startswith("class TrainState(train_state.TrainState)"))
  after = next(b for b in python if b.startswith("class TrainState(jls.flax.TrainState)"))
  diff = difflib.unified_diff(
    before.splitlines(True), after.splitlines(True), "flax/train.py", "jls/train.py", n=2
  )
  assert shown == "".join(diff)
  # The removed lines are Flax's skip block and unpacking; the page's prose names them.
  assert "-    dynamic_scale, is_fin, aux, grads = grad_fn(state.params)\n" in shown
  assert "-      dynamic_scale=dynamic_scale,\n" in shown
  nav = (ROOT / "mkdocs.yml").read_text()
  assert "guides/flax-dynamic-scale.md" in nav


def test_the_migration_page_says_why_growth_comes_one_step_earlier():
  page = (ROOT / "docs" / "guides" / "flax-dynamic-scale.md").read_text()
  assert "grow = self.fin_steps == self.growth_interval" in page
  import flax.training.dynamic_scale

  source = pathlib.Path(flax.training.dynamic_scale.__file__).read_text()
  assert "grow = self.fin_steps == self.growth_interval" in source  # the installed Flax's line
  assert _flax_clean_steps_until_growth(4) == 5  # (N+1)-th, as the page says


def test_flax_msgpack_serialization_round_trips_the_scale_state():
  """``flax.serialization.to_bytes``/``from_bytes`` of the TrainState (Flax's msgpack checkpoints)."""
  import flax.serialization

  state = _state(dynamic_scale=jls.DynamicScaleState.create(growth_interval=3))
  state = state.apply_gradients(grads={"w": jnp.array([jnp.inf, 1.0])})
  state = state.apply_gradients(grads={"w": jnp.ones(2)})
  target = _state(dynamic_scale=jls.DynamicScaleState.create(growth_interval=3))
  restored = flax.serialization.from_bytes(target, flax.serialization.to_bytes(state))
  for name in ("scale", "growth_tracker", "hysteresis_tracker", "skipped_steps"):
    a, b = getattr(restored.dynamic_scale, name), getattr(state.dynamic_scale, name)
    assert a.dtype == b.dtype and a.shape == () and a == b, name
  assert restored.dynamic_scale.config == state.dynamic_scale.config
  assert float(restored.dynamic_scale.scale) == 32768.0
  np.testing.assert_array_equal(restored.params["w"], state.params["w"])
  with pytest.raises(ValueError, match="misses the fields"):
    flax.serialization.from_state_dict(target.dynamic_scale, {"scale": np.float32(2.0)})
