"""The fused iterate kernel: one body shared by every Pallas backend.

Legend (shapes in comments):
  B: rows of the batch, padded to whole tiles    TB: rows per tile (block_rows)
  ...: a leaf's trailing (per-row) dimensions    T: a tile's largest count

Each program of the 1-D grid owns TB consecutive rows (already ordered by
descending count, see `tiling.py`). It loads their state, inputs and counts,
then runs the masked loop of `loop.run_loop`: at most T trips, fewer when
halting stops every row of the tile earlier. A row whose count is spent (or
that has halted) is frozen by masking. The state lives in registers/VMEM
between steps and is written once.

The shared operands (`params` and the arrays `step` closes over) are either
loaded once and held across the loop, or re-read from their refs at each use
(`jaxpr_eval.LoadOnUse`), as the backend's configuration rule decides from the
step's footprint (`configured`, `footprint.py`, `Backend.configure`); the step
is evaluated with the backend's rewrites (`jaxpr_eval.Rules`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from jax import lax
from jax import tree_util
from jax.experimental import pallas as pl
import jax.numpy as jnp
import numpy as np

from pallas_loop._src import backend as backend_lib
from pallas_loop._src import footprint as footprint_lib
from pallas_loop._src import jaxpr_eval
from pallas_loop._src import loop as loop_lib
from pallas_loop._src import schedule as schedule_lib
from pallas_loop._src import step_fn as step_fn_lib
from pallas_loop._src import tiling
from pallas_loop._src.operands import LoopOperands, LoopOutputs

KERNEL_NAME = "pallas_loop_iterate_fwd"


def _iterate_kernel(counts_ref, rows_ref, *refs, spec, trees, n_ops, elems_per_row,
                    residual):
  """The kernel body. Refs, in order:

  counts_ref: int32 [TB, 1]      the tile's step budgets
  rows_ref: int32 [TB, 1]        each row's index in the caller's batch
  shared refs: full blocks       params leaves, then the step's constants
                                 (0-d operands travel as [1, 1])
  halting refs: [1, 1]           tol (float32, if given), min_iters (int32)
  h refs: [TB, ...]              initial state leaves
  x refs: [TB, ...]              input leaves
  out h refs: [TB, ...]          final state leaves
  out residual_ref: f32 [TB, 1]  rms of each row's last update (0 unless `residual`)
  out steps_ref: i32 [TB, 1]     steps applied
  out halted_ref: i32 [TB, 1]    1 where a criterion stopped the row
  out y refs: [S, TB, ...]       per-step outputs (`step_outputs`), time-major:
                                 slot t holds trip t's output, 0 in the rows
                                 that did not apply it (`output_layout`)
  """
  n_params, n_consts, n_halting, n_h, n_x = n_ops
  params_tree, halting_tree, h_tree, x_tree = trees
  it = iter(refs)
  params_refs = [next(it) for _ in range(n_params)]
  const_refs = [next(it) for _ in range(n_consts)]
  halting = tree_util.tree_unflatten(halting_tree, [next(it)[...] for _ in range(n_halting)])
  h_refs = [next(it) for _ in range(n_h)]
  x_refs = [next(it) for _ in range(n_x)]
  h_out_refs = [next(it) for _ in range(n_h)]
  residual_ref, steps_ref, halted_ref = next(it), next(it), next(it)
  y_refs = list(it)

  on_chip = spec.config.shared_on_chip
  shared = shared_loader(params_refs + const_refs, spec.param_shapes + spec.const_shapes,
                         on_chip, spec.sliced)
  params = tree_util.tree_unflatten(params_tree, shared[:n_params])
  consts = shared[n_params:]
  x = tree_util.tree_unflatten(x_tree, [r[...] for r in x_refs])
  h = tree_util.tree_unflatten(h_tree, [r[...] for r in h_refs])
  rules = spec.config.eval_rules
  body = lambda p, h, x, t, rows, index: spec.traced.apply(consts, p, h, x, t, rows, index,
                                                          rules=rules)
  state = loop_lib.run_loop(body, params, h, x, counts_ref[...], rows_ref[...], halting,
                           elems_per_row, residual,
                           write_output=output_writer(y_refs) if y_refs else None)
  if y_refs:
    # The slots after the tile's last trip (trips = the most steps a row of
    # the tile applied) were not written in the loop: each slot is written
    # once, there or here.
    zero_slots(y_refs, jnp.max(state.steps), spec.max_iters)
  for ref, leaf in zip(h_out_refs, tree_util.tree_leaves(state.h)):
    ref[...] = leaf
  residual_ref[...] = state.residual
  steps_ref[...] = state.steps
  halted_ref[...] = state.halted


@dataclasses.dataclass(frozen=True)
class TilePlan:
  """How the kernel will run on one backend, or why it cannot.

  Attributes:
    backend: the backend it was planned for.
    block_rows: rows per tile.
    rows: the batch padded to whole tiles.
    traced: the step traced at the tile's shapes.
    param_shapes/const_shapes: true shapes of the shared operands.
    config: the backend's configuration (None when no configuration fits).
    footprint: what one program holds on chip (`footprint.Footprint`).
    problems: violated backend rules; empty when the kernel can run.
    sliced: positions among the shared operands (params leaves, then
      constants) read one leading slice at a time (`params[index]`).
    outputs: the per-step outputs' avals ([B, T, ...] leaves, as
      `LoopOutputs.ys`), or None: the kernel writes them (`output_layout`).
  """

  backend: backend_lib.Backend
  block_rows: int
  rows: int
  traced: step_fn_lib.SpecializedStep
  param_shapes: tuple
  const_shapes: tuple
  config: backend_lib.KernelConfig | None
  footprint: footprint_lib.Footprint | None
  problems: tuple[str, ...]
  sliced: frozenset[int] = frozenset()
  outputs: Any = None

  def run(self, ops: LoopOperands, *, sort_rows: bool, residual: bool = True,
          schedule: str | None = None) -> LoopOutputs:
    """`run(self, ops, ...)`: the kernel on the rows in tiles."""
    return run(self, ops, sort_rows=sort_rows, residual=residual, schedule=schedule)

  @property
  def max_iters(self) -> int:
    """T, the per-step outputs' slots that are read (0 without outputs)."""
    leaves = tree_util.tree_leaves(self.outputs)
    return leaves[0].shape[1] if leaves else 0


# --- Per-step outputs: time-major blocks, written at the trip's slot --------


def output_slots(max_iters: int) -> int:
  """S, the slots of a per-step output block: max_iters rounded up to a
  power of 2 (Triton's block rule; the slots past max_iters are never read)."""
  return backend_lib.next_power_of_2(max(max_iters, 1))


def output_layout(a, rows: int) -> jax.ShapeDtypeStruct:
  """The kernels' layout of a per-step output leaf `a` ([B, T, ...],
  row-major as `LoopOutputs.ys`) for `rows` rows: time-major [S, rows, ...],
  so that a trip writes (and the backward reads) one leading slot at a
  dynamic index; a 1-D output ([B, T]) as [S, rows, 1] (Mosaic's last two
  block dims), a bool one as int32 (no bool refs)."""
  dtype = jnp.int32 if jnp.dtype(a.dtype) == jnp.bool_ else a.dtype
  return jax.ShapeDtypeStruct(
      (output_slots(a.shape[1]), rows) + (tuple(a.shape[2:]) or (1,)), dtype)


def to_output_layout(a: jax.Array) -> jax.Array:
  """Row-major [P, T, ...] -> the kernels' [S, P, ...] (`output_layout`),
  the slots past T zero."""
  want = output_layout(a, a.shape[0])
  a = jnp.swapaxes(a, 0, 1).reshape((a.shape[1],) + want.shape[1:]).astype(want.dtype)
  return jnp.pad(a, [(0, want.shape[0] - a.shape[0])] + [(0, 0)] * (a.ndim - 1))


def from_output_layout(a: jax.Array, like) -> jax.Array:
  """The kernels' [S, P, ...] -> row-major [P, T, ...] in the trailing shape
  and dtype of `like` ([B, T, ...])."""
  steps = like.shape[1]
  a = jnp.swapaxes(a[:steps], 0, 1)
  return a.reshape(a.shape[:2] + tuple(like.shape[2:])).astype(like.dtype)


def output_spec(a, block_rows: int) -> pl.BlockSpec:
  """Blocks [S, block_rows, ...] of an [S, P, ...] operand, one per program."""
  return pl.BlockSpec((a.shape[0], block_rows) + tuple(a.shape[2:]),
                      lambda i: (0, i) + (0,) * (len(a.shape) - 2))


def output_writer(y_refs):
  """`write_output(t, running, y)` for `loop.run_loop`: slot t of each
  output ref ([S, TB, ...]) gets y, 0 in the rows that are not running."""
  def write(t, running, y):
    for ref, leaf in zip(y_refs, tree_util.tree_leaves(y)):
      value = leaf.reshape(ref.shape[1:]).astype(ref.dtype)
      ref[t] = jnp.where(loop_lib.row_mask(running, value.shape), value,
                         jnp.zeros(value.shape, ref.dtype))
  return write


def zero_slots(y_refs, lo: jax.Array, hi: int) -> None:
  """Writes 0 to slots [lo, hi) of each output ref (`lo` traced)."""
  def body(t):
    for ref in y_refs:
      ref[t] = jnp.zeros(ref.shape[1:], ref.dtype)
    return t + 1
  jax.lax.while_loop(lambda t: t < hi, body, lo.astype(jnp.int32))


def shared_2d(a) -> tuple[int, ...]:
  """The shape a shared operand travels in: at least 2-D ([1, 1] for 0-d,
  [1, N] for 1-D), so that its per-tile gradient block [1, ...] keeps the
  operand's last two dimensions whole, as Mosaic requires."""
  shape = tuple(np.shape(a))
  return (1,) * (2 - len(shape)) + shape if len(shape) < 2 else shape


def shared_operands(params_leaves, const_values, sliced: frozenset[int] = frozenset()) -> list:
  """params leaves, then the step's constants, reshaped by `shared_2d`.

  A 2-D operand the step reads one leading slice at a time (`sliced`,
  `params[index]` of stacked [T, N] weights) travels as [T, 1, N]: its step
  axis is then a leading axis, which Mosaic indexes dynamically, not the
  sublane axis, whose dynamic offsets it must prove multiples of 8.
  """
  def shaped(i, a):
    if i in sliced and np.ndim(a) == 2:
      return jnp.reshape(a, (np.shape(a)[0], 1, np.shape(a)[1]))
    return jnp.reshape(a, shared_2d(a))
  return [shaped(i, a) for i, a in enumerate(list(params_leaves) + list(const_values))]


def row_spec(a, block_rows: int) -> pl.BlockSpec:
  """Tiles of `block_rows` rows of an operand [P, ...], one per program."""
  trailing = (0,) * (len(a.shape) - 1)
  return pl.BlockSpec((block_rows,) + tuple(a.shape[1:]), lambda i: (i,) + trailing)


def full_spec(a) -> pl.BlockSpec:
  """The whole operand in every program."""
  return pl.BlockSpec(a.shape, lambda i: (0,) * len(a.shape))


def shared_loader(refs, shapes, on_chip: bool, sliced: frozenset[int] = frozenset()) -> list:
  """The shared operands as the step sees them inside a kernel.

  `on_chip`: loaded now, once (held across the loop); else a
  `jaxpr_eval.LoadOnUse` per operand, read where each use needs it. The
  operands in `sliced` (positions: stacked per-step weights the step reads
  as `params[index]`, `backend.leading_slices`) are always read on use, one
  step's slice at a time.
  """
  return [jaxpr_eval.LoadOnUse(r, s) if i in sliced or not on_chip else r[...].reshape(s)
          for i, (r, s) in enumerate(zip(refs, shapes))]


def configured(backend, batch: int, block_rows, plan_at):
  """Plans at the default (or given) tile height, then at the height the
  backend's configuration rule asks for, if it asks for another. A default
  height at which no configuration fits (the TPU's tall default tiles, with
  a wide state, in VMEM) is halved down to `Backend.smallest_default_rows`
  until one does; a height the caller chose is kept, and its plan says why
  it does not fit.

  Args:
    backend: the backend.
    batch: B.
    block_rows: the caller's tile height, or None.
    plan_at: plan_at(tb) -> a plan with `.config`, `.footprint` and
      `.block_rows`.
  """
  tb = block_rows or backend.default_block_rows(batch)
  p = plan_at(tb)
  if block_rows is not None:
    return p
  while p.config is None and p.footprint is not None and tb // 2 >= backend.smallest_default_rows:
    tb //= 2
    p = plan_at(tb)
  if p.config is not None and p.config.block_rows != tb:
    p = plan_at(p.config.block_rows)
  return p


def plan(backend, step_fn, params, consts, h0, x, block_rows=None, outputs=None, *,
         approx_tanh: bool | None = None) -> TilePlan:
  """Traces the step at the tile shape and checks the backend's rules
  (`outputs`: the per-step outputs' [B, T, ...] avals, or None;
  `approx_tanh`: `Options.approx_tanh`, which the configuration's
  evaluation rules take: `backend.configure`)."""
  batch = tree_util.tree_leaves(h0)[0].shape[0]
  return configured(backend, batch, block_rows, lambda tb: _plan_at(
      backend, step_fn, params, consts, h0, x, tb, given=block_rows is not None,
      outputs=outputs, approx_tanh=approx_tanh))


def _plan_at(backend, step_fn, params, consts, h0, x, tb, *, given, outputs=None,
             approx_tanh=None) -> TilePlan:
  batch = tree_util.tree_leaves(h0)[0].shape[0]
  padded = tiling.padded_rows(batch, tb)
  traced = step_fn.specialize(params, consts, step_fn_lib.avals(h0, tb), step_fn_lib.avals(x, tb))
  blocks = [backend_lib.Block("iters", (tb, 1), (padded, 1)),
            backend_lib.Block("row indices", (tb, 1), (padded, 1))]
  for name, tree in (("h0", h0), ("x", x)):
    for path, a in tree_util.tree_flatten_with_path(tree)[0]:
      blocks.append(backend_lib.Block(
          f"{name}{tree_util.keystr(path)}", (tb,) + a.shape[1:], (padded,) + a.shape[1:]))
  for path, a in tree_util.tree_flatten_with_path(params)[0]:
    blocks.append(backend_lib.Block(f"params{tree_util.keystr(path)}",
                                    shared_2d(a), shared_2d(a), row_axis=None))
  for i, c in enumerate(traced.const_values):
    blocks.append(backend_lib.Block(f"an array step closes over (#{i})",
                                    shared_2d(c), shared_2d(c), row_axis=None))
  y_blocks = [output_layout(a, tb) for a in tree_util.tree_leaves(outputs)]
  for (path, a), b in zip(tree_util.tree_flatten_with_path(outputs)[0], y_blocks):
    blocks.append(backend_lib.Block(f"per-step output y{tree_util.keystr(path)}", b.shape,
                                    output_layout(a, padded).shape, row_axis=1))
  n_params = len(tree_util.tree_leaves(params))
  sliced, slice_eqns = backend_lib.leading_slices(
      traced.jaxpr, traced.jaxpr.invars[:n_params] + traced.jaxpr.constvars)
  typed = backend_lib.extended_dtype_problems(_named_operands(params, traced, h0, x))
  if typed:  # no footprint to measure: such operands have no itemsize the rules know
    return TilePlan(backend=backend, block_rows=tb, rows=padded, traced=traced,
                    param_shapes=(), const_shapes=(), config=None, footprint=None,
                    problems=tuple(typed))
  problems = (backend.block_problems(blocks)
              + backend_lib.step_problems(backend, traced.jaxpr, slice_eqns))
  shared = list(tree_util.tree_leaves(params)) + list(traced.const_values)
  # Row blocks: h in and out, x, and four [TB, 1] columns (counts, rows, stats).
  row_blocks = (2 * tree_util.tree_leaves(step_fn_lib.avals(h0, tb))
                + tree_util.tree_leaves(step_fn_lib.avals(x, tb))
                + [jax.ShapeDtypeStruct((tb, 1), np.int32)] * 5 + y_blocks)
  fp = footprint_lib.measure(
      [(traced.jaxpr, len(tree_util.tree_leaves(params)))], batch=batch, block_rows=tb,
      shared_avals=[jax.ShapeDtypeStruct(shared_2d(a), jnp.result_type(a)) for a in shared],
      row_block_avals=row_blocks)
  config, config_problems = backend_lib.configure(backend, fp, given, state=h0,
                                                  approx_tanh=approx_tanh)
  return TilePlan(
      backend=backend, block_rows=tb, rows=padded, traced=traced,
      param_shapes=tuple(np.shape(a) for a in tree_util.tree_leaves(params)),
      const_shapes=tuple(np.shape(c) for c in traced.const_values),
      config=config, footprint=fp, problems=tuple(problems + config_problems),
      sliced=frozenset(sliced), outputs=outputs)


def _named_operands(params, traced, h0, x) -> list[tuple[str, Any]]:
  """The kernel's operands with names for messages: params leaves, the
  step's constants, h0 and x leaves."""
  named = [(f"{name}{tree_util.keystr(path)}", a)
           for name, tree in (("params", params), ("h0", h0), ("x", x))
           for path, a in tree_util.tree_flatten_with_path(tree)[0]]
  return named + [(f"the array #{i} that step closes over", c)
                  for i, c in enumerate(traced.const_values)]


def run(tile_plan: TilePlan, ops: LoopOperands, *, sort_rows: bool,
        residual: bool = True, schedule: str | None = None,
        programs: int | None = None) -> LoopOutputs:
  """Runs the kernel on the rows in tiles.

  On a backend with `indexed_rows` the kernel reads and writes its rows by
  index in the caller's order (`schedule.over_tiles`, `tiling.slot_rows`);
  on the others the rows are gathered into tiles before and put back after
  (`tiling.in_tiles`).

  Args:
    tile_plan: from `plan`, with no problems.
    ops: the loop's operands (consts: the caller's; the kernel takes the
      traced step's own constants from `tile_plan`).
    sort_rows: order rows by descending count before tiling.
    residual: track each row's last residual (else it is returned as 0).
    schedule: None, "grid" or "persistent" (`schedule.resolve`).
    programs: the persistent grid's size; None: the backend's rule
      (`tile_count_programs`).
  """
  config = tile_plan.config
  assert not tile_plan.problems and config is not None, tile_plan.problems
  tb, padded = tile_plan.block_rows, tile_plan.rows
  params_leaves, params_tree = tree_util.tree_flatten(ops.params)
  h_tree: Any = tree_util.tree_structure(ops.h0)
  x_tree: Any = tree_util.tree_structure(ops.x)
  shared = shared_operands(params_leaves, tile_plan.traced.const_values, tile_plan.sliced)
  halting_leaves, halting_tree = tree_util.tree_flatten(ops.halting)
  halting_ops = [a.reshape(1, 1) for a in halting_leaves]
  rows_of = functools.partial(row_spec, block_rows=tb)
  kernel = functools.partial(
      _iterate_kernel, spec=tile_plan, trees=(params_tree, halting_tree, h_tree, x_tree),
      n_ops=(len(params_leaves), len(tile_plan.const_shapes), len(halting_ops),
             h_tree.num_leaves, x_tree.num_leaves),
      elems_per_row=loop_lib.elems_per_row(ops.h0), residual=residual)
  column = lambda dtype: jax.ShapeDtypeStruct((padded, 1), dtype)
  stats = [column(jnp.float32), column(jnp.int32), column(jnp.int32)]
  y_avals, y_tree = tree_util.tree_flatten(tile_plan.outputs)
  ys = [output_layout(a, padded) for a in y_avals]  # written by the kernel

  def on_tiles(per_row, counts):
    h_in, x_in, index = per_row  # leaves [B, ...]; index int32 [B]
    h_leaves, x_leaves = tree_util.tree_leaves(h_in), tree_util.tree_leaves(x_in)
    columns = [counts.reshape(padded, 1), index.reshape(padded, 1)]
    outs = pl.pallas_call(
        kernel,
        grid=(padded // tb,),
        in_specs=[*map(rows_of, columns), *map(full_spec, shared + halting_ops),
                  *map(rows_of, h_leaves), *map(rows_of, x_leaves)],
        out_specs=[*map(rows_of, h_leaves), *map(rows_of, stats),
                   *(output_spec(a, tb) for a in ys)],
        out_shape=[*(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in h_leaves), *stats, *ys],
        compiler_params=config.compiler_params,
        interpret=tile_plan.backend.interpret,
        name=KERNEL_NAME,
    )(*columns, *shared, *halting_ops, *h_leaves, *x_leaves)
    n_h = h_tree.num_leaves
    h_out = tree_util.tree_unflatten(h_tree, outs[:n_h])
    ys_out = [from_output_layout(a, like) for a, like in zip(outs[n_h + 3:], y_avals)]
    return (h_out, *(a[:, 0] for a in outs[n_h:n_h + 3]), ys_out), None

  batch = ops.counts.shape[0]
  if not tile_plan.backend.indexed_rows or batch == 0:
    (h, residual_out, steps, halted, ys_out), _ = tiling.in_tiles(
        on_tiles, (ops.h0, ops.x, ops.row_ids), ops.counts, rows=padded, sort=sort_rows,
        must_be_finite=False)
  else:  # rows read and written by index, in the caller's order
    h_leaves, x_leaves = tree_util.tree_leaves(ops.h0), tree_util.tree_leaves(ops.x)
    h_shape = [jax.ShapeDtypeStruct((padded,) + a.shape[1:], a.dtype) for a in h_leaves]
    kinds = ([schedule_lib.ROWS_IN] * 2
             + [schedule_lib.SHARED] * (len(shared) + len(halting_ops))
             + [schedule_lib.ROWS_IN] * (len(h_leaves) + len(x_leaves))
             + [schedule_lib.ROWS_OUT] * (len(h_shape) + len(stats))
             + [schedule_lib.ROWS_OUT_SLOTS] * len(ys))
    tiles = padded // tb
    n_programs = tile_count_programs(tile_plan, tiles, schedule, programs)
    load, store = tiling.slot_rows(ops.counts, padded, sort=sort_rows)
    outs = pl.pallas_call(
        schedule_lib.over_tiles(kernel, kinds, block_rows=tb, tiles=tiles,
                                n_programs=n_programs),
        grid=(n_programs,),
        out_shape=[*h_shape, *stats, *ys],
        compiler_params=config.compiler_params,
        interpret=tile_plan.backend.interpret,
        name=KERNEL_NAME,
    )(load, store, ops.counts.reshape(batch, 1), ops.row_ids.reshape(batch, 1), *shared,
      *halting_ops, *h_leaves, *x_leaves)
    n_h = len(h_leaves)
    cut = lambda a, axis=0: a if padded == batch else lax.slice_in_dim(a, 0, batch, axis=axis)
    h = tree_util.tree_unflatten(h_tree, [cut(a) for a in outs[:n_h]])
    residual_out, steps, halted = (cut(a)[:, 0] for a in outs[n_h:n_h + 3])
    ys_out = [from_output_layout(cut(a, 1), like) for a, like in zip(outs[n_h + 3:], y_avals)]
  ys_tree = None if tile_plan.outputs is None else tree_util.tree_unflatten(y_tree, ys_out)
  return LoopOutputs(h, residual_out, steps, halted > 0, ys_tree)


def tile_count_programs(tile_plan: TilePlan, tiles: int, schedule: str | None,
                        programs: int | None) -> int:
  """The grid size of a kernel over `tiles` tiles: `tiles` for the grid
  schedule; for the persistent one `programs`, or the backend's rule
  (`Backend.persistent_programs`).

  Args:
    tile_plan: the kernel's plan (backend, configuration).
    tiles: the tile count.
    schedule: the caller's schedule (`schedule.resolve`).
    programs: the persistent grid's size, or None.

  Returns:
    The number of programs, in [1, tiles].
  """
  backend = tile_plan.backend
  rule = backend.persistent_programs
  if rule is None or schedule_lib.resolve(backend, schedule) == "grid":
    return tiles
  if programs is None:
    programs = rule(tile_plan.config, tiles)
  return max(1, min(tiles, programs))
