"""The TPU's forward kernel: a group of rows resident in VMEM, steps outermost.

Legend (shapes in comments):
  B: rows, sorted by descending count, padded to whole groups
  G: rows of a group (one grid program)   C: rows of a chunk (one evaluation of the step)
  T: max_iters                             ...: a leaf's trailing (per-row) dimensions

A TPU core runs a grid's programs one after another, and the step's work on
a tile is one chain of dependent matrix-unit, vector and transcendental work.
The tile kernel (`kernel_forward.py`) runs each tile to its slowest row and
tracks every row's count, steps and flags in [TB, 1] columns, which a TPU
lays out one row per sublane: each column operation costs as much as one on
a [TB, 128] array, and its loop body was about 3x the matrix unit's cycles
(`benchmarks/tpu_bundles.py`).

Here one program owns a group of G rows and keeps their state in VMEM for
the whole loop (the state lives in the output block). Rows are sorted by
descending count, so at step t the rows still running by count are a prefix
of the group, of `active[g, t]` rows (a table scalar-prefetched to SMEM):
the step is evaluated on the prefix's full chunks of C rows unmasked, on the
one partial chunk masked (at C, C/2 or C/4 rows, the least that holds its
running rows: the step is traced at those heights too), and not at all past
it. Without halting and
without a returned residual nothing per row is tracked in the loop (each
row's steps are its count). With them, the per-row columns (residual, steps,
halted: [G, 1]) live in output blocks, `loop.apply_update` (the rule every
implementation shares) applies each step, each step's prefix is cut after
the last row still running (its chunk run at the pieces' heights), a chunk
whose rows have all stopped is skipped (a flag per chunk in SMEM), and the
loop ends when no row of the group runs.

Pallas' pipeline double-buffers the group blocks: while group g runs, the
rows of group g + 1 stream in and those of group g - 1 out, so a batch that
does not fit VMEM streams through it.

What it does not take runs the tile kernel instead (`plan`): per-step
outputs (a slot per step of every row would not stay in VMEM) and unsorted
rows (`sort_rows=False`: the running rows are then no prefix).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
from jax import lax
from jax import tree_util
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp
import numpy as np

from pallas_loop._src.kernels import backend as backend_lib
from pallas_loop._src.kernels import backend_mosaic_tpu
from pallas_loop._src.step import footprint as footprint_lib
from pallas_loop._src.kernels import kernel_forward
from pallas_loop._src.kernels import kernel_toolkit as toolkit
from pallas_loop._src.kernels import kernel_tpu_rows
from pallas_loop._src import loop as loop_lib
from pallas_loop._src.kernels import schedule as schedule_lib
from pallas_loop._src.step import step_fn as step_fn_lib
from pallas_loop._src import tiling
from pallas_loop._src.operands import LoopOperands, LoopOutputs

KERNEL_NAME = "pallas_loop_iterate_fwd_groups"

# The chunk: rows one evaluation of the step sees. A chunk pays a fixed
# cost (the matrix unit's weights pushed, its pipeline filled and drained:
# about 120 ns on a v5e, fitted on the tanh RNN at D=128) besides its rows'
# work, so chunks are as tall as the batch allows, up to 2048 rows (0.30 ns
# a row-step there, against 0.36 at 1024 and 0.69 at 256; RESULTS.md, "The
# loop designs (run A)"), even though the one masked chunk a step then
# computes more rows that do not run.
LARGEST_CHUNK = 2048
SMALLEST_CHUNK = 128
# Groups a batch is split into when VMEM would hold it whole: the pipeline
# overlaps group g + 1's load with group g's loop, so only the first group's
# load and the last one's store are exposed.
GROUPS = 4
# Chunks a group holds at least (a group's fixed cost a step is spread over them).
CHUNKS_PER_GROUP = 4
# The one partial chunk of a step (where the running prefix ends) runs at the
# fewest of C, C/2 or C/4 rows that hold its running rows: with the chunk's
# fixed cost of ~120 ns and 0.236 ns a row, 512 rows cost 241 ns against 603
# for 2048. A piece under this many rows saves too little (~60 ns at 256 rows
# against 512) to be worth the step compiled at one more shape.
SMALLEST_PIECE = 256
# A loop that tracks its rows (halting, a returned residual) cuts each step's
# prefix after the last row still running (`_kernel`'s `tracked_step`); False
# runs every chunk that holds a running row whole, as before (what
# `benchmarks.deq_split` times it against). On a TPU v5e, B=4096, the DEQ's
# `Implicit` gradient took 0.728 ms against 0.801 with its rows in order,
# 0.835 against 0.883 shuffled (RESULTS.md, "Each step's prefix cut after the
# last running row").
WINDOW = True
# The active-rows table (`active_rows`) compares every count with every step
# up to this many comparisons (B=32768 at T=512), else searches.
COMPARE_ALL_LIMIT = 1 << 24
# XLA runs the row permutation around the kernel (the sort, and XLA's
# gathers where the row kernels, `kernel_tpu_rows`, do not move a leaf) and
# keeps its operands in VMEM while they fit: compiled for a v5e, the tanh RNN's forward at B=32768, D=128 (the
# state in and out and the hoisted float32 `x U`: 1 KiB a row, 32 MiB) holds
# every one of them in VMEM, at B=262144 none, and its gathers then go
# through HBM (0.952 ns a useful row-step against 0.456 at B=32768 on the
# chip; RESULTS.md, run Q). A batch whose permuted rows take more than
# `SLABS_FROM_BYTES` runs in slabs of about `SLAB_BYTES`, one after another,
# each sorted, run and put back on its own (`slab_rows`): at B=262144, 0.535
# ns (RESULTS.md, runs R and S). Below it a batch runs whole, as the chip
# measured it: the GRU at B=32768 (64 MiB; its gathers' sources still in
# VMEM, compiled deviceless) would only add the slabs' copies
# (`python -m benchmarks.tpu_hlo --block gru`).
SLAB_BYTES = 32 * 2**20
SLABS_FROM_BYTES = 64 * 2**20


def piece_rows(chunk: int) -> tuple[int, ...]:
  """The heights under C a step's partial chunk may run at: C/2 and C/4,
  those of at least `SMALLEST_PIECE` rows.

  Example:
    >>> piece_rows(2048), piece_rows(512), piece_rows(256)
    ((1024, 512), (256,), ())
  """
  return tuple(r for r in (chunk // 2, chunk // 4) if r >= SMALLEST_PIECE)


def trace_pieces(step_fn: step_fn_lib.StepFn, params, consts, h, x, chunk: int,
                 traced: step_fn_lib.SpecializedStep) -> tuple[tuple[int, Any], ...]:
  """(rows, the step traced at them) for each of `piece_rows(chunk)`
  (descending), or () where a piece's trace has constants other than the
  chunk's (the kernel passes the chunk's to every evaluation)."""
  pieces = []
  for rows in piece_rows(chunk):
    piece = step_fn.specialize(params, consts, step_fn_lib.avals(h, rows),
                               step_fn_lib.avals(x, rows))
    if not _same_constants(piece, traced):
      return ()
    pieces.append((rows, piece))
  return tuple(pieces)


def _same_constants(a: step_fn_lib.SpecializedStep, b: step_fn_lib.SpecializedStep) -> bool:
  if a.sources != b.sources or len(a.const_values) != len(b.const_values):
    return False
  for u, v in zip(a.const_values, b.const_values):
    if u is v:
      continue
    if isinstance(u, jax.core.Tracer) or isinstance(v, jax.core.Tracer):
      return False
    if np.shape(u) != np.shape(v) or not np.array_equal(np.asarray(u), np.asarray(v)):
      return False
  return True


class GroupLayout:
  """What a group kernel's plan derives from its `chunk_rows`, `group_rows`,
  `rows` and `slab_rows` (the forward's `GroupPlan`, the backward's
  `GroupWindowPlan`)."""

  chunk_rows: int
  group_rows: int
  rows: int
  slab_rows: int
  traced: step_fn_lib.SpecializedStep
  pieces: tuple

  @property
  def block_rows(self) -> int:
    """Rows one evaluation of the step sees (`Options.block_rows`)."""
    return self.chunk_rows

  def chunks(self) -> "Chunks":
    """A group's chunks, as the kernel slices them (with the pieces)."""
    return Chunks(self.chunk_rows, one=self.group_rows == self.chunk_rows,
                  pieces=tuple(rows for rows, _ in self.pieces))

  def traced_at(self) -> dict:
    """Rows -> the step traced at them: the chunk's, and each piece's."""
    return {self.chunk_rows: self.traced, **dict(self.pieces)}

  @property
  def groups(self) -> int:
    return self.rows // self.group_rows

  @property
  def slabs(self) -> int:
    """Slabs the rows run in when they are sorted (1: the batch is one)."""
    return self.rows // self.slab_rows if self.slab_rows else 1


@dataclasses.dataclass(frozen=True)
class GroupPlan(GroupLayout):
  """How the group kernel will run, or why it cannot.

  Attributes:
    backend: the backend it was planned for (Mosaic TPU, or its interpret mode).
    chunk_rows: C.
    group_rows: G (a multiple of C).
    rows: B padded to whole groups.
    traced: the step traced at the chunk's shapes.
    param_shapes/const_shapes: true shapes of the shared operands.
    config: the kernel's configuration (None when none fits).
    footprint: what one program holds in VMEM.
    problems: violated rules; empty when the kernel can run.
    sliced: shared operands read one leading slice at a time (`params[index]`).
    uses_rows: the step reads its rows' indices (keys): the kernel then
      reads a [G, 1] column of them.
    max_iters: T, the counts' bound (the active table's columns).
    pieces: (rows, the step traced at them) for a step's partial chunk
      (`trace_pieces`).
    slab_rows: the rows of one slab (a multiple of G dividing `rows`): rows
      out of count order are sorted and run a slab at a time
      (`SLAB_BYTES`, `SLABS_FROM_BYTES`); `rows` when the batch is one slab.
  """

  backend: backend_lib.Backend
  chunk_rows: int
  group_rows: int
  rows: int
  traced: step_fn_lib.SpecializedStep
  param_shapes: tuple
  const_shapes: tuple
  config: backend_lib.KernelConfig | None
  footprint: footprint_lib.Footprint | None
  problems: tuple[str, ...]
  sliced: frozenset[int] = frozenset()
  uses_rows: bool = False
  max_iters: int = 0
  pieces: tuple = ()
  slab_rows: int = 0

  def run(self, ops: LoopOperands, *, sort_rows: bool, in_order: bool = False,
          residual: bool = True, schedule: str | None = None) -> LoopOutputs:
    del schedule  # a TPU core runs its groups in order: one schedule
    assert sort_rows, "the group kernel needs rows sorted by count (`plan`)"
    return run(self, ops, residual=residual, in_order=in_order)


def default_chunk_rows(batch: int) -> int:
  """C for a batch: `LARGEST_CHUNK` rows, fewer for a batch of under 2
  chunks of it (at least `SMALLEST_CHUNK`), and never more than the batch
  rounded up to 16 rows (a bfloat16 tile)."""
  rows = backend_lib.rows_for_tiles(batch, 2, smallest=SMALLEST_CHUNK, largest=LARGEST_CHUNK)
  return min(rows, max(16, -(-batch // 16) * 16))


def plan(backend: backend_lib.Backend, step_fn: step_fn_lib.StepFn, params, consts, h0, x,
         block_rows: int | None = None, outputs: Any = None, *,
         sort_rows: bool = True, max_iters: int, halving: bool = False,
         approx_tanh: bool | None = None) -> Any:
  """The group kernel's plan, or the tile kernel's where this one does not
  apply (per-step outputs, unsorted rows).

  Args:
    backend: Mosaic TPU or its interpret mode.
    step_fn, params, consts, h0, x: as `kernel_forward.plan`.
    block_rows: C, the chunk's rows (None: `default_chunk_rows`).
    outputs: the per-step outputs' avals, or None.
    sort_rows: the caller's `sort_rows`.
    max_iters: T, the counts' static bound.
    halving: `block_rows` is a default chunk halved because the one twice
      as tall did not fit (it may be halved again).
    approx_tanh: `Options.approx_tanh` (the configuration's evaluation
      rules take it: `backend_lib.for_call`).

  Returns:
    A `GroupPlan`, or a `kernel_forward.TilePlan`.
  """
  if outputs is not None or not sort_rows:
    return kernel_forward.plan(backend, step_fn, params, consts, h0, x, block_rows,
                               outputs=outputs, approx_tanh=approx_tanh)
  batch = tree_util.tree_leaves(h0)[0].shape[0]
  chunk = block_rows or default_chunk_rows(batch)
  traced = step_fn.specialize(params, consts, step_fn_lib.avals(h0, chunk),
                              step_fn_lib.avals(x, chunk))
  n_params = len(tree_util.tree_leaves(params))
  problems = []
  typed = backend_lib.extended_dtype_problems(toolkit.named_operands(params, traced, h0, x))
  if typed:
    return GroupPlan(backend=backend, chunk_rows=chunk, group_rows=chunk, rows=chunk,
                     traced=traced, param_shapes=(), const_shapes=(), config=None,
                     footprint=None, problems=tuple(typed))
  blocks, chunk_problems = chunk_blocks(backend, batch, chunk, (("h0", h0), ("x", x)))
  problems += chunk_problems
  sliced, slice_eqns = backend_lib.leading_slices(
      traced.jaxpr, traced.jaxpr.invars[:n_params] + traced.jaxpr.constvars)
  blocks += [backend_lib.Block(f"params{tree_util.keystr(path)}", toolkit.shared_2d(a),
                               toolkit.shared_2d(a), row_axis=None)
             for path, a in tree_util.tree_flatten_with_path(params)[0]]
  blocks += [backend_lib.Block(f"an array step closes over (#{i})", toolkit.shared_2d(c),
                               toolkit.shared_2d(c), row_axis=None)
             for i, c in enumerate(traced.const_values)]
  problems += (backend.block_problems(blocks)
               + backend_lib.step_problems(backend, traced.jaxpr, slice_eqns))
  uses_rows = reads_input(traced.jaxpr, len(tree_util.tree_leaves((params, h0, x))) + 1)
  shared = list(tree_util.tree_leaves(params)) + list(traced.const_values)
  shared_avals = [jax.ShapeDtypeStruct(toolkit.shared_2d(a), jnp.result_type(a))
                  for a in shared]
  fp = footprint_lib.measure(
      [(traced.jaxpr, n_params)], batch=batch, block_rows=chunk, shared_avals=shared_avals,
      row_block_avals=_row_blocks(h0, x, chunk, columns=4))
  # The state in and out and the inputs travel through the permutation.
  slab = slab_rows(batch, chunk, 2 * tree_util.tree_leaves(h0) + tree_util.tree_leaves(x))
  config, group, config_problems = _configure(backend, fp, slab, chunk, h0, x, shared_avals)
  config = backend_lib.for_call(config, h0, approx_tanh)
  if (config is None and (block_rows is None or halving) and not problems
      and chunk // 2 >= backend_mosaic_tpu.SMALLEST_TILE):
    # The default chunk's values do not fit (multi-head attention keeps
    # [C, H, L, L] probabilities and [C, L, H, K] heads alive, padded to
    # VMEM's tiles): halve it, as `kernel_toolkit.configured` halves a tile.
    return plan(backend, step_fn, params, consts, h0, x, chunk // 2, outputs,
                sort_rows=sort_rows, max_iters=max_iters, halving=True,
                approx_tanh=approx_tanh)
  padded, slab = slab_layout(batch, chunk, group, slab)
  return GroupPlan(
      backend=backend, chunk_rows=chunk, group_rows=group, rows=padded, slab_rows=slab,
      traced=traced,
      param_shapes=tuple(np.shape(a) for a in tree_util.tree_leaves(params)),
      const_shapes=tuple(np.shape(c) for c in traced.const_values),
      config=config, footprint=fp, problems=tuple(problems + config_problems),
      sliced=frozenset(sliced), uses_rows=uses_rows, max_iters=max_iters,
      pieces=() if problems or config_problems else trace_pieces(step_fn, params, consts, h0, x,
                                                                 chunk, traced))


def slab_rows(batch: int, chunk: int, per_row: list) -> int:
  """The rows of a slab: the batch where the rows' permuted arrays
  (`per_row`: avals with a leading row axis) take at most
  `SLABS_FROM_BYTES`, else whole chunks (and whole 128-row tiles, which
  the row kernels move, where a slab holds one), at most those that take
  `SLAB_BYTES` (but at least `CHUNKS_PER_GROUP` chunks, one group's), in
  as many slabs as pad the batch least (of the counts up to twice the
  fewest whose slabs keep that least; fewer slabs on a tie).

  The slabs are laid out from these rows (`slab_layout`), and the group is
  sized for them: a batch padded to whole slabs is copied whole, every row
  of it (`tiling.pad_rows`), and its padding is moved and run through.
  Sized for the largest slab instead, an LSTM at B=32768 (a slab of at most
  10240 rows) ran in 4 slabs of 12288 rows, 49152 in all (compiled for a
  v5e); now 4 of 8192, no padding.

  Example:
    >>> h = jax.ShapeDtypeStruct((262144, 128), jnp.bfloat16)
    >>> x = jax.ShapeDtypeStruct((262144, 128), jnp.float32)
    >>> slab_rows(262144, 2048, [h, h, x]), slab_rows(32768, 2048, [h, h, x])
    (32768, 32768)
    >>> six = [a.update(shape=(32768, 128)) for a in [h, h, h, x, x, x]]  # 2304 B a row
    >>> slab_rows(32768, 2048, six)  # at most 14336 rows: 4 slabs of 8192, not 3 of 12288
    8192
  """
  size = sum(math.prod(a.shape[1:]) * jnp.dtype(a.dtype).itemsize for a in per_row)
  if batch * size <= SLABS_FROM_BYTES:
    return batch
  least = CHUNKS_PER_GROUP * chunk
  most = max(least, SLAB_BYTES // max(size, 1) // chunk * chunk)
  fewest = -(-batch // most)
  # Whole 128-row tiles too where a slab holds one: the row kernels move only
  # such rows (`kernel_tpu_rows.movable`; a default chunk is 2048 rows).
  tile = math.lcm(chunk, 128)
  unit = tile if most >= tile else chunk
  rows_of = lambda slabs: tiling.padded_rows(-(-batch // slabs), unit)
  counts = [n for n in range(fewest, 2 * fewest + 1) if n == fewest or rows_of(n) >= least]
  return rows_of(min(counts, key=lambda n: (n * rows_of(n), n)))


def slab_layout(batch: int, chunk: int, group: int, slab: int) -> tuple[int, int]:
  """(rows, slab_rows) of a group kernel's plan: the batch in as few slabs of
  at most about `slab` rows (`slab_rows`) as it takes, each as even as whole
  groups of G = `group` rows allow, and padded to them.

  Example:
    >>> slab_layout(262144, 2048, 8192, 32768), slab_layout(100, 16, 64, 100)
    ((262144, 32768), (128, 128))
  """
  slabs = max(1, -(-batch // max(slab, 1)))  # an empty batch: one slab of one chunk
  rows = tiling.padded_rows(tiling.padded_rows(-(-batch // slabs), chunk), group)
  return slabs * rows, rows


def chunk_blocks(backend: backend_lib.Backend, batch: int, chunk: int,
                 named: tuple[tuple[str, Any], ...]) -> tuple[list, list[str]]:
  """(the blocks a chunk of each named tree's rows makes, the problems of
  16-bit leaves in chunks Mosaic cannot slice), for a group kernel.

  A chunk is a dynamic slice of the group's rows in VMEM: Mosaic's block
  rule applies to it as to a block (a 1-D leaf's rows are the lane axis: a
  multiple of 128 rows), and a 16-bit leaf's rows pack two to a sublane: a
  multiple of 16.
  """
  blocks, problems = [], []
  for name, tree in named:
    for path, a in tree_util.tree_flatten_with_path(tree)[0]:
      blocks.append(backend_lib.Block(f"{name}{tree_util.keystr(path)} (a chunk of its rows)",
                                      (chunk,) + a.shape[1:],
                                      (tiling.padded_rows(batch, chunk),) + a.shape[1:]))
      if (backend.platforms and len(a.shape) == 2 and jnp.dtype(a.dtype).itemsize == 2
          and chunk % 16):
        problems.append(f"{name}{tree_util.keystr(path)} is 16-bit, two rows to a sublane: "
                        f"choose block_rows a multiple of 16, not {chunk}")
  return blocks, problems


def reads_input(jaxpr, position: int) -> bool:
  """Whether `jaxpr` reads its input at `position`."""
  var = jaxpr.invars[position]
  return any(var in eqn.invars for eqn in backend_lib.iter_eqns(jaxpr)) or var in jaxpr.outvars


def _row_blocks(h0, x, rows: int, columns: int) -> list:
  """The avals of a program's row blocks at `rows` rows: the state in and
  out, the inputs, and `columns` [rows, 1] int32/float32 columns."""
  return (2 * tree_util.tree_leaves(step_fn_lib.avals(h0, rows))
          + tree_util.tree_leaves(step_fn_lib.avals(x, rows))
          + [jax.ShapeDtypeStruct((rows, 1), np.int32)] * columns)


def _configure(backend, fp, batch, chunk, h0, x, shared_avals):
  """(config, G, problems): the group's rows and the VMEM the kernel asks
  for.

  VMEM holds, double-buffered, the group's row blocks (the state in and out,
  the inputs, up to four [G, 1] columns, each padded to Mosaic's (8, 128)
  tiles) and the shared operands, plus the chunk's temporaries (the tile
  kernel's allowance at C rows: `backend_mosaic_tpu.vmem_estimate`). G is the
  most rows (a multiple of C) that fits 7/8 of the physical VMEM, at most a
  `GROUPS`-th of the batch but at least `CHUNKS_PER_GROUP` chunks.
  """
  per_row = sum(backend_mosaic_tpu.padded_bytes(a.shape, a.dtype)
                for a in _row_blocks(h0, x, chunk, columns=4)) / chunk
  fixed = (2 * sum(backend_mosaic_tpu.padded_bytes(a.shape, a.dtype) for a in shared_avals)
           + backend_mosaic_tpu.FIXED_SCRATCH
           # The step's values with the margin libtpu took over their estimate.
           + int(backend_mosaic_tpu.MARGIN * backend_mosaic_tpu.step_values_bytes(fp)))
  config, group, cap = group_config(backend, batch, chunk, per_row=2 * per_row, fixed=fixed)
  if config is None:
    return None, chunk, [
        f"no group of {chunk}-row chunks fits the TPU's VMEM ({cap:,} B a kernel may ask for; "
        f"{per_row:.0f} B a row, double-buffered, and {fixed:,} B of shared operands and "
        "temporaries); a smaller block_rows may fit, else the XLA implementation runs it"]
  return config, group, []


def group_config(backend, batch: int, chunk: int, *, per_row: float, fixed: int
                 ) -> tuple[backend_lib.KernelConfig | None, int, int]:
  """(config or None, G, the VMEM a kernel may ask for) of a group kernel
  (forward or backward) whose program holds `per_row` bytes of VMEM a row of
  its group and `fixed` bytes besides; None where not one chunk fits.

  G is the most rows (a multiple of C) that fits 7/8 of the physical VMEM,
  at most a `GROUPS`-th of the batch but at least `CHUNKS_PER_GROUP` chunks
  (`_group_rows`). Interpret mode has no VMEM to fit.
  """
  if not backend.platforms:
    group = _group_rows(batch, chunk, limit=None)
    return (backend_lib.KernelConfig(block_rows=chunk, eval_rules=backend_mosaic_tpu.EVAL_RULES),
            group, 0)
  default, physical = backend_mosaic_tpu.vmem(backend_lib.device_kind("tpu"))
  cap = physical * 7 // 8 if physical > default else default
  fits = int((cap - fixed) // per_row) // chunk * chunk
  if fits < chunk:
    return None, chunk, cap
  group = _group_rows(batch, chunk, limit=fits)
  need = int(fixed + per_row * group)
  # Headroom over the estimate for Mosaic's own scratch (the row blocks are
  # exactly what the pipeline allocates; the temporaries are an allowance).
  limit = min(cap, -(-(need + need // 4) // backend_mosaic_tpu.MIB) * backend_mosaic_tpu.MIB)
  # The default scoped limit is kept where it is enough (as the tile kernel
  # does): no limit is asked for then.
  params = pltpu.CompilerParams(dimension_semantics=("parallel",),
                                vmem_limit_bytes=None if limit <= default else limit)
  return backend_lib.KernelConfig(
      block_rows=chunk, compiler_params=params, eval_rules=backend_mosaic_tpu.EVAL_RULES,
      estimate={"vmem_bytes": need, "vmem_limit_bytes": max(limit, default),
                "group_rows": group}), group, cap


def _group_rows(batch: int, chunk: int, limit: int | None) -> int:
  """G: about a `GROUPS`-th of the batch, at least `CHUNKS_PER_GROUP`
  chunks, at most `limit` rows (and never past the batch), a multiple of C."""
  rows = tiling.padded_rows(batch, chunk)
  want = max(CHUNKS_PER_GROUP * chunk, tiling.padded_rows(-(-rows // GROUPS), chunk))
  group = min(want, rows)
  if limit is not None:
    group = min(group, limit)
  groups = -(-rows // group)
  return tiling.padded_rows(-(-rows // groups), chunk)  # as even as whole chunks allow


def active_rows(counts: jax.Array, groups: int, max_iters: int) -> jax.Array:
  """int32 [groups, T]: rows of each group still running by count at step t
  (counts sorted descending within each group: a prefix of the group).

  Up to `COMPARE_ALL_LIMIT` comparisons, every count is compared with every
  step and the comparisons summed: one fused reduction. Above it a binary
  search (`jnp.searchsorted`), which XLA runs as a while loop of about log2(B)
  trips of four or five small ops each. On a TPU v5e the comparison took the
  sort and the table from 0.0167 to 0.0089 ms at B=4096 and the recurrent-depth
  forward from 0.618 to 0.557 ms at B=32768 (RESULTS.md, "The active-rows
  table and the sortedness branch").

  Example:
    >>> counts = jnp.array([5, 3, 3, 0, 4, 4, 1, 0])  # two groups, each descending
    >>> active_rows(counts, 2, 6).tolist()
    [[3, 3, 3, 1, 1, 0], [3, 2, 2, 2, 0, 0]]
  """
  grouped = counts.reshape(groups, -1)
  steps = jnp.arange(max_iters, dtype=counts.dtype)
  if counts.size * max_iters <= COMPARE_ALL_LIMIT:
    # [groups, T, rows]: the rows on lanes, as the counts lie, the steps on
    # sublanes. Compiled for a v5e (libtpu 0.0.42.1) the fusion's estimate is
    # 42,208 cycles at B=32768, T=128 against 72,796 with the rows moved to
    # sublanes ([groups, rows, T]), 6,496 against 12,540 at B=4096, the same
    # at T=64 (XLA lays both out alike there); not timed.
    return jnp.sum((grouped[:, None, :] > steps[None, :, None]).astype(jnp.int32), axis=2)
  # Descending counts: the rows with count > t are those before the first
  # row with count <= t.
  return jax.vmap(lambda c: jnp.searchsorted(-c, -steps, side="left"))(grouped).astype(
      jnp.int32)


class Chunks(NamedTuple):
  """A group's chunks of C rows, as the group kernels slice them."""

  rows: int  # C
  one: bool  # the group is one chunk
  pieces: tuple[int, ...] = ()  # heights under C for the partial chunk, descending

  def at(self, start, height: int | None = None):
    """The `height` rows (default C) from row `start` (a multiple of C).

    With one chunk a group the start is always 0 and is written so: a chunk
    under 128 rows (a small batch) is no multiple of a 1-D leaf's 128-lane
    tile, and Mosaic cannot prove a traced start aligned (E2003 on the DEQ
    solvers' per-row scalars, libtpu 0.0.42.1)."""
    height = height or self.rows
    if self.one:
      return pl.ds(0, height)
    return pl.ds(pl.multiple_of(start, self.rows), height)

  def below(self, limit, height: int | None = None):
    """bool [height, 1] (default C): the rows before `limit`."""
    return lax.broadcasted_iota(jnp.int32, (height or self.rows, 1), 0) < limit

  def over_prefix(self, n, body) -> None:
    """body(rows, mask) on the chunks of the group's first `n` rows (sorted
    rows: those still running): the full ones with mask None, the one
    partial chunk with its [height, 1] mask, at the least of C and `pieces`
    that holds its running rows, none past it."""
    full = n // self.rows

    def each(c, carry):
      body(self.at(c * self.rows), None)
      return carry

    lax.fori_loop(0, full, each, 0)
    rest = n - full * self.rows
    heights = (self.rows,) + self.pieces
    for k, height in enumerate(heights):
      lower = heights[k + 1] if k + 1 < len(heights) else 0

      @pl.when((rest > lower) & (rest <= height))
      def _(height=height):
        body(self.at(full * self.rows, height), self.below(rest, height))


class _Ins(NamedTuple):
  """The kernel's input groups (refs in the body; after the two tables)."""

  params: Any   # full blocks, in params' structure (0-d leaves travel as [1, 1])
  consts: Any   # list of full blocks: the step's constants
  halting: Any  # Halting of [1, 1]: tol (float32, if given), min_iters (int32); or None
  h: Any        # [G, ...], in h0's structure: initial state
  x: Any        # [G, ...], in x's structure: inputs
  rows: Any     # int32 [G, 1]: rows' indices in the caller's batch (`uses_rows`), or None


class _Outs(NamedTuple):
  """The kernel's output groups (residual, steps, halted: None unless `track`)."""

  h: Any         # [G, ...], in h0's structure: the state, updated in place, then final
  residual: Any  # f32 [G, 1]
  steps: Any     # i32 [G, 1]
  halted: Any    # i32 [G, 1]


class _Scratch(NamedTuple):
  """The kernel's scratch (None unless `track`)."""

  alive: Any     # SMEM int32 [G / C]: 1 while a chunk has a running row
  window: Any    # SMEM int32 [1]: 1 + the group's last row still running (0: none)


# How each group is blocked (`launch`).
_IN_KINDS = _Ins(params=schedule_lib.SHARED, consts=schedule_lib.SHARED,
                 halting=schedule_lib.SHARED, h=schedule_lib.ROWS_IN, x=schedule_lib.ROWS_IN,
                 rows=schedule_lib.ROWS_IN)
_OUT_KINDS = _Outs(h=schedule_lib.ROWS_OUT, residual=schedule_lib.ROWS_OUT,
                   steps=schedule_lib.ROWS_OUT, halted=schedule_lib.ROWS_OUT)


def _kernel(active_ref, trips_ref, ins: _Ins, outs: _Outs, scratch: _Scratch, *,
            plan: GroupPlan, elems_per_row, track: bool, residual: bool):
  """The kernel body of group g:

  active_ref: SMEM int32 [groups, T]   rows of each group running by count at step t
  trips_ref: SMEM int32 [groups]       each group's largest count
  ins, outs, scratch: the named groups (`_Ins`, `_Outs`, `_Scratch`)
  """
  halting = tree_util.tree_map(lambda r: r[...], ins.halting)
  if track:
    residual_ref, steps_ref, halted_ref = outs.residual, outs.steps, outs.halted
    alive_ref, window_ref = scratch.alive, scratch.window

  g = pl.program_id(0)
  chunk = plan.chunk_rows
  params, consts = toolkit.shared_loader(ins.params, ins.consts,
                                         plan.param_shapes + plan.const_shapes,
                                         on_chip=True, sliced=plan.sliced)
  assert plan.config is not None, plan.problems
  rules = plan.config.eval_rules
  for src, dst in zip(tree_util.tree_leaves(ins.h), tree_util.tree_leaves(outs.h)):
    dst[...] = src[...]
  if track:
    residual_ref[...] = jnp.zeros(residual_ref.shape, residual_ref.dtype)
    steps_ref[...] = jnp.zeros(steps_ref.shape, steps_ref.dtype)
    halted_ref[...] = jnp.zeros(halted_ref.shape, halted_ref.dtype)
    for c in range(plan.group_rows // chunk):
      alive_ref[c] = 1
    window_ref[0] = plan.group_rows

  chunks, traced_at = plan.chunks(), plan.traced_at()

  def evaluate(t, rows):
    height = rows.size
    h = tree_util.tree_map(lambda ref: ref[rows], outs.h)
    x = tree_util.tree_map(lambda ref: ref[rows], ins.x)
    ids = ins.rows[rows] if ins.rows is not None else jnp.zeros((height, 1), jnp.int32)
    h_new, _, flag = traced_at[height].apply(consts, params, h, x,
                                             jnp.full((height, 1), t, jnp.int32), ids, t,
                                             rules=rules)
    return h, h_new, flag

  def store(rows, h):
    for ref, leaf in zip(tree_util.tree_leaves(outs.h), tree_util.tree_leaves(h)):
      ref[rows] = leaf

  def untracked_step(t):
    # Rows are a prefix: full chunks unmasked, the partial one masked.
    def body(rows, mask):
      h, h_new, _ = evaluate(t, rows)
      store(rows, h_new if mask is None else loop_lib.select_rows(mask, h_new, h))

    chunks.over_prefix(active_ref[g, t], body)

  def tracked_step(t):
    # The chunks of the prefix that may hold a running row: the rows running
    # by count (`active`), cut after the last row no criterion had stopped at
    # the step before (`window_ref`). Each chunk that still has a running
    # row applies the step where a row's count allows and no criterion
    # stopped it; the partial chunk at the end runs at the pieces' heights,
    # as the untracked step's does. Rows that stop in the order they lie
    # (the implicit adjoint's, sorted by the steps the forward took) so run
    # on a prefix that shrinks as they stop, not on whole chunks until the
    # chunk's slowest row stops. Returns the next step's cut (0: none runs).
    n = jnp.minimum(active_ref[g, t], window_ref[0]) if WINDOW else active_ref[g, t]
    n_next = active_ref[g, jnp.minimum(t + 1, active_ref.shape[1] - 1)]
    n_next = jnp.where(t + 1 < active_ref.shape[1], n_next, 0)
    window_ref[0] = 0

    def body(rows, mask):
      del mask  # `running` masks the rows past the prefix, and the stopped ones
      start, height = rows.start, rows.size
      c = start // chunk if isinstance(start, int) else lax.div(start, jnp.int32(chunk))

      @pl.when(alive_ref[c] > 0)
      def _():
        h, h_new, flag = evaluate(t, rows)
        s = loop_lib.LoopState(h, residual_ref[rows], steps_ref[rows], halted_ref[rows])
        running = chunks.below(n - start, height) & (s.halted == 0)
        s = loop_lib.apply_update(s, running, t, h_new, flag, halting, elems_per_row, residual)
        store(rows, s.h)
        residual_ref[rows] = s.residual
        steps_ref[rows] = s.steps
        halted_ref[rows] = s.halted
        alive = chunks.below(n_next - start, height) & (s.halted == 0)
        # 1 + the chunk's last row that runs at the next step (0: none).
        last = jnp.max(jnp.where(alive, lax.broadcasted_iota(jnp.int32, alive.shape, 0) + 1, 0))
        alive_ref[c] = (last > 0).astype(jnp.int32)
        window_ref[0] = jnp.maximum(window_ref[0], jnp.where(last > 0, start + last, 0))

    chunks.over_prefix(n, body)
    return window_ref[0]

  trips = trips_ref[g]
  if track:
    def cond(carry):
      t, window = carry
      return (t < trips) & (window > 0)

    lax.while_loop(cond, lambda carry: (carry[0] + 1, tracked_step(carry[0])),
                   (jnp.int32(0), jnp.int32(plan.group_rows)))
  else:
    def step(t, carry):
      untracked_step(t)
      return carry

    lax.fori_loop(0, trips, step, 0)


def launch(body, p: Any, *, ins, in_kinds, outs, out_kinds, scratch, counts: jax.Array,
           bound: int, name: str):
  """Runs a group kernel (forward or backward): a grid over the groups, each
  program given two scalar-prefetched tables, the running prefix's length at
  each step (`active_rows`) and each group's longest count, before its refs.

  Not `kernel_toolkit.launch`: the index maps take the grid index and the two
  tables, and the scratch lives in VMEM or SMEM.

  Args:
    body: body(active_ref, trips_ref, ins, outs, scratch), refs in the
      groups' structures.
    p: the plan (`backend`, `config`, `groups`, `group_rows`).
    ins, in_kinds: the input groups and their kinds (`schedule_lib.SHARED`:
      whole; `ROWS_IN`: the group's rows).
    outs, out_kinds: the outputs' avals and kinds (`ROWS_OUT`: the group's
      rows; `TILE`: one slot a group, [groups, ...]).
    scratch: the scratch shapes, in their structure.
    counts: int32 [B] sorted descending within each group (padding: 0).
    bound: the counts' static bound (the table's columns).
    name: the kernel's name.

  Returns:
    The outputs, in `outs`' structure.
  """
  group = p.group_rows
  tail = lambda a: (0,) * (len(a.shape) - 1)
  spec_of = {
      schedule_lib.SHARED: lambda a: pl.BlockSpec(tuple(a.shape),
                                                  lambda g, act, trips: (0,) * len(a.shape)),
      schedule_lib.ROWS_IN: lambda a: pl.BlockSpec((group,) + tuple(a.shape[1:]),
                                                   lambda g, act, trips: (g,) + tail(a)),
      schedule_lib.TILE: lambda a: pl.BlockSpec((1,) + tuple(a.shape[1:]),
                                                lambda g, act, trips: (g,) + tail(a))}
  spec_of[schedule_lib.ROWS_OUT] = spec_of[schedule_lib.ROWS_IN]
  in_leaves, in_tree = tree_util.tree_flatten(ins)
  out_leaves, out_tree = tree_util.tree_flatten(outs)
  scratch_leaves, scratch_tree = tree_util.tree_flatten(scratch)
  active = active_rows(counts, p.groups, max(bound, 1))
  # Each group's longest count: its first (counts descending within a group).
  trips = counts.reshape(p.groups, group)[:, 0].astype(jnp.int32)
  kernel = toolkit.unflattened(body, in_tree, out_tree, scratch_tree, leading=2)
  return tree_util.tree_unflatten(out_tree, pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=(p.groups,),
          in_specs=[spec_of[k](a) for k, a in zip(toolkit.leaf_kinds(in_kinds, ins), in_leaves)],
          out_specs=[spec_of[k](a) for k, a in zip(toolkit.leaf_kinds(out_kinds, outs),
                                                   out_leaves)],
          scratch_shapes=scratch_leaves),
      out_shape=out_leaves,
      compiler_params=p.config.compiler_params,
      interpret=p.backend.interpret,
      name=name,
  )(active, trips, *in_leaves))


def run(p: GroupPlan, ops: LoopOperands, *, residual: bool = True,
        in_order: bool = False) -> LoopOutputs:
  """Runs the group kernel on the rows, sorted by descending count.

  A batch of more than one slab (`slab_rows`) whose rows must be sorted
  runs a slab at a time (`lax.map`): each slab's rows are sorted, run and
  put back on their own, so that XLA keeps each permutation's operands in
  VMEM. Rows known in order move nowhere and run as one batch.

  Args:
    p: from `plan`, with no problems.
    ops: the loop's operands (consts: the caller's; the kernel takes the
      traced step's own constants from `p`).
    residual: track each row's last residual (else it is returned as 0).
    in_order: the rows are in count order, known at trace time (one count
      for every row): no row is sorted or moved.
  """
  assert not p.problems and p.config is not None, p.problems
  if in_order or p.slabs == 1:
    return _run_rows(p, ops, residual=residual, in_order=in_order)
  one = dataclasses.replace(p, rows=p.slab_rows)

  def on_slab(per_row, counts):
    h0, x, row_ids = per_row
    out = _run_rows(one, ops._replace(h0=h0, x=x, counts=counts, row_ids=row_ids),
                    residual=residual, in_order=False)
    return out._replace(ys=None), None

  out, _ = tiling.in_slabs(on_slab, (ops.h0, ops.x, ops.row_ids), ops.counts,
                           slabs=p.slabs, rows=p.slab_rows, must_be_finite=False)
  return out


def _run_rows(p: GroupPlan, ops: LoopOperands, *, residual: bool,
              in_order: bool) -> LoopOutputs:
  """`run` on `p.rows` rows padded to whole groups, one permutation."""
  track = residual or ops.halting is not None
  group, padded = p.group_rows, p.rows
  max_iters = p.max_iters
  params, consts = toolkit.shared_operands(ops.params, p.traced.const_values, p.sliced)
  halting = tree_util.tree_map(lambda a: a.reshape(1, 1), ops.halting)
  column = lambda dtype: jax.ShapeDtypeStruct((padded, 1), dtype)
  outs = _Outs(
      h=tree_util.tree_map(lambda a: jax.ShapeDtypeStruct((padded,) + a.shape[1:], a.dtype),
                           ops.h0),
      residual=column(jnp.float32) if track else None,
      steps=column(jnp.int32) if track else None,
      halted=column(jnp.int32) if track else None)
  scratch = _Scratch(alive=pltpu.SMEM((group // p.chunk_rows,), jnp.int32) if track else None,
                     window=pltpu.SMEM((1,), jnp.int32) if track else None)
  body = functools.partial(_kernel, plan=p, elems_per_row=loop_lib.elems_per_row(ops.h0),
                           track=track, residual=residual)

  def on_groups(per_row, counts):
    h_in, x_in, index = per_row  # leaves [B, ...]; index int32 [B] or None
    ins = _Ins(params=params, consts=consts, halting=halting, h=h_in, x=x_in,
               rows=index.reshape(padded, 1) if p.uses_rows else None)
    got = launch(body, p, ins=ins, in_kinds=_IN_KINDS, outs=outs, out_kinds=_OUT_KINDS,
                 scratch=scratch, counts=counts, bound=max_iters, name=KERNEL_NAME)
    stats = [a[:, 0] for a in (got.residual, got.steps, got.halted)] if track else []
    return (got.h, stats), None

  # Only what the kernel reads travels into count order (the rows' indices
  # only for a keyed step), and only what it computes travels back: without
  # tracking, each row applied its count, none halted, no residual is asked
  # for, and those are known in the caller's order. Each leaf travels on its
  # own, by the TPU's row kernels where they take it (`kernel_tpu_rows`:
  # vector loads in VMEM, put back by the order itself, no inverse sorted),
  # else by XLA's gather (`tiling.take_rows` says why not one packed
  # gather). Rows are moved whenever the counts are not known in order at trace time
  # (`in_order`): a device branch that skipped the gathers for counts found
  # in order cost more than it saved, because XLA copies a branch's gathered
  # operands into VMEM synchronously (on a TPU v5e, B=32768: +0.33 ms on the
  # recurrent-depth gradient, +0.04 ms on the forward; RESULTS.md, "The
  # active-rows table and the sortedness branch").
  index = ops.row_ids if p.uses_rows else None
  (h, tracked), _ = tiling.in_tiles(
      on_groups, (ops.h0, ops.x, index), ops.counts, rows=padded, sort=not in_order,
      must_be_finite=False, invert_by_sort=True,
      moves=kernel_tpu_rows.moves(p.backend.interpret))
  if track:
    residual_out, steps, halted = tracked
    return LoopOutputs(h, residual_out, steps, halted > 0, None)
  batch = ops.counts.shape[0]
  return LoopOutputs(h, jnp.zeros((batch,), jnp.float32), ops.counts,
                     jnp.zeros((batch,), jnp.bool_), None)
