"""The TPU's backward kernel: a group of rows resident in VMEM, steps outermost.

Legend (shapes in comments):
  B: rows, sorted by descending window length, padded to whole groups
  G: rows of a group (one grid program)   C: rows of a chunk (one evaluation of the step)
  S: checkpoints a row keeps              K: the checkpoint interval (states a segment keeps)
  W: the window bound (max_iters)         ...: a leaf's trailing (per-row) dimensions

The checkpointed window VJP of `loop_reverse.reverse_window`, laid out the way
the TPU's forward (`kernel_tpu_groups.py`) lays out the loop. The tile
kernel (`kernel_backward.py`) runs one tile's rows at a time to its longest
window: on a TPU core a tile's step is one chain of dependent matrix-unit,
vector and transcendental work, and every row carries its window in [TB, 1]
columns. Here one program owns a group of G rows, sorted by descending
window length, so at window step w the rows that apply it are a prefix of the
group (`active[g, w]` rows, a table scalar-prefetched to SMEM). Three passes,
each over the prefix's chunks of C rows (full chunks unmasked, the one partial
chunk masked, none past it):

  1. forward from the window's start, keeping the state every K steps in a
     VMEM checkpoint buffer [S, G, ...];
  2. per segment, last first: its K states recomputed from its checkpoint
     into a VMEM segment buffer [K, G, ...];
  3. the segment reversed: the step's VJP (`kernel_backward.float_vjp`, the
     tile kernel's) at each state, the cotangent [G, ...] updated in place in
     its output block, the shared operands' gradients summed per group in
     float32 and the inputs' per row.

A masked row (past the prefix, in the partial chunk) feeds a zero cotangent
and keeps its own: it adds nothing (the VJP is linear in the cotangent), as in
every backward of the project. The buffers never leave VMEM (no [S, B, ...]
written back to HBM), and Pallas' pipeline streams group g + 1's rows in while
group g runs.

What it does not take runs the tile kernel instead (`plan`): windows on one
clock (a step that takes its scalar step index, or per-step outputs), unsorted
rows, bool state leaves, or a group that does not fit VMEM.
"""

from __future__ import annotations

import dataclasses
import functools
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
from pallas_loop._src.kernels import kernel_backward
from pallas_loop._src.kernels import kernel_toolkit as toolkit
from pallas_loop._src.kernels import kernel_tpu_groups
from pallas_loop._src.kernels import kernel_tpu_rows
from pallas_loop._src.kernels import schedule as schedule_lib
from pallas_loop._src.step import footprint as footprint_lib
from pallas_loop._src.step import step_fn as step_fn_lib
from pallas_loop._src import loop as loop_lib
from pallas_loop._src import loop_reverse
from pallas_loop._src import tiling
from pallas_loop._src.operands import Gradients, WindowOperands

KERNEL_NAME = "pallas_loop_iterate_bwd_groups"


@dataclasses.dataclass(frozen=True)
class GroupWindowPlan(kernel_tpu_groups.GroupLayout):
  """How the group backward kernel will run.

  Attributes:
    backend: Mosaic TPU or its interpret mode.
    chunk_rows: C.
    group_rows: G (a multiple of C).
    rows: B padded to whole groups.
    every: K.
    checkpoints: S, ceil(W / K).
    bound: W.
    traced: the step traced at the chunk's shapes.
    shared_shapes: true shapes of params leaves, then the traced constants.
    shared_float: which of those get a gradient; x_float: which x leaves do.
    reads_t, reads_rows: the step reads its rows' step indices / indices
      in the caller's batch (keys): the kernel then reads [G, 1] columns.
    config: the kernel's configuration.
    footprint: what one chunk's VJP holds.
    pieces: (rows, the step traced at them) for a window step's partial
      chunk (`kernel_tpu_groups.trace_pieces`).
    slab_rows: the rows of one slab (`kernel_tpu_groups.slab_rows`), a
      multiple of G dividing `rows`; `rows` when the batch is one slab.
  """

  backend: backend_lib.Backend
  chunk_rows: int
  group_rows: int
  rows: int
  every: int
  checkpoints: int
  bound: int
  traced: step_fn_lib.SpecializedStep
  shared_shapes: tuple
  shared_float: tuple[bool, ...]
  x_float: tuple[bool, ...]
  reads_t: bool
  reads_rows: bool
  config: backend_lib.KernelConfig
  footprint: footprint_lib.Footprint
  problems: tuple[str, ...] = ()
  pieces: tuple = ()
  slab_rows: int = 0

  def run(self, ops: WindowOperands, *, sort_rows: bool, in_order: bool = False,
          schedule: str | None = None) -> Gradients:
    del schedule  # a TPU core runs its groups in order: one schedule
    assert sort_rows, "the group backward needs rows sorted by window length (`plan`)"
    return run(self, ops, in_order=in_order)


def plan(backend: backend_lib.Backend, step_fn: step_fn_lib.StepFn, params, consts, h, x, *,
         block_rows: int | None, bound: int, every: int | None, outputs: Any = None,
         sort_rows: bool = True, approx_tanh: bool | None = None) -> Any:
  """The group backward's plan, or the tile kernel's (`kernel_backward.plan`)
  where this one does not apply.

  Args:
    backend: Mosaic TPU or its interpret mode.
    step_fn, params, consts, h, x: as `kernel_backward.plan`.
    block_rows: C, the chunk's rows (None: `kernel_tpu_groups.default_chunk_rows`).
    bound: W, the static bound on the window length.
    every: K, the checkpoint interval (None: the window W itself where a
      group of W states a row fits VMEM at the default chunk, else
      `loop_reverse.default_every`).
    outputs: the per-step outputs' avals, or None.
    sort_rows: the caller's `sort_rows`.
    approx_tanh: `Options.approx_tanh`.

  Returns:
    A `GroupWindowPlan`, or a `kernel_backward.WindowPlan`.
  """
  given_every = every
  # A segment never holds more states than the window has.
  every = min(every or loop_reverse.default_every(bound), max(bound, 1))
  tile_kernel = functools.partial(
      kernel_backward.plan, backend, step_fn, params, consts, h, x, block_rows=block_rows,
      bound=bound, every=every, outputs=outputs, approx_tanh=approx_tanh)
  # One clock for every row (a scalar step index, per-step outputs), rows
  # left in the caller's order: the running rows are no prefix. A bool
  # state leaf: Mosaic carries none through a loop (`loop_reverse`).
  if (outputs is not None or step_fn.indexed or not sort_rows
      or any(jnp.dtype(a.dtype) == jnp.bool_ for a in tree_util.tree_leaves(h))):
    return tile_kernel()
  batch = tree_util.tree_leaves(h)[0].shape[0]
  chunk = block_rows or kernel_tpu_groups.default_chunk_rows(batch)
  if given_every is None and bound > every:
    # The whole window as one segment where its states fit VMEM at the
    # chunk asked for: no checkpointing pass (each state is computed twice,
    # not three times). On a v5e `jax.grad` of the tanh RNN (B=32768, D=128,
    # bfloat16) ran 10% faster at T=64 (groups of 4096 rows) and 4% at T=128
    # (2048) than with K ~ sqrt(T) (RESULTS.md, "The checkpoint interval").
    whole = _plan_at(backend, step_fn, params, consts, h, x, chunk, bound=bound, every=bound,
                     approx_tanh=approx_tanh)
    if whole is not None:
      return whole
  p = _plan_at(backend, step_fn, params, consts, h, x, chunk, bound=bound, every=every,
               approx_tanh=approx_tanh)
  while (p is None and block_rows is None
         and chunk // 2 >= backend_mosaic_tpu.SMALLEST_TILE):
    # The default chunk's VJP does not fit beside the group's buffers: halve it.
    chunk //= 2
    p = _plan_at(backend, step_fn, params, consts, h, x, chunk, bound=bound, every=every,
                 approx_tanh=approx_tanh)
  # Where no group fits, or the VJP breaks a rule, the tile kernel's plan
  # runs it or says why not (its messages are the ones users know).
  return p if p is not None else tile_kernel()


def _plan_at(backend, step_fn, params, consts, h, x, chunk, *, bound, every,
             approx_tanh) -> GroupWindowPlan | None:
  """The plan at C = `chunk` rows, or None where it has a problem."""
  parts = kernel_backward.vjp_parts(backend, step_fn, params, consts, h, x, chunk,
                                    bound=bound, every=every, approx_tanh=approx_tanh)
  if isinstance(parts, kernel_backward.WindowPlan):  # declined before measuring
    return None
  traced = parts.tile.traced
  batch = tree_util.tree_leaves(h)[0].shape[0]
  # A chunk is a dynamic slice of the group's rows in VMEM, under Mosaic's
  # block rules (`kernel_tpu_groups.chunk_blocks`).
  blocks, chunk_problems = kernel_tpu_groups.chunk_blocks(backend, batch, chunk,
                                                          (("h", h), ("x", x)))
  if chunk_problems:
    return None
  for path, a in tree_util.tree_flatten_with_path(params)[0]:
    blocks.append(backend_lib.Block(f"params{tree_util.keystr(path)}", toolkit.shared_2d(a),
                                    toolkit.shared_2d(a), row_axis=None))
  if (backend.block_problems(blocks) or parts.step_problems
      or backend_lib.step_problems(backend, traced.jaxpr)):
    return None
  # The traced step's inputs: the params, h and x leaves, then the rows'
  # step indices [C, 1], their indices in the batch [C, 1], the scalar index.
  position = len(tree_util.tree_leaves((params, h, x)))
  reads_t = kernel_tpu_groups.reads_input(traced.jaxpr, position)
  reads_rows = kernel_tpu_groups.reads_input(traced.jaxpr, position + 1)
  shared_avals = [jax.ShapeDtypeStruct(toolkit.shared_2d(a), jnp.result_type(a))
                  for a in parts.shared]
  columns = int(reads_t) + int(reads_rows)
  fp = footprint_lib.measure(
      [(parts.jaxpr, len(parts.shared))], batch=batch, block_rows=chunk,
      shared_avals=shared_avals, row_block_avals=_row_blocks(h, x, chunk, columns))
  checkpoints = loop_reverse.checkpoint_slots(bound, every)
  # Slabs as the forward's (the state twice and the inputs a row), so that a
  # batch's forward and backward split alike: the batches the chip measured
  # at full rate in one slab (B=32768 at D=128) stay one here too, although
  # the backward moves more a row (the cotangent, the inputs' gradients).
  hs, xs = tree_util.tree_leaves(h), tree_util.tree_leaves(x)
  slab = kernel_tpu_groups.slab_rows(batch, chunk, 2 * hs + xs)
  configured = _configure(backend, fp, slab, chunk, h, x, shared_avals, columns,
                          states=1 + checkpoints + every)
  if configured is None:
    return None
  config, group = configured
  config = backend_lib.for_call(config, h, approx_tanh)
  if config is None:
    return None
  padded, slab = kernel_tpu_groups.slab_layout(batch, chunk, group, slab)
  return GroupWindowPlan(
      backend=backend, chunk_rows=chunk, group_rows=group, rows=padded, slab_rows=slab,
      every=every,
      checkpoints=checkpoints, bound=bound, traced=traced,
      shared_shapes=tuple(np.shape(a) for a in parts.shared),
      shared_float=parts.shared_float,
      x_float=tuple(loop_reverse.is_float(a) for a in tree_util.tree_leaves(x)),
      reads_t=reads_t, reads_rows=reads_rows, config=config, footprint=fp,
      pieces=kernel_tpu_groups.trace_pieces(step_fn, params, consts, h, x, chunk, traced))


def _row_blocks(h, x, rows: int, columns: int) -> list:
  """The avals of a program's row blocks at `rows` rows: the state, its
  cotangent in and out, the inputs and their float32 gradients, and
  `columns` [rows, 1] int32 columns."""
  hs = tree_util.tree_leaves(step_fn_lib.avals(h, rows))
  xs = tree_util.tree_leaves(step_fn_lib.avals(x, rows))
  return (3 * hs + xs + [jax.ShapeDtypeStruct(a.shape, jnp.float32) for a in xs]
          + [jax.ShapeDtypeStruct((rows, 1), np.int32)] * columns)


def _configure(backend, fp, batch, chunk, h, x, shared_avals, columns, states):
  """(config, G) or None: the group's rows and the VMEM the kernel asks for.

  VMEM holds, double-buffered, the group's row blocks (`_row_blocks`) and the
  shared operands with their float32 per-group gradients; once, `states`
  states a row (the working state, S checkpoints, K segment states); plus a
  chunk's temporaries with the margin libtpu took over their estimate; G as
  the forward's (`kernel_tpu_groups.group_config`).
  """
  size = backend_mosaic_tpu.padded_bytes
  per_row = (2 * sum(size(a.shape, a.dtype) for a in _row_blocks(h, x, chunk, columns))
             + states * sum(size(a.shape, a.dtype)
                            for a in tree_util.tree_leaves(step_fn_lib.avals(h, chunk)))
             ) / chunk
  fixed = (2 * sum(size(a.shape, a.dtype) for a in shared_avals)
           + 2 * sum(size((1,) + tuple(a.shape), "float32") for a in shared_avals)
           + backend_mosaic_tpu.FIXED_SCRATCH
           + int(backend_mosaic_tpu.MARGIN * backend_mosaic_tpu.step_values_bytes(fp)))
  config, group, _ = kernel_tpu_groups.group_config(backend, batch, chunk, per_row=per_row,
                                                    fixed=fixed)
  return None if config is None else (config, group)


class _Ins(NamedTuple):
  """The kernel's input groups (refs in the body; after the two tables)."""

  params: Any   # full blocks, in params' structure
  consts: Any   # list of full blocks: the step's constants
  h: Any        # [G, ...], in h's structure: the state at the window's start
  x: Any        # [G, ...], in x's structure: inputs
  g: Any        # [G, ...], in h's structure: cotangent of the state after the window
  t0: Any       # int32 [G, 1]: each row's first step index (`reads_t`), or None
  rows: Any     # int32 [G, 1]: each row's index in the caller's batch (`reads_rows`), or None


class _Outs(NamedTuple):
  """The kernel's output groups."""

  g_h: Any       # [G, ...], in h's structure: the cotangent, updated in place, then
                 # the cotangent of the state at the window's start
  g_x: Any       # list per x leaf: f32 [G, ...] input gradient (None: not a float leaf)
  g_shared: Any  # list per shared operand: f32 [1, ...] this group's gradient (None: none)


class _Scratch(NamedTuple):
  """The kernel's VMEM scratch, a list per h leaf each."""

  cur: Any       # [G, ...]: the state in the checkpointing pass
  ckpt: Any      # [S, G, ...]: the state every K steps
  seg: Any       # [K, G, ...]: a segment's states


# How each group is blocked (`kernel_tpu_groups.launch`).
_IN_KINDS = _Ins(params=schedule_lib.SHARED, consts=schedule_lib.SHARED,
                 h=schedule_lib.ROWS_IN, x=schedule_lib.ROWS_IN, g=schedule_lib.ROWS_IN,
                 t0=schedule_lib.ROWS_IN, rows=schedule_lib.ROWS_IN)
_OUT_KINDS = _Outs(g_h=schedule_lib.ROWS_OUT, g_x=schedule_lib.ROWS_OUT,
                   g_shared=schedule_lib.TILE)


class _Rows:
  """Rows `rows` of a ref, as a ref (`kernel_backward.RefSum` adds to it)."""

  def __init__(self, ref, rows, count: int):
    self.ref, self.rows = ref, rows
    self.shape = (count,) + tuple(ref.shape[1:])
    self.dtype = ref.dtype

  def __getitem__(self, index):
    assert index is Ellipsis
    return self.ref[self.rows]

  def __setitem__(self, index, value):
    assert index is Ellipsis
    self.ref[self.rows] = value


def _kernel(active_ref, trips_ref, ins: _Ins, outs: _Outs, scratch: _Scratch, *,
            plan: GroupWindowPlan):
  """The kernel body of group g:

  active_ref: SMEM int32 [groups, W]   rows of each group whose window has step w
  trips_ref: SMEM int32 [groups]       each group's longest window
  ins, outs, scratch: the named groups (`_Ins`, `_Outs`, `_Scratch`)
  """
  g = pl.program_id(0)
  chunk, every = plan.chunk_rows, plan.every
  rules = plan.config.eval_rules
  shared = toolkit.shared_loader(ins.params, ins.consts, plan.shared_shapes, on_chip=True)
  h_tree = tree_util.tree_structure(ins.h)
  for r in outs.g_x + outs.g_shared:
    if r is not None:
      r[...] = jnp.zeros(r.shape, r.dtype)
  for src, dst in zip(tree_util.tree_leaves(ins.g), tree_util.tree_leaves(outs.g_h)):
    dst[...] = src[...]
  for src, dst in zip(tree_util.tree_leaves(ins.h), scratch.cur):
    dst[...] = src[...]

  chunks, traced_at = plan.chunks(), plan.traced_at()

  def read(refs, rows, slot=None):
    leaves = [r[rows] if slot is None else r[slot, rows] for r in refs]
    return tree_util.tree_unflatten(h_tree, leaves)

  def write(refs, rows, value, slot=None):
    for r, v in zip(refs, tree_util.tree_leaves(value)):
      if slot is None:
        r[rows] = v.astype(r.dtype)
      else:
        r[slot, rows] = v.astype(r.dtype)

  def operands(w, rows):
    """(x, t, row ids) of the chunk at window step w."""
    x = tree_util.tree_map(lambda r: r[rows], ins.x)
    zeros = jnp.zeros((rows.size, 1), jnp.int32)
    t = ins.t0[rows] + w if plan.reads_t else zeros
    ids = ins.rows[rows] if plan.reads_rows else zeros
    return x, t, ids

  def step(shared, h, x, t, rows, index, rules=rules):
    params, consts = shared
    traced = traced_at[tree_util.tree_leaves(h)[0].shape[0]]  # the chunk's or a piece's
    return traced.apply(consts, params, h, x, t, rows, index, rules=rules)[:2]

  def advance(w, src, dst, src_slot=None, dst_slot=None):
    """dst = the state after window step w (rows that do not apply it keep src's)."""
    def body(rows, mask):
      h = read(src, rows, src_slot)
      x, t, ids = operands(w, rows)
      h_new = step(shared, h, x, t, ids, w)[0]
      write(dst, rows, h_new if mask is None else loop_lib.select_rows(mask, h_new, h),
            dst_slot)
    chunks.over_prefix(active_ref[g, w], body)

  trips = trips_ref[g]
  n_seg = (trips + every - 1) // every

  # 1. The window forward, a checkpoint every K steps.
  def checkpoint_segment(s, carry):
    for r, c in zip(scratch.cur, scratch.ckpt):
      c[s] = r[...]

    def one(j, carry):
      advance(s * every + j, scratch.cur, scratch.cur)
      return carry

    return lax.fori_loop(0, every, one, carry)

  lax.fori_loop(0, jnp.maximum(n_seg - 1, 0), checkpoint_segment, 0)

  @pl.when(n_seg > 0)
  def _():
    for r, c in zip(scratch.cur, scratch.ckpt):
      c[n_seg - 1] = r[...]

  vjp = functools.partial(kernel_backward.float_vjp, rules=rules,
                          plain_step=functools.partial(step, rules=None),
                          shared_float=plan.shared_float)
  acc_shared = kernel_backward.RefSum(outs.g_shared)

  # 2 and 3. Each segment, last first: recomputed, then reversed.
  def reverse_segment(i, carry):
    s = n_seg - 1 - i
    first = s * every
    length = jnp.minimum(every, trips - first)
    for c, sg in zip(scratch.ckpt, scratch.seg):
      sg[0] = c[s]

    def recompute(j, carry):
      advance(first + j, scratch.seg, scratch.seg, src_slot=j, dst_slot=j + 1)
      return carry

    lax.fori_loop(0, length - 1, recompute, 0)

    def back(jj, carry):
      j = length - 1 - jj
      w = first + j

      def body(rows, mask):
        h = read(scratch.seg, rows, j)
        x, t, ids = operands(w, rows)
        ct = read(tree_util.tree_leaves(outs.g_h), rows)
        if mask is not None:
          ct_in = loop_lib.select_rows(mask, ct, tree_util.tree_map(jnp.zeros_like, ct))
        else:
          ct_in = ct
        acc_x = kernel_backward.RefSum(
            [None if r is None else _Rows(r, rows, rows.size) for r in outs.g_x])
        d_h, _, _ = vjp(None, shared, h, x, t, ids, w, ct_in, None, acc_shared, acc_x)
        write(tree_util.tree_leaves(outs.g_h), rows,
              d_h if mask is None else loop_lib.select_rows(mask, d_h, ct))

      chunks.over_prefix(active_ref[g, w], body)
      return carry

    lax.fori_loop(0, length, back, 0)
    return carry

  lax.fori_loop(0, n_seg, reverse_segment, 0)


def _on_groups(p: GroupWindowPlan, params, consts, ops: WindowOperands):
  """on_groups(per_row, n) -> ((g_h, g_x), group sums): the kernel on
  `p.rows` rows in window order (`tiling.in_tiles`' `run`)."""
  group, padded = p.group_rows, p.rows
  shared = tree_util.tree_leaves(params) + consts
  h_leaves = tree_util.tree_leaves(ops.h_start)
  x_leaves = tree_util.tree_leaves(ops.x)
  struct = jax.ShapeDtypeStruct
  outs = _Outs(
      g_h=tree_util.tree_map(lambda a: struct((padded,) + a.shape[1:], a.dtype), ops.h_start),
      g_x=[struct((padded,) + a.shape[1:], jnp.float32) if f else None
           for a, f in zip(x_leaves, p.x_float)],
      g_shared=[struct((p.groups,) + a.shape, jnp.float32) if f else None
                for a, f in zip(shared, p.shared_float)])
  vmem = pltpu.VMEM
  scratch = _Scratch(
      cur=[vmem((group,) + a.shape[1:], a.dtype) for a in h_leaves],
      ckpt=[vmem((p.checkpoints, group) + a.shape[1:], a.dtype) for a in h_leaves],
      seg=[vmem((p.every, group) + a.shape[1:], a.dtype) for a in h_leaves])

  def on_groups(per_row, n):
    h_in, x_in, g_in, t0, index = per_row
    column = lambda a: None if a is None else a.reshape(padded, 1)
    ins = _Ins(params=params, consts=consts, h=h_in, x=x_in, g=g_in, t0=column(t0),
               rows=column(index))
    got = kernel_tpu_groups.launch(
        functools.partial(_kernel, plan=p), p, ins=ins, in_kinds=_IN_KINDS, outs=outs,
        out_kinds=_OUT_KINDS, scratch=scratch, counts=n, bound=p.bound, name=KERNEL_NAME)
    return (tree_util.tree_leaves(got.g_h), got.g_x), got.g_shared

  return on_groups


def run(p: GroupWindowPlan, ops: WindowOperands, *, in_order: bool = False) -> Gradients:
  """Runs the group backward on the rows, sorted by descending window length.

  Args:
    p: from `plan`.
    ops: the window (consts: the caller's; the kernel takes the traced
      step's own constants from `p`).
    in_order: the windows are in length order, known at trace time (one
      length for every row): no row is sorted or moved.

  Returns:
    (g_params, g_consts, g_h_start, g_x), in the operands' dtypes (None for
    integer leaves).
  """
  params, consts = toolkit.shared_operands(ops.params, p.traced.const_values)
  # Only what the kernel reads travels into window order: the first step
  # indices and the rows' indices only for a step that reads them.
  per_row = (ops.h_start, ops.x, ops.g, ops.t0 if p.reads_t else None,
             ops.row_ids if p.reads_rows else None)
  if in_order or p.slabs == 1:
    (g_h, g_x), group_sums = tiling.in_tiles(
        _on_groups(p, params, consts, ops), per_row, ops.n, rows=p.rows, sort=not in_order,
        must_be_finite=True, invert_by_sort=True,
        moves=kernel_tpu_rows.moves(p.backend.interpret))
  else:
    # A slab at a time (`kernel_tpu_groups.slab_rows`): each slab's rows
    # sorted, run and put back on their own; its groups' sums stacked.
    one = dataclasses.replace(p, rows=p.slab_rows)
    on_slab = lambda slab_rows, n: tiling.in_tiles(
        _on_groups(one, params, consts, ops), slab_rows, n, rows=one.rows, sort=True,
        must_be_finite=True, invert_by_sort=True,
        moves=kernel_tpu_rows.moves(p.backend.interpret))
    (g_h, g_x), group_sums = tiling.in_slabs(on_slab, per_row, ops.n, slabs=p.slabs,
                                             rows=p.slab_rows, must_be_finite=True)
    group_sums = [None if a is None else a.reshape((-1,) + a.shape[2:]) for a in group_sums]
  return kernel_backward.assemble(ops, group_sums, g_h, g_x, shared_shapes=p.shared_shapes,
                                  sources=p.traced.sources)

