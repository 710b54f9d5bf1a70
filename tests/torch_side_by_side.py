"""Runs ``torch.amp.GradScaler`` and ``jax_lossscale`` side by side on one sequence.

Shared by the CPU conformance tests and the GPU check. Each step feeds the same
float16-valued gradient pytree to torch (SGD(lr=1) on float32 params, grads as
float32 tensors since torch refuses to unscale float16 grads) and to
``dynamic_loss_scale(optax.sgd(1.0))`` (as float32 copies, or as the float16
arrays themselves with ``grad_dtype``), and records everything that must match.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_lossscale as jls

SHAPES = ((5,), (3, 4), (2, 2, 2), ())


@dataclasses.dataclass
class Step:
  """One step's true gradients and the inf/NaN forced into some of its leaves."""

  true: list[np.ndarray]  # float32
  poison: list[tuple]  # (leaf, flat position, value)

  def scaled(self, scale) -> list[np.ndarray]:
    """float16(true * scale), as a float16 backward pass would produce them.

    Values above 65504 overflow to inf and tiny ones flush to 0 naturally, so
    the scale settles where a real run's would.
    """
    with np.errstate(over="ignore"):
      out = [(t * np.float32(scale)).astype(np.float16) for t in self.true]
    for i, pos, value in self.poison:
      flat = out[i].reshape(-1)
      flat[pos] = value
      out[i] = flat.reshape(out[i].shape)
    return out


def make_sequence(
  seed: int,
  steps: int,
  *,
  overflow_runs: int = 6,
  max_run: int = 4,
  quiet: tuple | None = None,
  magnitudes: tuple = (1e-9, 1e2),
  positive: bool = False,
) -> list[Step]:
  """A seeded sequence of true gradient pytrees (lists of leaves).

  Magnitudes are log-uniform in ``magnitudes``. Besides natural overflow,
  ``overflow_runs`` runs of 1..max_run consecutive steps poison random leaves
  with +inf, -inf or NaN; ``quiet=(a, b)`` keeps steps in [a, b) free of
  forced overflow, so runs longer than a growth interval occur.
  """
  rng = np.random.default_rng(seed)
  lo, hi = np.log10(magnitudes[0]), np.log10(magnitudes[1])
  seq = []
  for _ in range(steps):
    leaves = []
    for shape in SHAPES:
      mag = 10.0 ** rng.uniform(lo, hi, size=shape)
      sign = 1.0 if positive else rng.choice([-1.0, 1.0], size=shape)
      leaves.append(np.asarray(sign * mag, np.float32))
    seq.append(Step(leaves, []))
  allowed = [t for t in range(steps) if not (quiet and quiet[0] <= t < quiet[1])]
  for _ in range(overflow_runs):
    start = int(rng.choice(allowed))
    for t in range(start, min(steps, start + int(rng.integers(1, max_run + 1)))):
      if quiet and quiet[0] <= t < quiet[1]:
        continue
      for i in rng.choice(len(SHAPES), size=int(rng.integers(1, len(SHAPES) + 1)), replace=False):
        size = int(np.prod(SHAPES[i], dtype=np.int64))
        seq[t].poison.append(
          (int(i), int(rng.integers(0, size)), rng.choice([np.inf, -np.inf, np.nan]))
        )
  return seq


@dataclasses.dataclass
class Trace:
  skipped: list[bool]
  scale: list[np.float32]
  tracker: list[int]
  unscaled: list[list[np.ndarray]]  # every step, as unscaling produced them
  params: list[list[np.ndarray]]
  updates: list[list[np.ndarray]] | None = None  # jax only


def run_torch(seq, config: dict, device: str = "cpu") -> Trace:
  import torch

  params = [torch.zeros(s, dtype=torch.float32, device=device, requires_grad=True) for s in SHAPES]
  opt = torch.optim.SGD(params, lr=1.0)
  scaler = torch.amp.GradScaler(device, **config)
  out = Trace([], [], [], [], [])
  for step in seq:
    scaler.scale(torch.ones((), device=device))  # creates _scale lazily, like a loss would
    leaves = step.scaled(scaler.get_scale())
    for p, g in zip(params, leaves):
      p.grad = torch.tensor(g.astype(np.float32), device=device)
    scaler.unscale_(opt)
    found = scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]
    out.skipped.append(bool(sum(v.item() for v in found.values()) > 0))
    out.unscaled.append([p.grad.detach().cpu().numpy().copy() for p in params])
    scaler.step(opt)
    scaler.update()
    out.scale.append(np.float32(scaler.get_scale()))
    out.tracker.append(int(scaler._growth_tracker.item()))
    out.params.append([p.detach().cpu().numpy().copy() for p in params])
  return out


def run_jax(seq, config: dict, *, jit: bool = True, device=None, grad_dtype=np.float32) -> Trace:
  """The same sequence through ``dynamic_loss_scale(optax.sgd(1.0))``.

  ``grad_dtype=np.float16`` feeds the float16 gradient arrays themselves (as a
  float16 backward pass returns them); the default feeds float32 copies, as
  torch gets them. The params are float32 either way, so the updates are.
  """
  tx = jls.dynamic_loss_scale(optax.sgd(1.0), **config)
  put = (lambda x: jax.device_put(x, device)) if device is not None else jnp.asarray
  params = [put(np.zeros(s, np.float32)) for s in SHAPES]
  state = tx.init(params)

  def step(grads, state, params):
    unscaled, _ = jls.unscale_and_check(grads, state.loss_scale.scale)
    updates, state = tx.update(grads, state, params)
    return unscaled, updates, optax.apply_updates(params, updates), state

  step = jax.jit(step) if jit else step
  out = Trace([], [], [], [], [], [])
  for step_data in seq:
    leaves = step_data.scaled(np.asarray(state.loss_scale.scale))
    grads = [put(g.astype(grad_dtype)) for g in leaves]
    unscaled, updates, params, new_state = step(grads, state, params)
    out.updates.append([np.asarray(u) for u in updates])
    s = new_state.loss_scale
    out.skipped.append(bool(s.skipped_steps > state.loss_scale.skipped_steps))
    out.unscaled.append([np.asarray(u) for u in unscaled])
    out.scale.append(np.float32(s.scale))
    out.tracker.append(int(s.growth_tracker))
    out.params.append([np.asarray(p) for p in params])
    state = new_state
  return out


def flush_denormals(x: np.ndarray) -> np.ndarray:
  """XLA on CPU flushes float32 subnormals to (signed) zero; torch on CPU does not."""
  x = np.asarray(x, np.float32)
  tiny = np.finfo(np.float32).tiny
  return np.where(np.abs(x) < tiny, np.copysign(np.float32(0), x), x).astype(np.float32)


def assert_same_bits(a, b, what: str, flush: bool = False):
  a = np.asarray(a, np.float32)
  b = np.asarray(b, np.float32)
  if flush:
    b = flush_denormals(b)
  # NaN payloads may differ; everything else must match bit for bit.
  both_nan = np.isnan(a) & np.isnan(b)
  diff = (a.view(np.int32) != b.view(np.int32)) & ~both_nan
  assert not diff.any(), (
    f"{what}: {diff.sum()} elements differ, e.g. jax={a[diff][:3]} torch={b[diff][:3]}"
  )


def compare(jx: Trace, tr: Trace, *, flush: bool = False) -> int:
  """Asserts the two traces agree at every step; returns the number of steps."""
  assert len(jx.scale) == len(tr.scale)
  for t in range(len(tr.scale)):
    where = f"step {t}"
    assert jx.skipped[t] == tr.skipped[t], (
      f"{where}: skip jax={jx.skipped[t]} torch={tr.skipped[t]}"
    )
    assert_same_bits(jx.scale[t], tr.scale[t], f"{where}: scale")
    assert jx.tracker[t] == tr.tracker[t], (
      f"{where}: tracker jax={jx.tracker[t]} torch={tr.tracker[t]}"
    )
    for i, (u, v) in enumerate(zip(jx.unscaled[t], tr.unscaled[t])):
      assert_same_bits(u, v, f"{where}: unscaled leaf {i}", flush)
    for i, (u, v) in enumerate(zip(jx.updates[t], tr.unscaled[t])):
      if tr.skipped[t]:  # skipped: -0.0 everywhere, so p + u == p bit for bit
        assert_same_bits(u, np.full_like(u, -0.0), f"{where}: skipped update leaf {i}")
      else:  # SGD(lr=1): the update is exactly minus the unscaled gradient
        assert_same_bits(-u, v, f"{where}: update leaf {i}", flush)
    for i, (p, q) in enumerate(zip(jx.params[t], tr.params[t])):
      assert_same_bits(p, q, f"{where}: param leaf {i}", flush)
  return len(tr.scale)
