"""Checkpoint helpers: record the static scaler config and check it on restore.

A :class:`DynamicScaleState`'s arrays (scale, trackers, counters) are pytree
leaves and are saved by any checkpoint library. Its
:class:`DynamicScaleConfig` is static pytree metadata: it is not saved, and
restoring into a target state built by the code supplies it. These helpers
make that explicit: save :func:`scale_config_metadata` beside the checkpoint
(as JSON, e.g. Orbax's ``custom_metadata``) and call
:func:`check_scale_config` on restore, which raises if the code now builds a
different config than the one the checkpoint was written with.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import Iterable

from jax_lossscale._scaler._state import DynamicScaleConfig
from jax_lossscale._scaler._state import scale_states
from jax_lossscale._typing import ScaleSource

_FORMAT = 1


def scale_config_metadata(tree: ScaleSource) -> dict[str, Any]:
  """The static configs of every :class:`DynamicScaleState` in ``tree``, as JSON.

  Args:
    tree: a train state, optimizer state or any pytree holding scale states.

  Returns:
    dict: A JSON-serialisable dict ``{"format": 1, "configs": {path: {field:
    value}}}``, ``path`` being the ``jax.tree_util.keystr`` of each state.
    Floats are Python floats, which JSON round-trips exactly.

  Raises:
    ValueError: if ``tree`` holds no :class:`DynamicScaleState`.

  Examples:
    >>> import jax_lossscale as jls
    >>> meta = jls.checkpoint.scale_config_metadata({"scaler": jls.DynamicScaleState.create(hysteresis=2)})
    >>> meta["configs"]["['scaler']"]["hysteresis"]
    2
  """
  states = scale_states(tree)
  if not states:
    raise ValueError(f"No DynamicScaleState found in the given tree ({type(tree).__name__}).")
  return {
    "format": _FORMAT,
    "configs": {path: dataclasses.asdict(s.config) for path, s in states},
  }


def check_scale_config(
  tree: ScaleSource, metadata: dict[str, Any], *, ignore: Iterable[str] = ()
) -> None:
  """Checks that ``tree``'s scaler configs equal those recorded in ``metadata``.

  Call it with the restore target (or the restored state) and the dict that
  :func:`scale_config_metadata` produced when the checkpoint was saved.

  Args:
    tree: the pytree restored into (it carries the configs the code built).
    metadata: the saved :func:`scale_config_metadata` dict (after a JSON round
      trip).
    ignore: config field names not to compare, for a deliberate change (e.g.
      ``("growth_interval",)``).

  Raises:
    ValueError: naming the state's path, the field, and both values, when a
      config differs; or when the scale states in ``tree`` are not those the
      metadata describes, or ``metadata`` is not such a dict.

  Examples:
    >>> import jax_lossscale as jls
    >>> saved = jls.checkpoint.scale_config_metadata(jls.DynamicScaleState.create(growth_interval=100))
    >>> jls.checkpoint.check_scale_config(jls.DynamicScaleState.create(growth_interval=100), saved)
    >>> jls.checkpoint.check_scale_config(jls.DynamicScaleState.create(), saved)
    Traceback (most recent call last):
      ...
    ValueError: Loss-scale config mismatch at '': growth_interval was 100 when the checkpoint was saved, is 2000 now. Pass ignore=('growth_interval',) if the change is deliberate.
  """
  if not isinstance(metadata, dict) or metadata.get("format") != _FORMAT:
    raise ValueError(
      "metadata must be the dict returned by scale_config_metadata "
      f"(format {_FORMAT}), got {metadata!r}."
    )
  ignore = set(ignore)
  fields = {f.name for f in dataclasses.fields(DynamicScaleConfig)}
  unknown = ignore - fields
  if unknown:
    raise ValueError(f"ignore names unknown config fields: {sorted(unknown)}.")
  saved = metadata["configs"]
  current = dict(scale_states(tree))
  if set(saved) != set(current):
    raise ValueError(
      "The scale states in the tree do not match the checkpoint's: saved at "
      f"{sorted(saved)}, found at {sorted(current)}."
    )
  for path, state in current.items():
    now = dataclasses.asdict(state.config)
    for name in sorted(fields - ignore):
      if name not in saved[path]:
        raise ValueError(f"metadata for {path!r} lacks the config field {name!r}.")
      was = saved[path][name]
      if was != now[name]:
        raise ValueError(
          f"Loss-scale config mismatch at {path!r}: {name} was {was!r} when the "
          f"checkpoint was saved, is {now[name]!r} now. Pass "
          f"ignore=({name!r},) if the change is deliberate."
        )
