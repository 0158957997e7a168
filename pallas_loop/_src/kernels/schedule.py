"""Which program runs which tile, and kernels that read their rows by index.

Two schedules of the tiles (rows ordered by descending count, `tiling.py`):

  * "grid": one program per tile, today's launch. On a GPU the hardware
    starts programs in index order, so tiles 0, 1, ... (the longest first)
    run at once, several per SM where they fit: at B=4096 with 16-row tiles,
    256 programs share the H200's 132 SMs, and the longest tile shares its SM
    with the second longest.
  * "persistent": P programs, program p taking tiles p, p + P, p + 2P, ...
    (`tiles_of_program`), longest first: the P longest tiles run at once,
    each on its own program, and a program that finishes a short tile takes
    the next. P is the backend's rule (`Backend.persistent_programs`); on a
    GPU (`programs`) the device's SM count times the programs that fit an SM
    by registers, counted at the worst case of 255 registers a thread
    (65,536 registers an SM): 1 with 8 warps, 2 with 4; at most the tiles.

The default (`resolve`, schedule=None) is "grid" on every backend. On the GPU
no run has measured either yet: the compiled loop is the same in both (the
persistent one wraps it in a loop over the program's tiles), so the code
gives no reason to change the launch before `benchmarks/gpu_check.py` times
both on the first GPU; that run decides. A backend without a persistent rule
(the TPU's: its grid is a sequential loop on one TensorCore, whose tiles
already run one after another, longest first, as a persistent program's
would) runs the grid whatever is asked.

Indexed rows (`Backend.indexed_rows`: a GPU's, and interpret mode's): the
kernel's per-row refs are the whole arrays in the caller's row order, and a
program reads its tile's rows by index (a gather load of rows
`order[t*TB:(t+1)*TB]`) and writes its results back to the same places (a
scatter store): no gathers before the kernel and no inverse-permutation
scatter after it. The other backends keep their blocks (gathered before,
scattered after: `tiling.in_tiles`).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from jax import lax
from jax.experimental import pallas as pl

SCHEDULES = ("grid", "persistent")

# One SM's register file (sm_80 .. sm_100), and the most registers a thread
# may take: programs an SM holds at worst.
REGISTERS_PER_SM = 65536
MAX_REGISTERS_PER_THREAD = 255

def resolve(backend: Any, schedule: str | None) -> str:
  """The schedule a backend runs: "grid" or "persistent".

  Args:
    backend: the `Backend` (its `indexed_rows` and `persistent_programs`).
    schedule: the caller's choice; None: the default ("grid").

  Returns:
    "persistent" where asked for and the backend runs programs side by side
    (its kernels read rows by index and it has a `persistent_programs`
    rule); else "grid" (e.g. a TPU's sequential grid already runs its tiles
    in order).

  Example:
    >>> import dataclasses
    >>> from pallas_loop._src.kernels import backend
    >>> side_by_side = dataclasses.replace(backend.INTERPRET, indexed_rows=True,
    ...                                    persistent_programs=lambda config, tiles: 2)
    >>> resolve(side_by_side, None), resolve(side_by_side, "persistent")
    ('grid', 'persistent')
    >>> resolve(backend.INTERPRET, "persistent")
    'grid'
  """
  if schedule is None or not backend.indexed_rows or backend.persistent_programs is None:
    return "grid"
  return schedule


def programs_per_sm(num_warps: int) -> int:
  """Programs one SM holds at worst by registers (255 a thread).

  Example:
    >>> programs_per_sm(8), programs_per_sm(4)
    (1, 2)
  """
  return max(1, REGISTERS_PER_SM // (num_warps * 32 * MAX_REGISTERS_PER_THREAD))


def programs(sms: int, num_warps: int, tiles: int) -> int:
  """P, the persistent grid: SMs x `programs_per_sm`, at most `tiles`.

  Example:
    >>> programs(132, 8, 256), programs(132, 4, 256), programs(132, 8, 40)
    (132, 256, 40)
  """
  return max(1, min(tiles, sms * programs_per_sm(num_warps)))


def tiles_of_program(program: int, n_programs: int, tiles: int) -> list[int]:
  """The tiles program `program` of `n_programs` runs, in order: p, p+P, ...

  Tile 0 holds the longest rows, so program p's first tile is the p-th
  longest: the P longest tiles start together, one per program.

  Example:
    >>> tiles_of_program(1, 3, 8)
    [1, 4, 7]
  """
  return list(range(program, tiles, n_programs))


def trips(program: Any, n_programs: int, tiles: int) -> Any:
  """How many tiles program `program` runs (`len(tiles_of_program(...))`);
  `program` may be traced.

  Example:
    >>> [int(trips(p, 3, 8)) for p in range(3)]
    [3, 3, 2]
  """
  return (tiles - program + n_programs - 1) // n_programs


class RowView:
  """A ref seen as one tile's rows: `view[key]` reads `ref` with the row
  axis indexed by `rows` (a `pl.ds` of consecutive rows, or an int32 vector
  of row indices: a gather load, and a scatter store on assignment).

  The kernel bodies index their row refs with `...`, slot numbers and full
  slices only; the row axis of `key` must be a full slice.

  Attributes:
    ref: the whole array's ref.
    rows: the row indexer.
    size: rows in the view.
    axis: the row axis.
  """

  def __init__(self, ref, rows, size: int, axis: int = 0):
    self.ref, self.rows, self.axis = ref, rows, axis
    shape = list(ref.shape)
    shape[axis] = size
    self.shape, self.dtype = tuple(shape), ref.dtype

  def _key(self, key) -> tuple:
    key = key if isinstance(key, tuple) else (key,)
    n = len(self.shape)
    if any(k is Ellipsis for k in key):
      i = next(i for i, k in enumerate(key) if k is Ellipsis)
      key = key[:i] + (slice(None),) * (n - len(key) + 1) + key[i + 1:]
    key = key + (slice(None),) * (n - len(key))
    at = key[self.axis]
    if not (isinstance(at, slice) and at == slice(None)):
      raise NotImplementedError(f"a RowView indexes its row axis whole, got {at}")
    return key[:self.axis] + (self.rows,) + key[self.axis + 1:]

  def __getitem__(self, key):
    return self.ref[self._key(key)]

  def __setitem__(self, key, value):
    self.ref[self._key(key)] = value


# How a kernel operand is seen by the per-tile body (`over_tiles`).
SHARED = "shared"      # whole, as it is
ROWS_IN = "rows_in"    # [B, ...]: the tile's rows, read at order[tile rows]
ROWS_OUT = "rows_out"  # [B, ...]: the tile's rows, written at order[tile rows]
ROWS_IN_SLOTS = "rows_in_slots"    # [S, B, ...]: rows on axis 1, read at order[...]
ROWS_OUT_SLOTS = "rows_out_slots"  # [S, B, ...]: rows on axis 1, written at order[...]
# [rows, ...] padded to whole tiles, read where the tile writes (the padding
# positions read their own rows: e.g. a window length of 0).
ROWS_PADDED_IN = "rows_padded_in"
TILE = "tile"          # [NT, ...]: the tile's one slot
SLOTS = "slots"        # [S, P, ...]: the tile's positions on axis 1 (scratch)
_BY_INDEX = (ROWS_IN, ROWS_OUT, ROWS_IN_SLOTS, ROWS_OUT_SLOTS, ROWS_PADDED_IN)


def over_tiles(body: Callable[..., None], kinds: Sequence[str], *, block_rows: int,
               tiles: int, n_programs: int) -> Callable[..., None]:
  """A kernel over whole-array refs that runs `body` on each of its tiles.

  The kernel's first two refs are the rows each sorted position reads and
  writes (int32 [tiles * block_rows], `tiling.slot_rows`); the others are
  seen by `body` as the tile's blocks (`RowView`), as `kinds` says. Program
  p runs tiles p, p + n_programs, ... (`tiles_of_program`) in a loop:
  n_programs == tiles is the grid schedule, fewer the persistent one.

  Args:
    body: the per-tile kernel body, called with a view per ref.
    kinds: per ref after the two index refs, one of the kinds above
      (SHARED, ROWS_IN, ...).
    block_rows: TB.
    tiles: NT.
    n_programs: the grid size P.

  Returns:
    kernel(load_ref, store_ref, *refs).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> def body(x, o):
    ...   o[...] = x[...] * 2
    >>> k = over_tiles(body, [ROWS_IN, ROWS_OUT], block_rows=2, tiles=3, n_programs=2)
    >>> order = jnp.array([5, 0, 3, 1, 2, 4], jnp.int32)
    >>> pl.pallas_call(k, grid=(2,), out_shape=jax.ShapeDtypeStruct((6, 1), jnp.float32),
    ...                interpret=True)(order, order, jnp.arange(6.0).reshape(6, 1))[:, 0]
    Array([ 0.,  2.,  4.,  6.,  8., 10.], dtype=float32)
  """
  tb = block_rows

  need_rows = any(kind in _BY_INDEX for kind in kinds)

  def kernel(load_ref, store_ref, *refs):
    program = pl.program_id(0)

    def one(k, carry):
      tile = program + k * n_programs
      start = pl.multiple_of(tile * tb, tb)
      positions = pl.ds(start, tb)
      load = load_ref[positions] if need_rows else None
      store = store_ref[positions] if need_rows else None
      views = []
      for ref, kind in zip(refs, kinds):
        if kind == SHARED:
          views.append(ref)
        elif kind == ROWS_IN:
          views.append(RowView(ref, load, tb))
        elif kind == ROWS_OUT:
          views.append(RowView(ref, store, tb))
        elif kind == ROWS_IN_SLOTS:
          views.append(RowView(ref, load, tb, axis=1))
        elif kind == ROWS_OUT_SLOTS:
          views.append(RowView(ref, store, tb, axis=1))
        elif kind == ROWS_PADDED_IN:
          views.append(RowView(ref, store, tb))
        elif kind == TILE:
          views.append(RowView(ref, pl.ds(tile, 1), 1))
        elif kind == SLOTS:
          views.append(RowView(ref, positions, tb, axis=1))
        else:
          raise ValueError(f"unknown operand kind {kind!r}")
      body(*views)
      return carry

    if n_programs == tiles:  # one tile per program: no loop
      one(0, 0)
    else:
      lax.fori_loop(0, trips(program, n_programs, tiles), one, 0)

  return kernel
