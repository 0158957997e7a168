"""Rows in tiles: order by count, pad to whole tiles, run, unpad, restore order.

Every implementation runs the same row bookkeeping around its loop, and this
module is its one copy (`in_tiles`): the Mosaic forward and backward kernels
(one program per tile), the XLA backward (one `lax.map` trip per group of
rows) and the XLA forward (one tile: the batch). The Triton kernels read and
write their rows by index instead (`slot_rows`, `schedule.py`).

A tile runs until its slowest row is done, so rows are ordered by descending
count first (tiles then hold rows of similar counts) and put back in the
caller's order afterwards. The batch is padded to whole tiles with rows of
count 0 that copy a real row: the loop still computes them (a tile is
computed whole), their results are dropped, and copying a real row keeps
them finite, so even in a backward pass where they get a zero cotangent they
cannot turn a parameter gradient into NaN (0 * NaN = NaN).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, TypeVar

import jax
from jax import lax
import jax.numpy as jnp
from jax import tree_util
import numpy as np

T = TypeVar("T")


def sorted_descending(counts: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(the counts in descending order, the stable permutation that orders
  them), from one sort: no gather of the counts after it."""
  neg, order = lax.sort((-counts, jnp.arange(counts.shape[0], dtype=jnp.int32)), num_keys=1,
                        is_stable=True)
  return -neg, order


def descending_order(counts: jax.Array) -> jax.Array:
  """Stable permutation putting rows with the largest counts first.

  A sort, not a counting sort: the counts are integers in [0, max_iters],
  but a counting sort (one-hot histogram, exclusive cumsum, stable rank
  within a count, scatter) compiled for an H200 is 6 XLA ops moving 324 KB
  at B=4096, max_iters=64, against the sort's 2 ops and 48 KB.
  """
  return jnp.argsort(-counts, stable=True).astype(jnp.int32)


def inverse_permutation(order: jax.Array, *, by_sort: bool = False) -> jax.Array:
  """`inv` with `take(take(a, order), inv) == a`.

  By a scatter of the positions, or (`by_sort`) by sorting the order: on a
  TPU an int32 scatter of B=32768 rows took 0.18 ms, a sort 0.05 ms
  (RESULTS.md, "The row permutation (run A)").
  """
  if by_sort:
    return jnp.argsort(order).astype(order.dtype)
  return jnp.zeros_like(order).at[order].set(
      jnp.arange(order.shape[0], dtype=order.dtype))


def take_rows(tree: T, index: jax.Array) -> T:
  """Gathers rows `index` of every leaf; the indices are in bounds by
  construction (a permutation or a subset), so no out-of-bounds mask
  (`mode="clip"`: the faster gather on XLA:CPU, see RESULTS.md).

  One gather a leaf: packing the leaves' rows into 32-bit words for one
  gather of them all relays a bfloat16 leaf out on a TPU (its [B, D/2, 2]
  words have a minor dimension of 2), and the permutation took 0.44 ms that
  way against 0.22 ms a leaf at a time (B=32768; RESULTS.md, "Where the
  forward's time goes").

  Example:
    >>> take_rows((jnp.arange(3.0), jnp.array([[1, 2], [3, 4], [5, 6]])), jnp.array([2, 0, 1]))
    (Array([2., 0., 1.], dtype=float32), Array([[5, 6],
           [1, 2],
           [3, 4]], dtype=int32))
  """
  return tree_util.tree_map(lambda a: jnp.take(a, index, axis=0, mode="clip"), tree)


def pad_rows(tree: T, rows: int, *, must_be_finite: bool) -> T:
  """Pads every leaf of `tree` along axis 0 to `rows` rows with copies of its
  last row (zeros when it has none).

  `must_be_finite` says whether the caller relies on the padding being
  finite (a backward, whose padded rows get zero cotangents); the library
  pads the same way either way, and `pallas_loop.testing.poisoned_padding`
  replaces the padding with NaN where it is False, to show that no padded row
  reaches a result.
  """

  def pad(a):
    extra = rows - a.shape[0]
    if extra == 0:
      return a
    if a.shape[0] == 0:
      return jnp.zeros((rows,) + a.shape[1:], a.dtype)
    return jnp.concatenate([a, jnp.broadcast_to(a[-1:], (extra,) + a.shape[1:])], axis=0)

  return tree_util.tree_map(pad, tree)


def padded_rows(batch: int, tile_rows: int) -> int:
  """The batch padded to whole tiles, at least one tile (so that an empty
  batch still gives the loop a shape to compile)."""
  return max(1, -(-batch // tile_rows)) * tile_rows


def slot_rows(counts: jax.Array, rows: int, *, sort: bool) -> tuple[jax.Array, jax.Array]:
  """The rows a kernel that reads its rows by index (`schedule.over_tiles`)
  reads and writes at each of its `rows` sorted positions.

  Position s < B holds the row `order[s]` (the descending order, or the
  identity without `sort`): it is read and written there, in the caller's
  order, so no gather runs before the kernel and no scatter after. A padding
  position s >= B reads the last sorted row (a real row: finite values, and
  the smallest count of its tile, so it adds no trip) and writes row s of
  outputs padded to `rows` rows, cut to B afterwards.

  Args:
    counts: int32 [B].
    rows: the padded row count (`padded_rows`), >= B.
    sort: order by descending count.

  Returns:
    (load, store): int32 [rows] each.

  Example:
    >>> slot_rows(jnp.array([1, 3, 2]), 4, sort=True)
    (Array([1, 2, 0, 0], dtype=int32), Array([1, 2, 0, 3], dtype=int32))
  """
  batch = counts.shape[0]
  order = descending_order(counts) if sort else jnp.arange(batch, dtype=jnp.int32)
  if rows == batch:
    return order, order
  extra = jnp.arange(batch, rows, dtype=jnp.int32)
  load = jnp.concatenate([order, jnp.broadcast_to(order[-1:], (rows - batch,))])
  return load, jnp.concatenate([order, extra])


def in_slabs(run: Callable[[Any, jax.Array], tuple[Any, Any]], per_row: Any,
             counts: jax.Array, *, slabs: int, rows: int,
             must_be_finite: bool) -> tuple[Any, Any]:
  """Runs `run` on `slabs` slabs of `rows` rows, one after another.

  The batch is padded to `slabs * rows` rows (`pad_rows`; count 0 on the
  padding) and cut into slabs that a `lax.map` runs in turn, so that each
  slab's own work (a row permutation, `in_tiles`) has a slab's operands, not
  the batch's: XLA keeps those in VMEM while they fit.

  Args:
    run: run(per_row, counts) -> (per_row_out, other) on one slab: leaves
      [rows, ...] and int32 [rows]; `per_row_out` has a leading row axis of
      `rows`, `other` is stacked over the slabs.
    per_row: pytree of arrays [B, ...] that travel with their rows.
    counts: int32 [B].
    slabs, rows: the slabs and the rows of each (`slabs * rows >= B`).
    must_be_finite: see `pad_rows`.

  Returns:
    (per_row_out cut to B rows, other with a leading axis of `slabs`).

  Example:
    >>> run = lambda rows, n: (rows * n, jnp.sum(n))
    >>> in_slabs(run, jnp.array([1, 2, 3]), jnp.array([1, 3, 2]), slabs=2, rows=2,
    ...          must_be_finite=False)
    (Array([1, 6, 6], dtype=int32), Array([4, 2], dtype=int32))
  """
  batch = counts.shape[0]
  padded = slabs * rows
  per_row = pad_rows(per_row, padded, must_be_finite=must_be_finite)
  counts = jnp.pad(counts, (0, padded - batch))  # padded rows never apply a step
  stacked = tree_util.tree_map(lambda a: a.reshape((slabs, rows) + a.shape[1:]),
                               (per_row, counts))
  out, other = lax.map(lambda slab: run(*slab), stacked)
  return tree_util.tree_map(lambda a: a.reshape((padded,) + a.shape[2:])[:batch], out), other


class RowMoves(NamedTuple):
  """How a backend moves rows into count order and back (`in_tiles`), where
  it has something faster than XLA's gathers (`kernel_tpu_rows.moves`).

  Attributes:
    gather: gather(tree, order) -> every leaf's rows `order` (`take_rows`).
    put_back: put_back(tree, order) -> every leaf's row r at row `order[r]`.
  """

  gather: Callable[[Any, jax.Array], Any]
  put_back: Callable[[Any, jax.Array], Any]


def in_tiles(run: Callable[[Any, jax.Array], tuple[Any, Any]], per_row: Any,
             counts: jax.Array, *, rows: int, sort: bool,
             must_be_finite: bool, invert_by_sort: bool = False,
             moves: RowMoves | None = None) -> tuple[Any, Any]:
  """Runs `run` on the rows ordered by count and padded to `rows` rows.

  Args:
    run: run(per_row, counts) -> (per_row_out, other): the loop on the
      ordered, padded rows (counts int32 [rows], 0 on the padding);
      `per_row_out` has a leading row axis of `rows`, `other` (e.g. per-tile
      parameter-gradient sums) is returned as it is.
    per_row: pytree of arrays [B, ...] that travel with their rows.
    counts: int32 [B]: each row's step count (the order's key).
    rows: the padded row count (`padded_rows`); B when there is no padding.
    sort: order rows by descending count first.
    must_be_finite: see `pad_rows`.
    invert_by_sort: `inverse_permutation(by_sort=True)`.
    moves: how the rows move (None: `take_rows` into order, and back by
      the inverse permutation).

  Returns:
    (per_row_out cut to B rows in the caller's order, other).

  Example:
    >>> run = lambda rows, n: (rows * n, n.shape[0])
    >>> in_tiles(run, jnp.array([1, 2, 3]), jnp.array([1, 3, 2]), rows=4,
    ...          sort=True, must_be_finite=False)
    (Array([1, 6, 6], dtype=int32), 4)
  """
  batch = counts.shape[0]
  if sort:
    # One sort yields the order and the sorted counts (no gather of the counts).
    counts, order = sorted_descending(counts)
    per_row = moves.gather(per_row, order) if moves else take_rows(per_row, order)
  per_row = pad_rows(per_row, rows, must_be_finite=must_be_finite)
  counts = jnp.pad(counts, (0, rows - batch))  # padded rows never apply a step
  out, other = run(per_row, counts)
  out = tree_util.tree_map(lambda a: a[:batch], out)
  if sort:
    out = (moves.put_back(out, order) if moves
           else take_rows(out, inverse_permutation(order, by_sort=invert_by_sort)))
  return out, other
