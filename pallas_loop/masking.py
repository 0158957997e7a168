"""One masked step of the recurrence, shared by the kernel and the XLA path.

Written with the operations both Pallas backends lower (where, broadcast,
reductions over trailing axes, no reshapes of 2-D-or-more values), so the
kernel and the XLA implementation run literally the same step logic.
Rows are the leading axis; a row predicate travels as bool [R, 1].
"""

from __future__ import annotations

import jax
from jax import lax
from jax import tree_util
import jax.numpy as jnp


def row_mask(active: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Broadcasts a [R, 1] row predicate to a leaf of shape [R, ...]."""
  if len(shape) == 1:
    return active.reshape(shape)
  return lax.broadcast_in_dim(active, shape, (0, 1))


def row_sum_squares(d: jax.Array) -> jax.Array:
  """[R, ...] -> [R, 1]: per-row sum of squares, reducing one axis at a time."""
  d = d * d
  while d.ndim > 2:
    d = jnp.sum(d, axis=-1)
  if d.ndim == 1:
    return d.reshape(d.shape[0], 1)
  return jnp.sum(d, axis=1, keepdims=True)


def masked_step(apply_step, shared, h, x, active, elems_per_row):
  """One step for a group of rows: rows with `active` False keep their state.

  Returns:
    (h, rms): the new state and, per row, the rms of this step's update as
    float32 [R, 1] (meaningful only where `active`).
  """
  h_new = apply_step(shared, h, x)
  ss = sum(row_sum_squares(n.astype(jnp.float32) - o.astype(jnp.float32))
           for n, o in zip(tree_util.tree_leaves(h_new), tree_util.tree_leaves(h)))
  rms = jnp.sqrt(ss * (1.0 / max(elems_per_row, 1)))
  h = tree_util.tree_map(lambda n, o: jnp.where(row_mask(active, o.shape), n, o),
                         h_new, h)
  return h, rms
