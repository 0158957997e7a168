"""The TPU's row permutation: rows moved into count order and back by vector loads in VMEM.

Legend (shapes in comments):
  B: rows of the array moved   D: a row's width   G: rows one program writes or reads

The group kernels (`kernel_tpu_groups.py` and its backward) run rows sorted
by count, so every leaf that travels with its rows is gathered into count
order before the kernel and put back after it. XLA's gather on a v5e moves a
row about every 1.7-2.3 ns (`benchmarks/tpu_row_dma.py`), and the put-back
needs the inverse permutation, a second sort. Here a program holds the whole
array in VMEM and moves one row per vector load and store, each addressed by a
scalar of the order read from SMEM: the whole gather of a float32 [32768, 128]
array took 0.043 ms against XLA's 0.077, with its own reads and writes of HBM
(RESULTS.md, "Rows moved by vector loads (run U)"). The put-back is a scatter
by the order itself (`out[order[r]] = rows[r]`), so no inverse is computed.

A 32-bit row is one sublane of a (8, 128) tile and moves as it is. A 16-bit
row is half of a packed sublane, which Mosaic cannot load alone ("cannot
statically prove that index in dimension 0 is a multiple of 8"): those arrays
are widened to float32 in VMEM scratch first (exact for bfloat16 and float16)
and narrowed back on the way out.

What the kernels do not take (not 2-D, other dtypes, a width that is not a
multiple of 128 lanes, rows not a multiple of 128, an array that would not fit
the VMEM it may use) moves by XLA's gather as before (`gather`, `put_back`).
Under `vmap` the mapped arrays' rows are merged into one launch (`_batched`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from jax import lax
from jax import tree_util
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp

from pallas_loop._src import tiling

# Whether the group kernels move their rows with these kernels (False: with
# XLA's gathers, as before; `benchmarks.tpu_split` times both).
KERNELS = True
# An array is moved by the kernels while its rows, widened to 32 bits, take
# at most this many bytes (the whole array lives in VMEM, double-buffered by
# the pipeline, plus the float32 scratch of a 16-bit array): a [32768, 128]
# float32 array is 16 MiB; the slabs (`kernel_tpu_groups.SLAB_BYTES`) keep a
# slab's leaves below it.
LARGEST_BYTES = 24 * 2**20
# Rows a program writes (gather) or reads (scatter): its slice of the order
# lives in SMEM.
LARGEST_GROUP = 2048
# The gather's loop body, as compiled for a v5e (libtpu 0.0.42.1, deviceless,
# `benchmarks.tpu_bundles`' reading of the final bundles): a row costs a
# scalar load of its index, its address, a vector load, a sublane rotation
# and a select. Reading a tile's indices through one view of the order
# (`SMEM_VIEW`) drops an add a row, and a body of 128 rows instead of 64
# spreads the chain's latency over more of them: a float32 [32768, 128]
# gather's body went from 103 bundles for 64 rows to 160 for 128 (1.61 to
# 1.25 cycles a row), a bfloat16 one's from 109 to 188 (1.70 to 1.47). The
# scatter (a scalar load, an address and a store a row) spills scalar
# registers with the view in a body of 64 rows (127 bundles against 119):
# with the view, 32 rows a body (51 bundles for float32, 1.59 cycles a row
# against 1.86; 60 for bfloat16, 1.88 as before).
SMEM_VIEW = True
GATHER_ROWS_A_TRIP = 128
SCATTER_ROWS_A_TRIP = 32
# A program's slice of the order is a 1-D SMEM block of G entries, a power of
# two of at least 128: Mosaic's rule for a 1-D block admits the whole order
# too, but libtpu 0.0.48.1 crashed (SIGSEGV) compiling a whole order of 48 or
# 1040 entries (deviceless; 0.0.42.1 compiled them).
_SMALLEST_GROUP = 128
# The 16-bit arrays' widening and narrowing run over pieces of this many rows.
_PIECE = 512
_MIB = 2**20


def movable(a: Any) -> bool:
  """Whether the kernels move `a`'s rows: a 2-D array of a 32-bit dtype, or
  of bfloat16/float16, with a multiple of 128 rows (`_group_rows`) and of 128
  lanes, at most `LARGEST_BYTES` widened to 32 bits.

  Example:
    >>> movable(jnp.zeros((4096, 128), jnp.bfloat16)), movable(jnp.zeros((4096,), jnp.int32))
    (True, False)
  """
  shape: tuple[int, ...] = tuple(getattr(a, "shape", ()))
  if len(shape) != 2:
    return False
  rows, width = shape
  dtype = jnp.dtype(getattr(a, "dtype", jnp.float32))
  return (rows > 0 and rows % _SMALLEST_GROUP == 0
          and width % 128 == 0 and rows * width * 4 <= LARGEST_BYTES
          and (dtype.itemsize == 4 or dtype in (jnp.bfloat16, jnp.float16)))


def moves(interpret: Any) -> tiling.RowMoves | None:
  """The group kernels' `tiling.in_tiles` moves: these kernels' (with
  `pallas_call`'s `interpret=` of the backend), or None (XLA's gathers)
  where `KERNELS` is False.

  Example:
    >>> moves(interpret=True).gather is not None
    True
  """
  if not KERNELS:
    return None
  return tiling.RowMoves(functools.partial(gather, interpret=interpret),
                         functools.partial(put_back, interpret=interpret))


def gather(tree: Any, order: jax.Array, *, interpret: Any = False) -> Any:
  """Every leaf's rows `order`: `tiling.take_rows`, by the kernel where the
  leaf is `movable`, by XLA's gather elsewhere (None leaves stay None).

  Args:
    tree: pytree of [B, ...] arrays (or None).
    order: int32 [B], a permutation of range(B).
    interpret: `pallas_call`'s `interpret=` (the backend's).

  Example:
    >>> x = jnp.arange(128 * 128, dtype=jnp.float32).reshape(128, 128)
    >>> order = jnp.arange(128, dtype=jnp.int32)[::-1]
    >>> bool((gather(x, order, interpret=True) == x[::-1]).all())
    True
  """
  return tree_util.tree_map(
      lambda a: _batched(_gather, interpret)(a, order) if movable(a)
      else tiling.take_rows(a, order), tree)


def put_back(tree: Any, order: jax.Array, *, interpret: Any = False) -> Any:
  """Every leaf's rows put back in the caller's order: row r of a leaf goes
  to row `order[r]` (the inverse of `gather`), by the kernel's scatter where
  the leaf is `movable`, else by XLA's gather with the inverse permutation
  (computed only then, by a sort: `tiling.inverse_permutation`).

  Example:
    >>> x = jnp.arange(128 * 128, dtype=jnp.float32).reshape(128, 128)
    >>> order = jnp.roll(jnp.arange(128, dtype=jnp.int32), 5)
    >>> y = gather(x, order, interpret=True)
    >>> bool((put_back(y, order, interpret=True) == x).all())
    True
  """
  leaves, treedef = tree_util.tree_flatten(tree)
  inverse = None
  out = []
  for a in leaves:
    if movable(a):
      out.append(_batched(_scatter, interpret)(a, order))
      continue
    if inverse is None:
      inverse = tiling.inverse_permutation(order, by_sort=True)
    out.append(tiling.take_rows(a, inverse))
  return tree_util.tree_unflatten(treedef, out)


def _batched(move, interpret: Any):
  """`move(a, order, interpret)` (`_gather` or `_scatter` on one `movable`
  array) as a function of (a, order) that composes with `vmap`: mapped over
  V arrays of B rows, their rows are merged into one array of V*B rows (the
  order of array v offset by v*B), moved as one array by `gather` or
  `put_back` (the kernel's launch, or XLA's gather where the merged array is
  not `movable`), and split again. (Pallas' own
  batching of these kernels failed with JAX 0.11.2: "safe_zip() argument 1
  has length 1 but argument 0 has length 2".)"""

  @jax.custom_batching.custom_vmap
  def moved(a, order):
    return move(a, order, interpret)

  @moved.def_vmap
  def rule(axis_size, in_batched, a, order):
    a_batched, order_batched = in_batched
    if not a_batched:
      a = jnp.broadcast_to(a, (axis_size,) + a.shape)
    if not order_batched:
      order = jnp.broadcast_to(order, (axis_size,) + order.shape)
    maps, batch = order.shape
    merged = a.reshape((maps * batch,) + a.shape[2:])
    offsets = (jnp.arange(maps, dtype=order.dtype) * batch)[:, None]
    merged_order = (order + offsets).reshape(-1)
    # Under an outer vmap, the merged array's move batches by this rule again.
    whole = gather if move is _gather else put_back
    return whole(merged, merged_order, interpret=interpret).reshape(a.shape), True

  return moved


def _group_rows(batch: int) -> int:
  """G: the most rows up to `LARGEST_GROUP` that divide the batch (a power of
  two, at least 128: the batch is a multiple of 128, `movable`)."""
  group = LARGEST_GROUP
  while batch % group:
    group //= 2
  return group


def _wide(dtype) -> bool:
  return jnp.dtype(dtype).itemsize == 2


def _params(a: jax.Array, group: int) -> pltpu.CompilerParams:
  """The VMEM a kernel asks for: the whole array twice (the pipeline's two
  buffers), its float32 scratch for a 16-bit array, two row blocks, headroom."""
  batch, width = a.shape
  whole = batch * width * a.dtype.itemsize
  need = 2 * whole + (batch * width * 4 if _wide(a.dtype) else 0)
  need += 4 * group * width * a.dtype.itemsize + 8 * _MIB
  return pltpu.CompilerParams(dimension_semantics=("arbitrary",),
                              vmem_limit_bytes=-(-need // _MIB) * _MIB)


def _order_block(group: int) -> pl.BlockSpec:
  # int32 [G]: a program's slice of the order, in SMEM.
  return pl.BlockSpec((group,), lambda g: (g,), memory_space=pltpu.SMEM)


def _whole(batch: int, width: int) -> pl.BlockSpec:
  # [B, D]: the whole array, one block every program sees (read once).
  return pl.BlockSpec((batch, width), lambda g: (0, 0))


def _rows(group: int, width: int) -> pl.BlockSpec:
  # [G, D]: program g's rows.
  return pl.BlockSpec((group, width), lambda g: (g, 0))


def _convert(src_ref, dst_ref, rows: int) -> None:
  """dst = src converted to dst's dtype, `_PIECE` rows at a time (a value of
  the whole array would be unrolled into one op per vector register)."""
  piece = _PIECE
  while rows % piece:  # rows: a multiple of 128 (`movable`)
    piece //= 2

  def each(p, carry):
    at = pl.ds(pl.multiple_of(p * piece, piece), piece)
    dst_ref[at, :] = src_ref[at, :].astype(dst_ref.dtype)
    return carry

  lax.fori_loop(0, rows // piece, each, 0)


def _launch(kernel, a: jax.Array, order: jax.Array, interpret: Any, *, gather: bool,
            name: str) -> jax.Array:
  """The `pallas_call` of a row kernel: a grid over groups of G rows, each
  program given its slice of the order in SMEM; the whole array on one side
  (a gather's input, a scatter's output) and the group's rows on the other;
  a 16-bit array's float32 scratch.

  The result comes back behind an optimization barrier: XLA would otherwise
  fuse a consumer that writes it into a larger buffer (a `lax.map`'s or a
  scan's stacked output, as the slabs' loop has) into the kernel, compiled
  under the default scoped VMEM limit (16 MiB) instead of the kernel's own:
  "Ran out of memory in memory space vmem" for a [32768, 128] bfloat16
  scatter in the slabs of B=262144 (libtpu 0.0.42.1, deviceless)."""
  batch, width = a.shape
  group = _group_rows(batch)
  whole, rows = _whole(batch, width), _rows(group, width)
  out = pl.pallas_call(
      kernel, grid=(batch // group,),
      in_specs=[_order_block(group), whole if gather else rows],
      out_specs=rows if gather else whole,
      out_shape=jax.ShapeDtypeStruct(a.shape, a.dtype),
      scratch_shapes=[pltpu.VMEM((batch, width), jnp.float32)] if _wide(a.dtype) else [],
      compiler_params=_params(a, group),
      interpret=interpret,
      name=name,
  )(order, a)
  return lax.optimization_barrier(out)


def _tile(dtype) -> int:
  """Rows moved a loop trip, joined into one load or store: a 32-bit sublane
  tile holds 8 rows, a packed 16-bit one 16."""
  return 16 if _wide(dtype) else 8


def _tile_indices(order_ref, base, tile: int):
  """index(u) -> the order's entry `base + u` (u static, < `tile`), in a
  kernel: through one view of the tile's indices (`SMEM_VIEW`), each read the
  view's address plus a constant, not an add a row; else at its own offset."""
  if SMEM_VIEW:
    view = order_ref.at[pl.ds(base, tile)]
    return lambda u: view[u]
  return lambda u: order_ref[base + u]


def _gather(a: jax.Array, order: jax.Array, interpret: Any) -> jax.Array:
  """out[r] = a[order[r]] for a `movable` array."""
  batch = a.shape[0]
  group, tile, wide = _group_rows(batch), _tile(a.dtype), _wide(a.dtype)

  def kernel(order_ref, a_ref, out_ref, *scratch):
    # order_ref: SMEM int32 [G]; a_ref: VMEM [B, D] (whole); out_ref: VMEM [G, D]
    # scratch: (float32 [B, D]: a widened) for a 16-bit array, else ()
    src = a_ref
    if wide:
      (src,) = scratch

      @pl.when(pl.program_id(0) == 0)
      def _():
        _convert(a_ref, src, batch)

    def each(i, carry):
      base = pl.multiple_of(i * tile, tile)
      index = _tile_indices(order_ref, base, tile)
      rows = [src[pl.ds(index(u), 1), :] for u in range(tile)]
      out_ref[pl.ds(base, tile), :] = jnp.concatenate(rows, axis=0).astype(out_ref.dtype)
      return carry

    lax.fori_loop(0, group // tile, each, 0, unroll=GATHER_ROWS_A_TRIP // tile)

  return _launch(kernel, a, order, interpret, gather=True, name="pallas_loop_rows_gather")


def _scatter(a: jax.Array, order: jax.Array, interpret: Any) -> jax.Array:
  """out[order[r]] = a[r] for a `movable` array (`order` a permutation)."""
  batch = a.shape[0]
  group, tile, wide = _group_rows(batch), _tile(a.dtype), _wide(a.dtype)

  def kernel(order_ref, a_ref, out_ref, *scratch):
    # order_ref: SMEM int32 [G]; a_ref: VMEM [G, D]; out_ref: VMEM [B, D] (whole,
    # written back once, after the last program)
    # scratch: (float32 [B, D]: the output widened) for a 16-bit array, else ()
    dst = scratch[0] if wide else out_ref

    def each(i, carry):
      base = pl.multiple_of(i * tile, tile)
      rows = a_ref[pl.ds(base, tile), :].astype(dst.dtype)
      index = _tile_indices(order_ref, base, tile)
      for u in range(tile):
        dst[pl.ds(index(u), 1), :] = rows[u:u + 1]
      return carry

    lax.fori_loop(0, group // tile, each, 0, unroll=SCATTER_ROWS_A_TRIP // tile)
    if wide:
      @pl.when(pl.program_id(0) == pl.num_programs(0) - 1)
      def _():
        _convert(dst, out_ref, batch)

  return _launch(kernel, a, order, interpret, gather=False, name="pallas_loop_rows_scatter")
