"""Conversion to and from ``torch.amp.GradScaler.state_dict()`` (torch is not imported)."""

from __future__ import annotations

import math
import numbers
from typing import Any
from typing import Mapping

import jax.numpy as jnp
import numpy as np

from jax_lossscale._scaler._state import CONFIG_FIELDS
from jax_lossscale._scaler._state import DEFAULT_CONFIG
from jax_lossscale._scaler._state import DynamicScaleState
from jax_lossscale._scaler._state import config_from
from jax_lossscale._scaler._state import get_scale_state
from jax_lossscale._typing import ScaleSource

#: The config fields torch keeps, by their key in its state dict; the others, which torch
#: keeps none of, are the keywords of ``from_torch_state_dict``.
_IN_TORCH = {f.torch_key: name for name, f in CONFIG_FIELDS.items() if f.torch_key is not None}
#: The keys of an enabled ``GradScaler``'s state dict, in torch's order.
TORCH_KEYS = (*_IN_TORCH, "_growth_tracker")


def _host_scalar(name: str, x: Any) -> np.ndarray:
  """A leaf of the scaler state as a NumPy scalar (a host read; not traceable)."""
  x = getattr(x, "get_value", lambda: x)()  # an nnx.Variable holds its array
  try:
    value = np.asarray(x)
  except Exception as e:  # a tracer: jax raises a TracerArrayConversionError
    raise ValueError(
      f"to_torch_state_dict reads {name} on the host; call it outside jit (got {type(x).__name__})."
    ) from e
  if value.shape != ():
    raise ValueError(f"{name} must be a scalar, got shape {value.shape}.")
  return value


def to_torch_state_dict(state: ScaleSource, *, strict: bool = True) -> dict[str, Any]:
  """The scaler state as ``torch.amp.GradScaler.state_dict()`` would write it.

  Pass the result to ``GradScaler.load_state_dict`` (or save it in a torch
  checkpoint): torch continues from the same scale and growth tracker, and
  with the same configuration, so both take the same steps from there on.
  Reads device values, so call it outside ``jit``.

  Torch keeps no ``min_scale``, ``max_scale``, ``hysteresis`` or skip
  counters. With ``strict=True`` (the default) a configuration that torch
  cannot reproduce (``min_scale``/``max_scale`` other than the defaults,
  ``hysteresis > 1``, or a static scale) is an error; ``strict=False`` drops
  those settings.

  Args:
    state: a :class:`DynamicScaleState`, or any tree holding exactly one (an
      optimizer state, a train state, an ``nnx.Optimizer``'s ``opt_state``).
    strict: refuse settings that torch would silently lose.

  Returns:
    dict: ``{"scale": float, "growth_factor": float, "backoff_factor": float,
    "growth_interval": int, "_growth_tracker": int}`` (Python numbers, as
    torch writes them).

  Raises:
    ValueError: if no scaler state is found, it is traced, or (``strict``)
      its configuration has no torch equivalent.

  Examples:
    >>> import jax_lossscale as jls
    >>> s = jls.DynamicScaleState.create(init_scale=1024.0, growth_interval=100)
    >>> jls.torch.to_torch_state_dict(s)
    {'scale': 1024.0, 'growth_factor': 2.0, 'backoff_factor': 0.5, 'growth_interval': 100, '_growth_tracker': 0}
  """
  s = get_scale_state(state)
  c = s.config
  if strict:
    lost = [
      f"{name}={getattr(c, name)!r}" + (" (a static scale)" if name == "dynamic" else "")
      for name, field in CONFIG_FIELDS.items()
      if field.torch_key is None and getattr(c, name) != getattr(DEFAULT_CONFIG, name)
    ]
    if lost:
      raise ValueError(
        "torch.amp.GradScaler cannot represent " + ", ".join(lost) + "; pass "
        "strict=False to drop these settings."
      )
  # Torch's scale is the current one; each other key holds its config field (a Python
  # float or int, as the config stores it).
  sd: dict[str, Any] = {"scale": float(_host_scalar("scale", s.scale))}
  for key, name in _IN_TORCH.items():
    if key != "scale":
      sd[key] = getattr(c, name)
  sd["_growth_tracker"] = int(_host_scalar("growth_tracker", s.growth_tracker))
  return sd


def _is_scalar_number(x: Any) -> bool:
  """A Python/NumPy real, or a 0-d array or tensor of one (never a bool)."""
  if isinstance(x, (bool, np.bool_)) or "bool" in str(getattr(x, "dtype", "")):
    return False  # also 0-d bool arrays and tensors (torch.bool)
  return isinstance(x, numbers.Real) or (hasattr(x, "__float__") and getattr(x, "ndim", None) == 0)


def _real(sd: Mapping, key: str) -> float:
  x = sd[key]
  if not _is_scalar_number(x):
    raise TypeError(f"state_dict[{key!r}] must be a real number, got {x!r}.")
  value = float(x)
  if not math.isfinite(value):
    raise ValueError(f"state_dict[{key!r}] must be finite, got {value!r}.")
  return value


def _integer(sd: Mapping, key: str) -> int:
  x = sd[key]
  if _is_scalar_number(x):
    value = x.item() if hasattr(x, "item") else x
    if isinstance(value, numbers.Integral):
      return int(value)
  raise TypeError(f"state_dict[{key!r}] must be an integer, got {x!r}.")


def _field(sd: Mapping, key: str) -> float | int:
  """The value of a config field's key, an integer where its field is one, else a real."""
  integral = type(getattr(DEFAULT_CONFIG, _IN_TORCH[key])) is int
  return _integer(sd, key) if integral else _real(sd, key)


def from_torch_state_dict(
  sd: Mapping[str, Any],
  *,
  min_scale: float = DEFAULT_CONFIG.min_scale,
  max_scale: float = DEFAULT_CONFIG.max_scale,
  hysteresis: int = DEFAULT_CONFIG.hysteresis,
) -> DynamicScaleState:
  """A :class:`DynamicScaleState` from ``torch.amp.GradScaler.state_dict()``.

  The state continues exactly where torch stopped: same scale (as float32),
  same growth tracker, same growth/backoff factors and interval, so a run moved
  from torch continues with the identical scale trajectory. Skip counters,
  which torch does not keep, start at 0. Use it as the ``dynamic_scale`` of a
  :class:`jax_lossscale.flax.TrainState`, or put it into an optimizer state
  made by :func:`dynamic_loss_scale` with the same settings::

    opt_state = opt_state._replace(loss_scale=jls.torch.from_torch_state_dict(sd))

  Args:
    sd: the dict returned by ``GradScaler.state_dict()``, with keys
      ``scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``
      and ``_growth_tracker``.
    min_scale: floor of the scale (not in torch's dict).
    max_scale: ceiling of the scale (not in torch's dict).
    hysteresis: overflows tolerated before backing off (1 = torch).

  Returns:
    The :class:`DynamicScaleState`.

  Raises:
    TypeError: ``sd`` is not a dict, or a value is not a number (an integer
      where torch stores one), naming the key.
    ValueError: for an empty dict (saved from a disabled ``GradScaler``),
      missing or unknown keys, or invalid values, naming the key.

  Examples:
    >>> import jax_lossscale as jls
    >>> sd = {"scale": 32768.0, "growth_factor": 2.0, "backoff_factor": 0.5,
    ...       "growth_interval": 2000, "_growth_tracker": 17}
    >>> s = jls.torch.from_torch_state_dict(sd)
    >>> s.scale, s.growth_tracker
    (Array(32768., dtype=float32), Array(17, dtype=int32))
  """
  if not isinstance(sd, Mapping):
    raise TypeError(f"sd must be a dict (GradScaler.state_dict()), got {type(sd).__name__}.")
  if len(sd) == 0:
    raise ValueError(
      "sd is empty: it was saved from a disabled GradScaler (enabled=False), "
      "which keeps no scale. Use jax_lossscale.no_loss_scale for unscaled "
      "training, or dynamic_loss_scale to start scaling afresh."
    )
  missing = [k for k in TORCH_KEYS if k not in sd]
  if missing:
    raise ValueError(f"sd is missing the GradScaler keys {missing}; it has {sorted(sd)}.")
  unknown = sorted(str(k) for k in sd if k not in TORCH_KEYS)
  if unknown:
    raise ValueError(f"sd has keys unknown to GradScaler.state_dict(): {unknown}.")

  key = lambda k: f"state_dict[{k!r}]"
  tracker = _integer(sd, "_growth_tracker")
  if not 0 <= tracker <= np.iinfo(np.int32).max:
    raise ValueError(f"{key('_growth_tracker')} must be in [0, 2**31 - 1], got {tracker}.")
  # Each torch key is checked under its own name, then passed as its field.
  from_sd = {
    name: CONFIG_FIELDS[name].check(_field(sd, k), key(k)) for k, name in _IN_TORCH.items()
  }
  config = config_from(locals(), dynamic=True, **from_sd)
  state = DynamicScaleState.from_config(config)
  return state.replace(growth_tracker=jnp.asarray(tracker, jnp.int32))
