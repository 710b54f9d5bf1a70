"""Checkpoint and resume with Orbax: nothing of the scaler is lost.

The train state (params and the optimizer state holding the scale state) is
saved with ``orbax.checkpoint.StandardCheckpointer`` in the middle of a run,
restored in a fresh Python process and trained on: everything ends bit-identical
to the uninterrupted run. The scaler's config is static pytree metadata, so it
is not among the saved arrays; it is recorded as JSON metadata beside them
(:func:`jax_lossscale.checkpoint.scale_config_metadata`) and checked on restore
(:func:`jax_lossscale.checkpoint.check_scale_config`).

This file doubles as the script the fresh process runs (``python
tests/test_checkpoint.py resume CKPT OUT``).
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

if __name__ != "__main__":
  from helpers import import_optional

  ocp = import_optional("orbax.checkpoint")

import jax_lossscale as jls

STEPS, SAVE_AT = 12, 5
BAD_STEPS = (2, 3, 7, 8, 9)  # overflows before and after the checkpoint
META_KEY = "jax_lossscale"


def make_tx(growth_interval=2):
  schedule = optax.exponential_decay(0.05, transition_steps=2, decay_rate=0.5)
  return jls.dynamic_loss_scale(
    optax.chain(optax.clip_by_global_norm(10.0), optax.sgd(schedule, momentum=0.9)),
    init_scale=2.0**8,
    growth_factor=1.5,
    growth_interval=growth_interval,
    hysteresis=2,
    min_scale=1.0,
  )


def init_state(tx):
  params = {
    "dense": {"w": jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4)},
    "b": jnp.zeros([4], jnp.float32),
  }
  return {"params": params, "opt_state": tx.init(params)}


def make_step(tx):
  def step(train_state, i):
    params, opt_state = train_state["params"], train_state["opt_state"]
    x = jax.random.normal(jax.random.fold_in(jax.random.key(0), i), (5, 3), jnp.float32)
    loss = lambda p: jnp.mean(jnp.tanh(x @ p["dense"]["w"] + p["b"]) ** 2)
    grads = jax.grad(lambda p: jls.scale_loss(loss(p), opt_state))(params)
    bad = jnp.isin(i, jnp.asarray(BAD_STEPS))
    grads = jax.tree_util.tree_map(lambda g: jnp.where(bad, jnp.float32(jnp.inf), g), grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    return {"params": optax.apply_updates(params, updates), "opt_state": opt_state}

  return jax.jit(step)


def train(tx, train_state, start, stop):
  step = make_step(tx)
  for i in range(start, stop):
    train_state = step(train_state, jnp.asarray(i, jnp.int32))
  return train_state


def leaves_as_bytes(tree):
  return {
    jax.tree_util.keystr(path): np.asarray(x).reshape(-1).view(np.uint8)
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
  }


def resume(ckpt_dir, out_file):
  """In a fresh process: restore into a target built by the code, train on."""
  import orbax.checkpoint as ocp

  tx = make_tx()
  target = init_state(tx)  # shapes, dtypes and the static config come from here
  ckptr = ocp.StandardCheckpointer()
  saved_meta = ckptr.metadata(ckpt_dir).custom_metadata[META_KEY]
  jls.checkpoint.check_scale_config(target, saved_meta)
  restored = ckptr.restore(ckpt_dir, target)
  ckptr.close()
  assert type(restored["opt_state"]) is type(target["opt_state"])
  final = train(tx, restored, SAVE_AT, STEPS)
  np.savez(out_file, **leaves_as_bytes(final))


def _save(path, train_state):
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(
    path, train_state, custom_metadata={META_KEY: jls.checkpoint.scale_config_metadata(train_state)}
  )
  ckptr.wait_until_finished()
  ckptr.close()


@pytest.fixture(scope="module")
def uninterrupted():
  tx = make_tx()
  return train(tx, init_state(tx), 0, STEPS)


def test_resume_in_a_fresh_process_is_bit_identical(tmp_path, uninterrupted):
  tx = make_tx()
  mid = train(tx, init_state(tx), 0, SAVE_AT)
  ckpt = str(tmp_path / "ckpt")
  _save(ckpt, mid)
  out = str(tmp_path / "resumed.npz")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
  proc = subprocess.run(
    [sys.executable, os.path.abspath(__file__), "resume", ckpt, out],
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  resumed = dict(np.load(out))
  expected = leaves_as_bytes(uninterrupted)
  assert sorted(resumed) == sorted(expected)
  for key, value in expected.items():
    np.testing.assert_array_equal(resumed[key], value, err_msg=key)
  # The run is not trivial: it skipped, backed off and grew on both sides of the save.
  ls = uninterrupted["opt_state"].loss_scale
  assert int(ls.skipped_steps) == len(BAD_STEPS)
  mid_ls = mid["opt_state"].loss_scale
  assert 0 < int(mid_ls.skipped_steps) < len(BAD_STEPS)
  # Literal values (init 2**8, growth 1.5 every 2 clean steps, hysteresis 2):
  # grows to 384, holds one overflow, backs off to 192 (saved), grows to 288,
  # holds, backs off to 144 and 72, grows to 108.
  assert float(mid_ls.scale) == 192.0 and int(mid_ls.growth_tracker) == 1
  assert int(mid_ls.hysteresis_tracker) == 0
  assert float(ls.scale) == 108.0 and int(ls.growth_tracker) == 0
  assert int(ls.hysteresis_tracker) == 2 and int(ls.consecutive_skips) == 0


def test_restore_keeps_dtypes_structure_and_config(tmp_path, uninterrupted):
  ckpt = str(tmp_path / "ckpt")
  _save(ckpt, uninterrupted)
  tx = make_tx()
  target = init_state(tx)
  ckptr = ocp.StandardCheckpointer()
  restored = ckptr.restore(ckpt, target)
  raw = ckptr.restore(ckpt)  # no target: plain containers of arrays
  ckptr.close()
  state = restored["opt_state"].loss_scale
  assert isinstance(state, jls.DynamicScaleState)
  assert state.config == uninterrupted["opt_state"].loss_scale.config
  assert state.scale.dtype == jnp.float32 and state.growth_tracker.dtype == jnp.int32
  for field in (
    "scale",
    "growth_tracker",
    "hysteresis_tracker",
    "skipped_steps",
    "consecutive_skips",
  ):
    np.testing.assert_array_equal(
      getattr(state, field), getattr(uninterrupted["opt_state"].loss_scale, field)
    )
  # The config is not among the saved arrays: only the five leaves are.
  assert sorted(raw["opt_state"]["loss_scale"]) == sorted(
    ["scale", "growth_tracker", "hysteresis_tracker", "skipped_steps", "consecutive_skips"]
  )


def test_config_change_is_detected_on_restore(tmp_path, uninterrupted):
  ckpt = str(tmp_path / "ckpt")
  _save(ckpt, uninterrupted)
  ckptr = ocp.StandardCheckpointer()
  saved = ckptr.metadata(ckpt).custom_metadata[META_KEY]
  ckptr.close()
  changed = init_state(make_tx(growth_interval=3))
  with pytest.raises(
    ValueError, match=r"\['opt_state'\]\.loss_scale.*growth_interval was 2 .* is 3"
  ):
    jls.checkpoint.check_scale_config(changed, saved)
  jls.checkpoint.check_scale_config(changed, saved, ignore=("growth_interval",))  # deliberate
  jls.checkpoint.check_scale_config(init_state(make_tx()), saved)


def test_config_metadata_round_trips_json_exactly():
  state = {
    "a": jls.DynamicScaleState.create(
      init_scale=3.3,
      growth_factor=1.1,
      backoff_factor=0.3,
      min_scale=1e-30,
      max_scale=1e30,
      growth_interval=7,
      hysteresis=3,
    ),
    "b": [jls.DynamicScaleState.create(dynamic=False)],
  }
  meta = json.loads(json.dumps(jls.checkpoint.scale_config_metadata(state)))
  jls.checkpoint.check_scale_config(state, meta)
  assert set(meta["configs"]) == {"['a']", "['b'][0]"}
  with pytest.raises(ValueError, match="do not match the checkpoint"):
    jls.checkpoint.check_scale_config({"a": state["a"]}, meta)
  with pytest.raises(ValueError, match="unknown config fields"):
    jls.checkpoint.check_scale_config(state, meta, ignore=("growth",))
  with pytest.raises(ValueError, match="metadata must be"):
    jls.checkpoint.check_scale_config(state, {"configs": {}})
  for field in ("hysteresis", "min_scale", "dynamic"):  # a field missing is not "unchanged"
    partial = json.loads(json.dumps(meta))
    del partial["configs"]["['a']"][field]
    with pytest.raises(
      ValueError, match=rf"metadata for \"\['a'\]\" lacks the config field '{field}'"
    ):
      jls.checkpoint.check_scale_config(state, partial)
    jls.checkpoint.check_scale_config(state, partial, ignore=(field,))
  with pytest.raises(ValueError, match="No DynamicScaleState"):
    jls.checkpoint.scale_config_metadata({"w": jnp.zeros(2)})


if __name__ == "__main__":
  jax.config.update("jax_numpy_dtype_promotion", "strict")
  if sys.argv[1] == "resume":
    resume(sys.argv[2], sys.argv[3])
