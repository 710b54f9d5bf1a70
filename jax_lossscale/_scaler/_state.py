"""The loss-scale configuration and the `DynamicScaleState` pytree."""

from __future__ import annotations

import dataclasses
import math
from typing import Any
from typing import Callable
from typing import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_lossscale._scaler._find import find_all
from jax_lossscale._scaler._find import find_one
from jax_lossscale._typing import ScaleSource

_F32 = np.finfo(np.float32)
#: Smallest normal float32 (2**-126): the default floor of the scale.
MIN_NORMAL_F32 = float(_F32.tiny)
#: Largest finite float32: the default ceiling of the scale.
MAX_F32 = float(_F32.max)


def check_positive_finite(name: str, value: Any) -> float:
  """``value`` as a float: ``TypeError`` naming ``name`` unless a real number,
  ``ValueError`` unless positive and finite."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
    raise TypeError(f"{name} must be a Python or NumPy real number, got {value!r}.")
  value = float(value)
  if not (math.isfinite(value) and value > 0):
    raise ValueError(f"{name} must be positive and finite, got {value!r}.")
  return value


def check_int(name: str, value: Any, minimum: int) -> int:
  """``value`` as an int in ``[minimum, 2**31 - 1]``: ``TypeError`` naming ``name`` unless an
  integer, ``ValueError`` outside the range."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be an integer >= {minimum}, got {value!r}.")
  value = int(value)
  if value < minimum or value > np.iinfo(np.int32).max:
    raise ValueError(f"{name} must be an integer in [{minimum}, 2**31 - 1], got {value!r}.")
  return value


def check_init_scale(value: Any, name: str = "init_scale") -> float:
  """A valid initial scale: a normal, finite, positive float32."""
  value = check_positive_finite(name, value)
  if not MIN_NORMAL_F32 <= value <= MAX_F32:
    raise ValueError(f"{name} must be a normal float32 (in [2**-126, 3.4e38]), got {value!r}.")
  return value


def check_growth_factor(value: Any, name: str = "growth_factor") -> float:
  """A valid growth factor: a finite real > 1."""
  value = check_positive_finite(name, value)
  if value <= 1.0:
    raise ValueError(f"{name} must be > 1, got {value!r}.")
  return value


def check_backoff_factor(value: Any, name: str = "backoff_factor") -> float:
  """A valid backoff factor: a real in (0, 1)."""
  value = check_positive_finite(name, value)
  if value >= 1.0:
    raise ValueError(f"{name} must be in (0, 1), got {value!r}.")
  return value


def check_growth_interval(value: Any, name: str = "growth_interval") -> int:
  """A valid growth interval: an integer in [1, 2**31 - 1]."""
  return check_int(name, value, 1)


def check_min_scale(value: Any, name: str = "min_scale") -> float:
  """A valid floor of the scale: a normal float32 (so the scale never becomes subnormal or 0),
  stored as the float32 value the scale is compared against."""
  value = check_positive_finite(name, value)
  if value < MIN_NORMAL_F32:
    raise ValueError(
      f"{name} must be >= the smallest normal float32 (2**-126 ~ 1.18e-38) "
      f"so that the scale never becomes subnormal, got {value!r}."
    )
  return float(np.float32(value))


def check_max_scale(value: Any, name: str = "max_scale") -> float:
  """A valid ceiling of the scale: a positive finite float32, stored as its float32 value."""
  value = check_positive_finite(name, value)
  if value > MAX_F32:
    raise ValueError(f"{name} must be <= the largest float32, got {value!r}.")
  return float(np.float32(value))


def check_hysteresis(value: Any, name: str = "hysteresis") -> int:
  """A valid hysteresis: an integer in [1, 2**31 - 1]."""
  return check_int(name, value, 1)


def check_dynamic(value: Any, name: str = "dynamic") -> bool:
  """``value`` as a bool: ``TypeError`` naming ``name`` unless a Python or NumPy bool."""
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be a bool, got {value!r}.")
  return bool(value)


class ConfigField(NamedTuple):
  """How one setting of the scaler is checked and carried to and from torch.

  Attributes:
    check: ``check(value, name)`` is the value as stored, or raises ``TypeError`` /
      ``ValueError`` naming ``name`` (the argument, or the state-dict key it came from).
    torch_key: its key in ``torch.amp.GradScaler.state_dict()``; ``None`` where torch keeps
      none (``to_torch_state_dict(strict=True)`` then refuses a value other than the
      default, and ``from_torch_state_dict`` takes it as a keyword).
  """

  check: Callable[[Any, str], Any]
  torch_key: str | None


#: The scaler's settings, written once: every field of :class:`DynamicScaleConfig`, in its
#: order, with its check and its torch key. Torch's ``scale`` is the current scale: exported
#: from the state, imported as the ``init_scale`` of a state that continues mid-run. The
#: entry points forward their keywords with :func:`config_from`; ``tests/test_config_fields.py``
#: holds every signature, docstring and the torch conversions to this list.
CONFIG_FIELDS: dict[str, ConfigField] = {
  "init_scale": ConfigField(check_init_scale, "scale"),
  "growth_factor": ConfigField(check_growth_factor, "growth_factor"),
  "backoff_factor": ConfigField(check_backoff_factor, "backoff_factor"),
  "growth_interval": ConfigField(check_growth_interval, "growth_interval"),
  "min_scale": ConfigField(check_min_scale, None),
  "max_scale": ConfigField(check_max_scale, None),
  "hysteresis": ConfigField(check_hysteresis, None),
  "dynamic": ConfigField(check_dynamic, None),
}


@dataclasses.dataclass(frozen=True)
class DynamicScaleConfig:
  """Static, validated configuration of a loss scaler (hashable, never traced).

  The defaults are those of ``torch.amp.GradScaler``. Construction validates
  every argument and raises ``ValueError`` naming the argument at fault.

  Attributes:
    init_scale: the scale of the first step (rounded to float32, like torch).
    growth_factor: factor applied after ``growth_interval`` clean steps; > 1.
    backoff_factor: factor applied on overflow; in (0, 1).
    growth_interval: number of consecutive clean steps before growing; >= 1.
    min_scale: floor of the scale; >= the smallest normal float32 (2**-126),
      so the scale never becomes subnormal or 0.
    max_scale: ceiling of the scale. Growth beyond it is capped at it; growth
      that would overflow float32 is blocked (the scale is kept), as in torch.
    hysteresis: as Megatron-LM's ``hysteresis``: the number of overflows
      tolerated (step skipped, scale kept) before the scale backs off; the
      budget is refilled at every growth interval. 1 (the default) is torch.
    dynamic: ``False`` keeps the scale fixed at ``init_scale`` (static loss
      scaling); overflowing steps are still skipped and counted.
  """

  init_scale: float = 2.0**16
  growth_factor: float = 2.0
  backoff_factor: float = 0.5
  growth_interval: int = 2000
  min_scale: float = MIN_NORMAL_F32
  max_scale: float = MAX_F32
  hysteresis: int = 1
  dynamic: bool = True

  def __post_init__(self):
    for name, field in CONFIG_FIELDS.items():
      object.__setattr__(self, name, field.check(getattr(self, name), name))  # frozen
    if self.min_scale > self.max_scale:
      raise ValueError(f"min_scale ({self.min_scale!r}) must be <= max_scale ({self.max_scale!r}).")
    # init_scale is kept as given (the first scale is its float32 rounding); the bounds are
    # float32 already.
    if not self.min_scale <= float(np.float32(self.init_scale)) <= self.max_scale:
      raise ValueError(
        f"init_scale ({self.init_scale!r}) must lie in [min_scale, max_scale] = "
        f"[{self.min_scale!r}, {self.max_scale!r}]."
      )


#: The defaults (``torch.amp.GradScaler``'s): every public signature takes its
#: default values from here (checked by ``tests/test_api.py``).
DEFAULT_CONFIG = DynamicScaleConfig()


def config_from(arguments: Mapping[str, Any], **fixed: Any) -> DynamicScaleConfig:
  """The config an entry point's arguments describe: the one forwarding of the settings.

  Every field of :data:`CONFIG_FIELDS` is read by name from ``arguments`` (the entry point's
  ``locals()``), except those given in ``fixed`` (the settings the entry point does not take
  as keywords). An entry point whose signature lacks a field it does not fix fails with a
  ``KeyError`` on every call, rather than leaving that setting at its default.
  """
  taken = {name: arguments[name] for name in CONFIG_FIELDS if name not in fixed}
  return DynamicScaleConfig(**taken, **fixed)


DATA_FIELDS = (
  "scale",
  "growth_tracker",
  "hysteresis_tracker",
  "skipped_steps",
  "consecutive_skips",
)


@dataclasses.dataclass(frozen=True)
class DynamicScaleState:
  """The state of a loss scaler: a pytree of scalar arrays plus static config.

  Create it with :meth:`DynamicScaleState.create`; advance it with
  :func:`jax_lossscale.update_scale`. It is immutable (use ``.replace``), its
  leaves are arrays only (``float32`` and ``int32`` scalars, never weak-typed
  Python numbers) and its :class:`DynamicScaleConfig` is static pytree
  metadata: it survives ``jit``, ``vmap``, ``tree_map`` and checkpoint
  round-trips, and changing it retraces rather than silently reading stale
  values.

  Attributes:
    scale: float32[] current loss scale.
    growth_tracker: int32[] consecutive clean steps since the last growth or
      overflow (torch's ``_growth_tracker``).
    hysteresis_tracker: int32[] overflows still tolerated before backing off.
    skipped_steps: int32[] total number of skipped (non-finite) steps.
    consecutive_skips: int32[] skipped steps in a row (0 after a clean step).
    config: the static :class:`DynamicScaleConfig`.

  Examples:
    >>> import jax_lossscale as jls
    >>> state = jls.DynamicScaleState.create(init_scale=8.0, growth_interval=2)
    >>> state.scale, state.growth_tracker
    (Array(8., dtype=float32), Array(0, dtype=int32))
  """

  scale: jax.Array
  growth_tracker: jax.Array
  hysteresis_tracker: jax.Array
  skipped_steps: jax.Array
  consecutive_skips: jax.Array
  config: DynamicScaleConfig = dataclasses.field(default_factory=DynamicScaleConfig)

  @classmethod
  def create(
    cls,
    *,
    init_scale: float = DEFAULT_CONFIG.init_scale,
    growth_factor: float = DEFAULT_CONFIG.growth_factor,
    backoff_factor: float = DEFAULT_CONFIG.backoff_factor,
    growth_interval: int = DEFAULT_CONFIG.growth_interval,
    min_scale: float = DEFAULT_CONFIG.min_scale,
    max_scale: float = DEFAULT_CONFIG.max_scale,
    hysteresis: int = DEFAULT_CONFIG.hysteresis,
    dynamic: bool = DEFAULT_CONFIG.dynamic,
  ) -> DynamicScaleState:
    """Validates the configuration and returns the initial state.

    Arguments are those of :class:`DynamicScaleConfig` (torch's defaults).

    Raises:
      TypeError: naming the argument, for an argument of the wrong type.
      ValueError: naming the argument, for any invalid value.
    """
    return cls.from_config(config_from(locals()))

  @classmethod
  def from_config(cls, config: DynamicScaleConfig) -> DynamicScaleState:
    """The initial state for an already validated ``config``."""
    if not isinstance(config, DynamicScaleConfig):
      raise TypeError(f"config must be a DynamicScaleConfig, got {type(config).__name__}.")
    # One buffer per leaf: shared buffers cannot be donated (donate_argnums).
    zero = lambda: jnp.zeros([], jnp.int32)
    return cls(
      scale=jnp.asarray(np.float32(config.init_scale), jnp.float32),
      growth_tracker=zero(),
      hysteresis_tracker=jnp.asarray(config.hysteresis, jnp.int32),
      skipped_steps=zero(),
      consecutive_skips=zero(),
      config=config,
    )

  def replace(self, **changes: Any) -> DynamicScaleState:
    """A copy with the given fields replaced."""
    return dataclasses.replace(self, **changes)

  def __getattr__(self, name: str) -> Any:
    # Only reached for a missing attribute: the one Flax users reach for gets directions.
    if name == "value_and_grad":
      raise AttributeError(
        "DynamicScaleState has no value_and_grad: unlike Flax's DynamicScale it is only "
        "the state. Use jax_lossscale.flax.TrainState.value_and_grad (or "
        "jax_lossscale.flax.value_and_grad(fun, state)), which returns "
        "ScaledValueAndGrad(value, aux, grads, finite); apply_gradients then skips and "
        "advances the scale. See the guide 'Coming from Flax's DynamicScale'."
      )
    raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


jax.tree_util.register_dataclass(
  DynamicScaleState, data_fields=list(DATA_FIELDS), meta_fields=["config"]
)


def is_scale_state(x: Any) -> bool:
  """Whether ``x`` is a :class:`DynamicScaleState` (an ``is_leaf`` for tree walks)."""
  return isinstance(x, DynamicScaleState)


def scale_states(tree: Any) -> list[tuple[str, DynamicScaleState]]:
  """Every :class:`DynamicScaleState` in ``tree`` with its ``keystr`` path, in tree order."""
  return find_all(tree, is_scale_state)


def get_scale_state(tree: ScaleSource) -> DynamicScaleState:
  """Finds the :class:`DynamicScaleState` in an optimizer state or train state.

  Searches any nesting of Optax states (``chain``, ``MultiSteps``,
  ``inject_hyperparams``, ``masked``, ``partition``, ...) and any pytree
  holding one (a Flax ``TrainState``, an ``nnx.Optimizer``'s state). Pure
  structure inspection: fine inside ``jit``.

  Args:
    tree: a :class:`DynamicScaleState`, or a pytree containing exactly one.

  Returns:
    The :class:`DynamicScaleState`.

  Raises:
    ValueError: if there is none, or more than one.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import jax_lossscale as jls
    >>> tx = jls.multi_steps(jls.dynamic_loss_scale(optax.adam(1e-3)), 4)
    >>> jls.get_scale_state(tx.init({"w": jnp.zeros(2)})).scale
    Array(65536., dtype=float32)
  """
  return find_one(tree, is_scale_state, lambda found: _scale_state_error(tree, found))


def _scale_state_error(tree: Any, found: list[tuple[str, Any]]) -> ValueError:
  if not found:
    return ValueError(
      "No DynamicScaleState found in the given tree "
      f"({type(tree).__name__}); was the optimizer built with "
      "jax_lossscale.dynamic_loss_scale?"
    )
  return ValueError(
    f"state holds {len(found)} loss scalers (at "
    f"{', '.join(p or '<root>' for p, _ in found)}): which one is meant is ambiguous. For "
    "several param groups or optimizers that share one scale (torch's scaler.step(opt0); "
    "scaler.step(opt1); scaler.update()), wrap them all in ONE "
    "dynamic_loss_scale(optax.multi_transform(...)) or optax.partition; for scalers that "
    "are really separate, pass the sub-state of the one you mean."
  )


def scale_of(scale: Any) -> jax.Array:
  """The float32 scale that ``scale`` stands for: the one resolver of a ``ScaleLike``.

  A Python number or an array is the scale itself; a :class:`DynamicScaleState`, or an
  optimizer or train state holding exactly one, gives its current scale. Used by every
  entry point that takes a scale (``unscale_and_check``, ``scale_loss``,
  ``check_underflow``, ``grad_diagnostics``).

  Raises:
    TypeError: ``scale`` is a string, bytes or ``None``.
    ValueError: a state with no loss scaler, or with several.
  """
  if scale is None or isinstance(scale, (str, bytes)):
    raise TypeError(
      "scale must be a number, an array, or a state holding one loss scaler, got "
      f"{type(scale).__name__}."
    )
  if isinstance(scale, (int, float)) or (hasattr(scale, "dtype") and not is_scale_state(scale)):
    return jnp.asarray(scale, jnp.float32)
  return jnp.asarray(get_scale_state(scale).scale, jnp.float32)
