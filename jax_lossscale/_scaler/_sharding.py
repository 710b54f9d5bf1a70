"""Where the scaler's arrays live: placement at init, and combining across a named axis."""

from __future__ import annotations

from typing import Any
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
import numpy as np


def _mesh_of(params: Any):
  """The mesh of the first concrete params leaf placed by a ``NamedSharding``, or ``None``."""
  for x in jax.tree_util.tree_leaves(params):
    if isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array):
      continue
    if isinstance(x.sharding, NamedSharding):
      return x.sharding.mesh
  return None


def place_like_params(tree: Any, params: Any) -> Any:
  """``tree`` with its single-device leaves replicated over the params' mesh.

  An eager ``init`` builds its scalars (the loss scale, the trackers, Adam's
  step count) with ``jnp.zeros`` and friends: arrays on one local device.
  Under ``jax.distributed`` such arrays are local to one process, and
  checkpointing libraries refuse to save them. When ``params`` are placed on
  a mesh (``NamedSharding``), every such leaf of ``tree`` becomes a global
  array replicated over that mesh, with the same value. Leaves already placed
  on a mesh, tracers (``init`` under ``jit``), and trees whose params are not
  on a mesh are returned unchanged.
  """
  mesh = _mesh_of(params)
  if mesh is None:
    return tree
  replicated = NamedSharding(mesh, PartitionSpec())

  def place(x):
    if isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array):
      return x
    if isinstance(x.sharding, NamedSharding) or not x.is_fully_addressable:
      return x
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, replicated, lambda index: host[index])

  return jax.tree_util.tree_map(place, tree)


def across_axis(reduce: Callable[[Any, Any], Any], x: Any, axis_name: Any | None) -> Any:
  """``reduce(x, axis_name)`` (a ``lax.psum``/``pmean``), or ``x`` when ``axis_name`` is ``None``.

  Raises:
    ValueError: if ``axis_name`` is not bound here, i.e. the call is not
      inside ``shard_map``/``pmap`` over that axis.
  """
  if axis_name is None:
    return x
  try:
    return reduce(x, axis_name)
  except NameError as e:
    raise ValueError(
      f"axis_name={axis_name!r} is not a bound axis here. axis_name is for code "
      "that runs per device inside jax.shard_map or jax.pmap over that axis, so "
      "that every device takes the same skip decision. Under plain jax.jit with "
      "sharded arrays, leave axis_name=None: the check already sees the whole "
      "global gradients."
    ) from e


def all_devices_finite(finite: jax.Array, axis_name: Any | None) -> jax.Array:
  """``finite`` on every device of ``axis_name`` (an AND across the axis)."""
  if axis_name is None:
    return finite
  bad = across_axis(jax.lax.psum, (~finite).astype(jnp.int32), axis_name)
  return bad == 0
