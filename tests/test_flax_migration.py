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

import functools
import hashlib
import os
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
from jax_lossscale._integrations._flax_migration import checked_scale_state
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


def test_the_old_scale_state_with_a_field_changed_is_kept():
  """A scale state made from the pre-step one with one field replaced shares its other
  leaves: a deliberate change, stored as given, not the pre-step state written back."""
  state = _state()
  new = state.apply_gradients(grads={"w": jnp.array([jnp.inf, 1.0])})
  reset = state.dynamic_scale.replace(scale=jnp.float32(8.0))
  kept = new.replace(dynamic_scale=reset).dynamic_scale
  assert float(kept.scale) == 8.0  # not the backed-off 32768
  assert int(kept.skipped_steps) == 0 and int(new.dynamic_scale.skipped_steps) == 1


def test_stacked_scale_states_are_compared_entry_for_entry():
  """Scale states stacked along an axis (one per ensemble member, say): one whose leaves
  differ from the pre-step ones in any entry is not the pre-step state, and is kept."""
  one = jls.DynamicScaleState.create()
  before = jax.tree.map(lambda *xs: jnp.stack(xs), one, one)
  after = before.replace(scale=before.scale / 2)
  ds = before.replace(scale=jnp.array([65536.0, 8.0], jnp.float32))
  assert_bits_equal(checked_scale_state(ds, before, after), ds)
  written_back = jax.tree.map(jnp.copy, before)
  np.testing.assert_array_equal(checked_scale_state(written_back, before, after).scale, after.scale)


def test_the_scale_to_log_is_the_new_states(maybe_jit):
  """Flax's ``metrics['scale'] = dynamic_scale.scale`` logged the scale after the step; kept
  here (``dynamic_scale = state.dynamic_scale``) it is one step late. The new state's, or
  ``jls.metrics(new_state)``, is the backed-off scale on the step that backed off."""

  def step(state, x):
    dynamic_scale = state.dynamic_scale  # Flax's line, kept
    out = state.value_and_grad(_loss)(state.params, x)
    new_state = state.apply_gradients(grads=out.grads, finite=out.finite)
    return new_state, {
      "kept_flax_line": dynamic_scale.scale,
      "scale": new_state.dynamic_scale.scale,
      **{f"jls_{k}": v for k, v in jls.metrics(new_state).items()},
    }

  state, logged = maybe_jit(step)(_state(), jnp.array([jnp.inf, 1.0]))  # backs off
  assert float(logged["kept_flax_line"]) == 65536.0  # stale: the scale the step started from
  assert float(logged["scale"]) == 32768.0 == float(logged["jls_scale"])
  assert bool(logged["jls_last_step_skipped"]) and int(logged["jls_skipped_steps"]) == 1
  _, logged = maybe_jit(step)(state, jnp.ones(2))  # a clean step: the stale line lags on
  assert float(logged["kept_flax_line"]) == 32768.0 == float(logged["scale"])
  assert not bool(logged["jls_last_step_skipped"])
  page = (ROOT / "docs" / "guides" / "flax-dynamic-scale.md").read_text()
  assert "## What to log" in page and "65536 on the step\nthat backed off to 32768" in page


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


# The migration page: its patch is a patch of Flax's examples/imagenet/train.py.

_FENCE = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
_HUNK = re.compile(r"^@@ -(\d+),(\d+) \+(\d+),(\d+) @@$")

#: The upstream file the page patches: google/flax at this commit (Apache-2.0).
FLAX_COMMIT = "18f8f311c275d57f46d95e41b15aa97b454754c0"
FLAX_TRAIN_PY_SHA256 = "aa4a8b3cf87f4467a5a3d3b785532274acf33766008a478cfe931240065f2593"
#: The page's quotes of it, under *Before*: first line -> (line number there, sha256 of the block).
QUOTED = {
  "import functools\n": (
    21,
    "8c3930877d9667b10fbdbda3a119137362eed2248e3a6b74093c8a13eb5f1964",
  ),
  "def train_step(state, batch, learning_rate_fn):\n": (
    112,
    "a00a081b79d69393cd1a4f16d0622eeb9630bff0f3e07ea23b19ff1af3930b13",
  ),
  "class TrainState(train_state.TrainState):\n": (
    220,
    "bb7b895a8b6bb256bc7ac48be7f481461ec7a4fff814208a9c14ff35273e2cbf",
  ),
  "def create_train_state(\n": (
    243,
    "e6fd2dc20effcec7571d487a41922c9f279534f4f737d1974e17756ed3ceb12f",
  ),
}


def _page_sections():
  """The page, its quotes of Flax's file (under *Before*), the patched quotes (the first blocks
  under *After*, in the same order) and its patch."""
  page = (ROOT / "docs" / "guides" / "flax-dynamic-scale.md").read_text()
  code = lambda start, end: [
    c
    for lang, c in _FENCE.findall(page[page.index(start) : page.index(end)])
    if lang in ("py", "python")
  ]
  quoted = [c for c in code("## Before:", "## After:") if c.splitlines(True)[0] in QUOTED]
  after = code("## After:", "## The patch")
  assert after[len(quoted)].startswith("p_train_step = jax.pmap(")  # then the run
  (patch,) = [c for lang, c in _FENCE.findall(page) if lang == "diff"]
  return page, quoted, after[: len(quoted)], patch


def apply_unified_diff(old: list, diff: str) -> list:
  """``diff`` applied to the lines ``old``, strictly: no fuzz, no offset (``patch -F0`` that
  also refuses to move a hunk). A line that differs, or lies past ``old``, fails."""
  lines = diff.splitlines(True)
  assert lines[0].startswith("--- a/") and lines[1].startswith("+++ b/"), lines[:2]
  new, done, i = [], 0, 2  # done: how many lines of old are in new
  while i < len(lines):
    m = _HUNK.match(lines[i].rstrip("\n"))
    assert m, f"not a hunk header: {lines[i]!r}"
    old_start, old_len, new_start, new_len = map(int, m.groups())
    assert old_start - 1 >= done and new_start == len(new) + old_start - done, lines[i]
    new += old[done : old_start - 1]
    at, taken, given = old_start - 1, 0, 0
    i += 1
    while i < len(lines) and not lines[i].startswith("@@"):
      tag, text = lines[i][0], lines[i][1:]
      if tag in " -":
        assert at < len(old) and old[at] == text, f"line {at + 1}: {text!r} is {old[at]!r}"
        at, taken = at + 1, taken + 1
      if tag in " +":
        new.append(text)
        given += 1
      assert tag in " -+", lines[i]
      i += 1
    assert (taken, given) == (old_len, new_len), (old_start, taken, given)
    done = at
  return new + old[done:]


def _quoted_file(blocks):
  """Flax's file as the page quotes it: each quoted line at its number, every other line a
  stand-in that no patch line matches. A quoted definition stands for its lines and the two
  blank lines that upstream (PEP 8) puts before and after a top-level definition."""
  text = {}
  for block in blocks:
    first = block.splitlines(True)[0]
    start, digest = QUOTED[first]
    assert hashlib.sha256(block.encode()).hexdigest() == digest, f"quote changed: {first!r}"
    for k, line in enumerate(block.splitlines(True)):
      text[start + k] = line
    if first.startswith(("def ", "class ")):
      end = start + len(block.splitlines())
      text.update({start - 2: "\n", start - 1: "\n", end: "\n", end + 1: "\n"})
  return [text.get(n, f"<line {n} of Flax's file: not quoted>\n") for n in range(1, max(text) + 1)]


def test_the_migration_page_patch_applies_to_the_flax_lines_it_quotes():
  """The page's patch, applied to Flax's lines that the page quotes under *Before* (at their
  line numbers in Flax's file), gives the blocks under *After*, which run on the page."""
  page, quoted, after, patch = _page_sections()
  assert len(quoted) == len(QUOTED) == 4
  assert f"commit `{FLAX_COMMIT}`" in page and "Apache License 2.0" in page
  patched = apply_unified_diff(_quoted_file(quoted), patch)
  assert len(after) == 4
  for block in after:
    lines = block.splitlines(True)
    (at,) = [k for k, line in enumerate(patched) if line == lines[0]]
    assert patched[at : at + len(lines)] == lines, lines[0]
  # Every line the patch removes or keeps is a quoted one (a stand-in never matches), and it
  # removes Flax's unpacking and skip block.
  assert "-    dynamic_scale, is_fin, aux, grads = grad_fn(state.params)\n" in patch
  assert "-        dynamic_scale=dynamic_scale,\n" in patch
  assert "-    grads = lax.pmean(grads, axis_name='batch')\n" in patch
  assert "+  metrics['scale'] = new_state.dynamic_scale.scale\n" in patch
  nav = (ROOT / "mkdocs.yml").read_text()
  assert "guides/flax-dynamic-scale.md" in nav


def test_the_diff_applier_refuses_what_patch_refuses():
  old = ["a\n", "b\n", "c\n", "d\n"]
  good = "--- a/f\n+++ b/f\n@@ -2,2 +2,2 @@\n b\n-c\n+C\n"
  assert apply_unified_diff(old, good) == ["a\n", "b\n", "C\n", "d\n"]
  with pytest.raises(AssertionError, match="line 3"):  # a context line that differs
    apply_unified_diff(old, good.replace("-c", "-x"))
  with pytest.raises(AssertionError):  # the hunk moved (an offset)
    apply_unified_diff(old, good.replace("@@ -2,2 +2,2 @@", "@@ -1,2 +1,2 @@"))
  with pytest.raises(AssertionError):  # a count in the header that is wrong
    apply_unified_diff(old, good.replace("@@ -2,2 +2,2 @@", "@@ -2,3 +2,3 @@"))


@pytest.mark.skipif(
  not os.environ.get("FLAX_IMAGENET_TRAIN_PY"),
  reason="FLAX_IMAGENET_TRAIN_PY names no copy of Flax's examples/imagenet/train.py",
)
def test_the_migration_page_patch_applies_to_flax_file_with_patch(tmp_path):
  """With Flax's file at hand (set FLAX_IMAGENET_TRAIN_PY to its path at FLAX_COMMIT), the
  page's patch applies to all of it with ``patch -p1``, no fuzz, no offset."""
  source = pathlib.Path(os.environ["FLAX_IMAGENET_TRAIN_PY"]).read_bytes()
  assert hashlib.sha256(source).hexdigest() == FLAX_TRAIN_PY_SHA256
  _, quoted, after, patch = _page_sections()
  for block in quoted:  # verbatim, at their line numbers
    start = QUOTED[block.splitlines(True)[0]][0] - 1
    assert source.decode().splitlines(True)[start : start + len(block.splitlines())] == (
      block.splitlines(True)
    )
  target = tmp_path / "examples" / "imagenet" / "train.py"
  target.parent.mkdir(parents=True)
  target.write_bytes(source)
  done = subprocess.run(
    ["patch", "-p1", "-F0", "--no-backup-if-mismatch"],
    input=patch,
    text=True,
    cwd=tmp_path,
    capture_output=True,
    check=True,
  )
  assert "offset" not in done.stdout and "fuzz" not in done.stdout, done.stdout
  text = target.read_text()
  assert all(block in text for block in after)
  compile(text, str(target), "exec")
  assert apply_unified_diff(source.decode().splitlines(True), patch) == text.splitlines(True)


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
