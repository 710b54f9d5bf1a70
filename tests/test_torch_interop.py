"""``to_torch_state_dict`` / ``from_torch_state_dict`` against the real ``torch.amp.GradScaler``."""

import math

from helpers import import_torch
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_lossscale as jls

# Finite (True) / overflow (False) per step; long enough clean runs to grow.
PATTERN = [True, True, True, False, True, True, True, True, False, False, True, True, True, True]
CONFIGS = [
  dict(init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5, growth_interval=3),
  dict(init_scale=3.0, growth_factor=1.1, backoff_factor=0.3, growth_interval=2),
]


class TorchRun:
  """A real ``torch.amp.GradScaler("cpu")`` driving SGD on one parameter."""

  def __init__(self, torch, cfg):
    self.torch = torch
    self.p = torch.zeros(3, requires_grad=True)
    self.opt = torch.optim.SGD([self.p], lr=0.0)
    self.scaler = torch.amp.GradScaler("cpu", **cfg)

  def step(self, finite):
    torch = self.torch
    self.opt.zero_grad()
    self.scaler.scale(self.p.sum()).backward()  # gradients of the scaled loss
    if not finite:
      with torch.no_grad():
        self.p.grad[1] = float("inf")
    self.scaler.step(self.opt)
    self.scaler.update()
    return self.scaler.get_scale(), self.scaler.state_dict()["_growth_tracker"]


class JaxRun:
  def __init__(self, cfg):
    self.tx = jls.dynamic_loss_scale(optax.sgd(0.0), **cfg)
    self.state = self.tx.init({"p": jnp.zeros(3, jnp.float32)})
    self.update = jax.jit(self.tx.update)

  def step(self, finite):
    g = jnp.ones(3, jnp.float32) * jls.get_scale_state(self.state).scale
    if not finite:
      g = g.at[1].set(jnp.inf)
    _, self.state = self.update({"p": g}, self.state)
    m = jls.metrics(self.state)
    return m["scale"].item(), m["growth_tracker"].item()


def _reference(torch, cfg):
  run = TorchRun(torch, cfg)
  return [run.step(ok) for ok in PATTERN]


@pytest.mark.torch
@pytest.mark.parametrize("cfg", CONFIGS, ids=["torch-defaults", "factors-1.1-0.3"])
@pytest.mark.parametrize("switch_at", [4, 5, 9])
def test_torch_to_jax_mid_run(cfg, switch_at):
  torch = import_torch()
  expected = _reference(torch, cfg)
  run = TorchRun(torch, cfg)
  got = [run.step(ok) for ok in PATTERN[:switch_at]]
  sd = run.scaler.state_dict()
  # 4 and 9 come right after an overflow (tracker 0); 5 is one clean step later.
  assert sd["_growth_tracker"] == (1 if switch_at == 5 else 0)
  jrun = JaxRun(cfg)
  jrun.state = jrun.state._replace(loss_scale=jls.torch.from_torch_state_dict(sd))
  got += [jrun.step(ok) for ok in PATTERN[switch_at:]]
  assert got == expected


@pytest.mark.torch
@pytest.mark.parametrize("cfg", CONFIGS, ids=["torch-defaults", "factors-1.1-0.3"])
@pytest.mark.parametrize("fresh_scaler", [True, False], ids=["fresh", "used"])
def test_jax_to_torch_mid_run(cfg, fresh_scaler):
  torch = import_torch()
  expected = _reference(torch, cfg)
  switch_at = 6
  jrun = JaxRun(cfg)
  got = [jrun.step(ok) for ok in PATTERN[:switch_at]]
  sd = jls.torch.to_torch_state_dict(jrun.state)
  assert list(sd) == list(torch.amp.GradScaler("cpu").state_dict())  # torch's keys, in order
  assert all(type(sd[k]) is type(v) for k, v in torch.amp.GradScaler("cpu").state_dict().items())
  # A fresh scaler initialises lazily from the dict; a used one overwrites its tensors.
  run = TorchRun(torch, {} if fresh_scaler else dict(init_scale=7.0, growth_interval=5))
  if not fresh_scaler:
    run.step(True)
  run.scaler.load_state_dict(sd)
  got += [run.step(ok) for ok in PATTERN[switch_at:]]
  assert got == expected


def test_round_trip_and_values():
  s = jls.DynamicScaleState.create(
    init_scale=2.0**5, growth_factor=3.0, backoff_factor=0.25, growth_interval=7
  )
  s = s.replace(growth_tracker=jnp.asarray(4, jnp.int32))
  sd = jls.torch.to_torch_state_dict(s)
  assert sd == {
    "scale": 32.0,
    "growth_factor": 3.0,
    "backoff_factor": 0.25,
    "growth_interval": 7,
    "_growth_tracker": 4,
  }
  back = jls.torch.from_torch_state_dict(sd)
  assert back.config == s.config
  for name in ("scale", "growth_tracker", "skipped_steps", "consecutive_skips"):
    a, b = getattr(back, name), getattr(s, name)
    assert a.dtype == b.dtype and a.item() == b.item()
  # The scale is stored as float32, as torch does.
  odd = jls.torch.from_torch_state_dict({**sd, "scale": 0.1})
  assert odd.scale.item() == float(np.float32(0.1))
  # Any tree holding the state works, e.g. an optimizer state.
  opt_state = jls.dynamic_loss_scale(optax.sgd(1.0), init_scale=4.0).init({"w": jnp.zeros(1)})
  assert jls.torch.to_torch_state_dict(opt_state)["scale"] == 4.0


GOOD = {
  "scale": 1024.0,
  "growth_factor": 2.0,
  "backoff_factor": 0.5,
  "growth_interval": 10,
  "_growth_tracker": 3,
}


@pytest.mark.parametrize(
  "sd, error, match",
  [
    ({}, ValueError, "disabled GradScaler"),
    ([("scale", 1.0)], TypeError, "sd must be a dict"),
    (
      {k: v for k, v in GOOD.items() if k != "_growth_tracker"},
      ValueError,
      "missing.*_growth_tracker",
    ),
    ({**GOOD, "step": 3}, ValueError, "unknown.*step"),
    ({**GOOD, "scale": "big"}, TypeError, r"state_dict\['scale'\] must be a real number"),
    ({**GOOD, "scale": True}, TypeError, r"state_dict\['scale'\] must be a real number"),
    ({**GOOD, "scale": math.nan}, ValueError, r"state_dict\['scale'\] must be finite"),
    ({**GOOD, "scale": -1.0}, ValueError, r"state_dict\['scale'\] must be positive"),
    ({**GOOD, "growth_factor": 0.5}, ValueError, r"state_dict\['growth_factor'\] must be > 1"),
    (
      {**GOOD, "backoff_factor": 1.5},
      ValueError,
      r"state_dict\['backoff_factor'\] must be in \(0, 1\)",
    ),
    (
      {**GOOD, "growth_interval": 2.5},
      TypeError,
      r"state_dict\['growth_interval'\] must be an integer",
    ),
    ({**GOOD, "_growth_tracker": -1}, ValueError, r"_growth_tracker'\] must be in"),
  ],
)
def test_from_torch_state_dict_rejects_bad_input(sd, error, match):
  with pytest.raises(error, match=match):
    jls.torch.from_torch_state_dict(sd)


def _numpy_0d(value):
  return np.asarray(value)


def _torch_0d(value):
  return import_torch().tensor(value)


@pytest.mark.parametrize(
  "wrap",
  [np.asarray(0).dtype.type, _numpy_0d, _torch_0d],
  ids=["numpy-scalar", "numpy-0d-array", "torch-0d-tensor"],
)
def test_from_torch_state_dict_accepts_numpy_and_tensor_scalars(wrap):
  sd = {
    "scale": np.float32(512.0) if wrap is np.asarray(0).dtype.type else wrap(512.0),
    "growth_factor": wrap(2.0) if wrap is not np.asarray(0).dtype.type else np.float64(2.0),
    "backoff_factor": 0.5,
    "growth_interval": wrap(10),
    "_growth_tracker": wrap(2),
  }
  if wrap is not np.asarray(0).dtype.type:
    assert all(
      getattr(sd[k], "ndim", None) == 0 and not isinstance(sd[k], (int, float))
      for k in ("scale", "growth_factor", "growth_interval", "_growth_tracker")
    )
  s = jls.torch.from_torch_state_dict(sd)
  assert s.scale.item() == 512.0 and s.growth_tracker.item() == 2
  assert s.config.growth_interval == 10 and s.config.growth_factor == 2.0
  assert s.scale.dtype == jnp.float32 and s.growth_tracker.dtype == jnp.int32
  assert type(s.config.growth_interval) is int and type(s.config.growth_factor) is float


def test_from_torch_state_dict_rejects_0d_non_numbers():
  with pytest.raises(TypeError, match=r"state_dict\['growth_interval'\] must be an integer"):
    jls.torch.from_torch_state_dict({**GOOD, "growth_interval": np.asarray(10.0)})
  with pytest.raises(TypeError, match=r"state_dict\['scale'\] must be a real number"):
    jls.torch.from_torch_state_dict({**GOOD, "scale": np.asarray([512.0])})


@pytest.mark.parametrize("key", ["growth_interval", "_growth_tracker"])
@pytest.mark.parametrize("value", [10.5, True, np.bool_(True), "10"], ids=repr)
def test_from_torch_state_dict_names_an_integer_key_that_holds_no_integer(key, value):
  with pytest.raises(TypeError, match=rf"state_dict\['{key}'\] must be an integer, got "):
    jls.torch.from_torch_state_dict({**GOOD, key: value})


def test_from_torch_state_dict_accepts_the_largest_int32_tracker():
  s = jls.torch.from_torch_state_dict({**GOOD, "_growth_tracker": 2**31 - 1})
  assert int(s.growth_tracker) == 2**31 - 1
  with pytest.raises(ValueError, match=r"must be in \[0, 2\*\*31 - 1\], got 2147483648"):
    jls.torch.from_torch_state_dict({**GOOD, "_growth_tracker": 2**31})


def test_from_torch_state_dict_takes_the_settings_torch_does_not_hold():
  s = jls.torch.from_torch_state_dict(GOOD, min_scale=2.0, max_scale=2.0**20, hysteresis=3)
  assert (s.config.min_scale, s.config.max_scale, s.config.hysteresis) == (2.0, 2.0**20, 3)
  assert int(s.hysteresis_tracker) == 3


@pytest.mark.parametrize("wrap", [_numpy_0d, _torch_0d], ids=["numpy-0d-array", "torch-0d-tensor"])
def test_from_torch_state_dict_rejects_0d_bools(wrap):
  with pytest.raises(TypeError, match=r"state_dict\['scale'\] must be a real number"):
    jls.torch.from_torch_state_dict({**GOOD, "scale": wrap(True)})


def test_to_torch_state_dict_refuses_what_torch_cannot_hold():
  with pytest.raises(ValueError, match="hysteresis=2"):
    jls.torch.to_torch_state_dict(jls.DynamicScaleState.create(hysteresis=2))
  with pytest.raises(ValueError, match="max_scale"):
    jls.torch.to_torch_state_dict(jls.DynamicScaleState.create(max_scale=2.0**20))
  with pytest.raises(ValueError, match=r"min_scale=1\.0"):
    jls.torch.to_torch_state_dict(jls.DynamicScaleState.create(init_scale=8.0, min_scale=1.0))
  # strict=False drops exactly those settings and keeps the rest.
  lossy = jls.DynamicScaleState.create(
    init_scale=8.0, min_scale=1.0, max_scale=2.0**20, hysteresis=3, growth_interval=5
  )
  assert jls.torch.to_torch_state_dict(lossy, strict=False) == {
    "scale": 8.0,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 5,
    "_growth_tracker": 0,
  }
  # The defaults (what from_torch_state_dict builds) are what torch holds.
  jls.torch.to_torch_state_dict(jls.torch.from_torch_state_dict(GOOD))
  static = jls.static_loss_scale(optax.sgd(1.0), 128.0).init({"w": jnp.zeros(1)})
  with pytest.raises(ValueError, match="static scale"):
    jls.torch.to_torch_state_dict(static)
  assert jls.torch.to_torch_state_dict(static, strict=False)["scale"] == 128.0
  with pytest.raises(ValueError, match="outside jit"):
    jax.jit(lambda s: jls.torch.to_torch_state_dict(s)["scale"])(jls.DynamicScaleState.create())


def test_to_torch_state_dict_refuses_a_batch_of_states():
  # torch's state dict holds one scaler: a vmapped stack of states has no single scale.
  batch = jax.vmap(lambda s: jls.DynamicScaleState.create().replace(scale=s))(jnp.ones(2))
  assert batch.scale.shape == (2,)
  with pytest.raises(ValueError, match=r"scale must be a scalar, got shape \(2,\)"):
    jls.torch.to_torch_state_dict(batch)


def test_interop_module_does_not_import_torch():
  import subprocess
  import sys

  code = (
    "import sys, jax_lossscale as j; j.to_torch_state_dict(j.DynamicScaleState.create()); "
    "print('torch' in sys.modules)"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "False"
