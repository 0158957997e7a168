"""The XLA backward: the checkpointed window VJP (`loop_reverse.py`) on
groups of rows, skipping most of the finished rows' work.

Rows are ordered by descending window length and cut into `group_count(B)`
equal groups (`tiling.in_tiles`); `lax.map` runs `reverse_window` on one
group after another, each to its own longest window, so the work tracks
sum(n) roughly as the kernel's sorted tiles do, and the buffers hold one
group's states at a time. Parameter gradients are summed over the groups in
float32.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
from jax import lax
from jax import tree_util
import jax.numpy as jnp

from pallas_loop._src import loop_reverse
from pallas_loop._src.step import step_fn as step_fn_lib
from pallas_loop._src import tiling
from pallas_loop._src.operands import Gradients, WindowOperands


@tree_util.register_pytree_node_class
class ArrayBuffer:
  """`size` states in arrays [size, R, ...], carried through the loops."""

  def __init__(self, arrays: Any) -> None:
    self.arrays = arrays

  @classmethod
  def zeros(cls, size: int, like: Any) -> ArrayBuffer:
    return cls(tree_util.tree_map(lambda a: jnp.zeros((size,) + a.shape, a.dtype), like))

  def read(self, k: int | jax.Array) -> Any:
    return tree_util.tree_map(
        lambda b: lax.dynamic_index_in_dim(b, k, 0, keepdims=False), self.arrays)

  def write(self, k: int | jax.Array, value: Any) -> ArrayBuffer:
    return ArrayBuffer(tree_util.tree_map(
        lambda b, v: lax.dynamic_update_index_in_dim(b, v, k, 0), self.arrays, value))

  def tree_flatten(self) -> tuple[tuple[Any], None]:
    return (self.arrays,), None

  @classmethod
  def tree_unflatten(cls, _: None, children: Sequence[Any]) -> ArrayBuffer:
    return cls(children[0])


@tree_util.register_pytree_node_class
class ArraySum:
  """A float32 running sum of a pytree (None leaves stay None)."""

  def __init__(self, total: Any) -> None:
    self.total = total

  @classmethod
  def zeros(cls, like: Any) -> ArraySum:
    return cls(loop_reverse.float32_zeros(like))

  def add(self, value: Any) -> ArraySum:
    return ArraySum(tree_util.tree_map(
        lambda a, b: a if a is None else a + b.astype(jnp.float32), self.total, value,
        is_leaf=lambda v: v is None))

  def tree_flatten(self) -> tuple[tuple[Any], None]:
    return (self.total,), None

  @classmethod
  def tree_unflatten(cls, _: None, children: Sequence[Any]) -> ArraySum:
    return cls(children[0])


# Rows per group of the XLA backward: the batch is ordered by window length
# and cut into groups of about this many rows (at most MAX_GROUPS groups),
# each reversed only to its own longest window, like the kernel's tiles.
GROUP_ROWS = 128
MAX_GROUPS = 8


def group_count(batch: int) -> int:
  """How many row groups the XLA backward uses for a batch of `batch` rows."""
  return max(1, min(MAX_GROUPS, batch // GROUP_ROWS))


def backward(step_fn: step_fn_lib.StepFn, ops: WindowOperands, *, window: int,
             every: int | None = None) -> Gradients:
  """The window VJP of `ops` in XLA.

  Args:
    step_fn: the body; its step (not the halt criterion) is differentiated.
    ops: the window (leaves [B, ...]; t0, n, row_ids int32 [B]).
    window: static bound on `ops.n`.
    every: checkpoint interval (default `loop_reverse.default_every(window)`).

  Returns:
    (g_params, g_consts, g_h_start, g_x), cast to the operands' dtypes (None
    for integer leaves).
  """
  every = every or loop_reverse.default_every(window)
  shared = (ops.params, ops.consts)
  batch = ops.n.shape[0]
  groups = group_count(batch)
  size = tiling.padded_rows(batch, groups) // groups  # >= 1 row: an empty batch too
  split = lambda tree: tree_util.tree_map(
      lambda a: a.reshape((groups, size) + a.shape[1:]), tree)
  merge = lambda tree: tree_util.tree_map(
      lambda a: a.reshape((groups * size,) + a.shape[2:]), tree)

  def one_group(operands: tuple[Any, ...]) -> tuple[Any, Any, Any]:
    h, x, g, g_ys, t0, ids, n = operands
    # Slot `index` of each row's output cotangents ([R, T, ...] leaves).
    g_ys_at = None if g_ys is None else lambda index: tree_util.tree_map(
        lambda a: lax.dynamic_index_in_dim(a, index, 1, keepdims=False), g_ys)
    g_h, acc_shared, acc_x = loop_reverse.reverse_window(
        step_fn.new_state_and_output, shared, h, x, t0[:, None], n[:, None], ids[:, None], g,
        every=every, ckpt=ArrayBuffer.zeros(loop_reverse.checkpoint_slots(window, every), h),
        seg=ArrayBuffer.zeros(every, h),
        acc_shared=ArraySum.zeros(shared), acc_x=ArraySum.zeros(x),
        aligned=step_fn.indexed or step_fn.outputs, g_ys_at=g_ys_at)
    return g_h, acc_shared.total, acc_x.total

  def on_groups(per_row: tuple[Any, ...], n: jax.Array) -> tuple[tuple[Any, Any], Any]:
    g_h, g_shared, g_x = lax.map(one_group, split((*per_row, n)))
    return (merge(g_h), merge(g_x)), g_shared

  (g_h, g_x), g_shared = tiling.in_tiles(
      on_groups, (ops.h_start, ops.x, ops.g, ops.g_ys, ops.t0, ops.row_ids), ops.n,
      rows=groups * size, sort=True, must_be_finite=True)
  g_shared = tree_util.tree_map(lambda a: jnp.sum(a, axis=0), g_shared)
  g_params, g_consts = loop_reverse.cast_like(g_shared, shared)
  return g_params, g_consts, g_h, loop_reverse.cast_like(g_x, ops.x)
