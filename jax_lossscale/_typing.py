"""Type aliases of the public signatures.

JAX has no static pytree type: a pytree is ``Any`` to a type checker (as ``optax.Params``,
``optax.Updates`` and ``chex.ArrayTree`` are). The aliases below name what each argument
must be, for readers and for the API reference.
"""

from collections.abc import Hashable
from typing import Any

from jax.typing import ArrayLike as ArrayLike
from jax.typing import DTypeLike as DTypeLike

PyTree = Any
"""A pytree of arrays (nested tuples, lists, dicts, dataclasses; ``None`` is an empty subtree)."""

ScaleSource = Any
"""Anything that holds exactly one ``DynamicScaleState``.

The state itself, an optimizer state of ``dynamic_loss_scale``, a Flax ``TrainState``, an
``nnx.Optimizer``'s ``opt_state``, or any pytree around one of them.
"""

ScaleLike = Any
"""The scale to use: a ``ScaleSource``, or the scale itself as a float32 scalar."""

AxisName = Hashable
"""A named mesh axis of ``pmap``/``shard_map`` (a string, or a tuple of them)."""

__all__ = ("ArrayLike", "AxisName", "DTypeLike", "PyTree", "ScaleLike", "ScaleSource")
