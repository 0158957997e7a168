"""The fused iterate kernel: one body shared by every Pallas backend.

Legend (shapes in comments):
  B: rows of the batch, padded to whole tiles    TB: rows per tile (block_rows)
  ...: a leaf's trailing (per-row) dimensions    T: a tile's largest count
  S: slots of a per-step output block (`kernel_toolkit.output_slots`)

Each program of the 1-D grid owns TB consecutive rows (already ordered by
descending count, see `tiling.py`). It loads their state, inputs and counts,
then runs the masked loop of `loop.run_loop`: at most T trips, fewer when
halting stops every row of the tile earlier. A row whose count is spent (or
that has halted) is frozen by masking. The state lives in registers/VMEM
between steps and is written once.

The shared operands (`params` and the arrays `step` closes over) are either
loaded once and held across the loop, or re-read from their refs at each use
(`jaxpr_eval.LoadOnUse`), as the backend's configuration rule decides from the
step's footprint (`kernel_toolkit.configured`, `footprint.py`,
`Backend.configure`); the step is evaluated with the backend's rewrites
(`jaxpr_eval.Rules`).

The kernel's refs are named groups (`_Ins`, `_Outs`), launched through
`kernel_toolkit.launch` on either launch path; the layouts, specs and loaders
it shares with the backward kernel are `kernel_toolkit`'s.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
from jax import lax
from jax import tree_util
import jax.numpy as jnp
import numpy as np

from pallas_loop._src.kernels import backend as backend_lib
from pallas_loop._src.step import footprint as footprint_lib
from pallas_loop._src.kernels import kernel_toolkit as toolkit
from pallas_loop._src import loop as loop_lib
from pallas_loop._src.kernels import schedule as schedule_lib
from pallas_loop._src.step import step_fn as step_fn_lib
from pallas_loop._src import tiling
from pallas_loop._src.operands import LoopOperands, LoopOutputs

KERNEL_NAME = "pallas_loop_iterate_fwd"


class _Ins(NamedTuple):
  """The kernel's input groups (refs in the body; `kernel_toolkit.launch`)."""

  counts: Any   # int32 [TB, 1]: the tile's step budgets
  rows: Any     # int32 [TB, 1]: each row's index in the caller's batch
  params: Any   # full blocks, in params' structure (0-d leaves travel as [1, 1])
  consts: Any   # list of full blocks: the step's constants
  halting: Any  # Halting of [1, 1]: tol (float32, if given), min_iters (int32); or None
  h: Any        # [TB, ...], in h0's structure: the initial state
  x: Any        # [TB, ...], in x's structure: the inputs


class _Outs(NamedTuple):
  """The kernel's output groups."""

  h: Any         # [TB, ...], in h0's structure: the final state
  residual: Any  # f32 [TB, 1]: rms of each row's last update (0 unless `residual`)
  steps: Any     # i32 [TB, 1]: steps applied
  halted: Any    # i32 [TB, 1]: 1 where a criterion stopped the row
  ys: Any        # list of [S, TB, ...]: per-step outputs (`step_outputs`),
                 # time-major: slot t holds trip t's output, 0 in the rows that
                 # did not apply it (`kernel_toolkit.output_layout`)


# How each group is launched (`kernel_toolkit.launch`, `schedule.over_tiles`).
_KINDS = (_Ins(counts=schedule_lib.ROWS_IN, rows=schedule_lib.ROWS_IN,
               params=schedule_lib.SHARED, consts=schedule_lib.SHARED,
               halting=schedule_lib.SHARED, h=schedule_lib.ROWS_IN, x=schedule_lib.ROWS_IN),
          _Outs(h=schedule_lib.ROWS_OUT, residual=schedule_lib.ROWS_OUT,
                steps=schedule_lib.ROWS_OUT, halted=schedule_lib.ROWS_OUT,
                ys=schedule_lib.ROWS_OUT_SLOTS))


def _iterate_kernel(ins: _Ins, outs: _Outs, *, spec, elems_per_row, residual):
  """The kernel body: the tile's rows from `ins` ([TB, ...] blocks and
  shared full blocks, `_Ins`) to `outs` (`_Outs`)."""
  halting = tree_util.tree_map(lambda r: r[...], ins.halting)
  params, consts = toolkit.shared_loader(
      ins.params, ins.consts, spec.param_shapes + spec.const_shapes,
      spec.config.shared_on_chip, spec.sliced)
  x = tree_util.tree_map(lambda r: r[...], ins.x)
  h = tree_util.tree_map(lambda r: r[...], ins.h)
  rules = spec.config.eval_rules
  body = lambda p, h, x, t, rows, index: spec.traced.apply(consts, p, h, x, t, rows, index,
                                                          rules=rules)
  y_refs = outs.ys
  state = loop_lib.run_loop(body, params, h, x, ins.counts[...], ins.rows[...], halting,
                           elems_per_row, residual,
                           write_output=output_writer(y_refs) if y_refs else None)
  if y_refs:
    # The slots after the tile's last trip (trips = the most steps a row of
    # the tile applied) were not written in the loop: each slot is written
    # once, there or here.
    zero_slots(y_refs, jnp.max(state.steps), spec.max_iters)
  for ref, leaf in zip(tree_util.tree_leaves(outs.h), tree_util.tree_leaves(state.h)):
    ref[...] = leaf
  outs.residual[...] = state.residual
  outs.steps[...] = state.steps
  outs.halted[...] = state.halted


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
      `LoopOutputs.ys`), or None: the kernel writes them
      (`kernel_toolkit.output_layout`).
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

  def run(self, ops: LoopOperands, *, sort_rows: bool, in_order: bool = False,
          residual: bool = True, schedule: str | None = None) -> LoopOutputs:
    """`run(self, ops, ...)`: the kernel on the rows in tiles (`in_order`:
    the rows are known in count order, so none is sorted)."""
    return run(self, ops, sort_rows=sort_rows and not in_order, residual=residual,
               schedule=schedule)

  @property
  def max_iters(self) -> int:
    """T, the per-step outputs' slots that are read (0 without outputs)."""
    leaves = tree_util.tree_leaves(self.outputs)
    return leaves[0].shape[1] if leaves else 0


# --- Per-step outputs: time-major blocks, written at the trip's slot --------


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


def plan(backend, step_fn, params, consts, h0, x, block_rows=None, outputs=None, *,
         approx_tanh: bool | None = None) -> TilePlan:
  """Traces the step at the tile shape and checks the backend's rules
  (`outputs`: the per-step outputs' [B, T, ...] avals, or None;
  `approx_tanh`: `Options.approx_tanh`, which the configuration's
  evaluation rules take: `backend.configure`)."""
  batch = tree_util.tree_leaves(h0)[0].shape[0]
  return toolkit.configured(backend, batch, block_rows, lambda tb: _plan_at(
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
                                    toolkit.shared_2d(a), toolkit.shared_2d(a), row_axis=None))
  for i, c in enumerate(traced.const_values):
    blocks.append(backend_lib.Block(f"an array step closes over (#{i})",
                                    toolkit.shared_2d(c), toolkit.shared_2d(c), row_axis=None))
  y_blocks = [toolkit.output_layout(a, tb) for a in tree_util.tree_leaves(outputs)]
  for (path, a), b in zip(tree_util.tree_flatten_with_path(outputs)[0], y_blocks):
    blocks.append(backend_lib.Block(f"per-step output y{tree_util.keystr(path)}", b.shape,
                                    toolkit.output_layout(a, padded).shape, row_axis=1))
  n_params = len(tree_util.tree_leaves(params))
  sliced, slice_eqns = backend_lib.leading_slices(
      traced.jaxpr, traced.jaxpr.invars[:n_params] + traced.jaxpr.constvars)
  typed = backend_lib.extended_dtype_problems(toolkit.named_operands(params, traced, h0, x))
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
      shared_avals=[jax.ShapeDtypeStruct(toolkit.shared_2d(a), jnp.result_type(a)) for a in shared],
      row_block_avals=row_blocks)
  config, config_problems = backend_lib.configure(backend, fp, given, state=h0,
                                                  approx_tanh=approx_tanh)
  return TilePlan(
      backend=backend, block_rows=tb, rows=padded, traced=traced,
      param_shapes=tuple(np.shape(a) for a in tree_util.tree_leaves(params)),
      const_shapes=tuple(np.shape(c) for c in traced.const_values),
      config=config, footprint=fp, problems=tuple(problems + config_problems),
      sliced=frozenset(sliced), outputs=outputs)


def run(tile_plan: TilePlan, ops: LoopOperands, *, sort_rows: bool,
        residual: bool = True, schedule: str | None = None,
        programs: int | None = None) -> LoopOutputs:
  """Runs the kernel on the rows in tiles.

  On a backend with `indexed_rows` the kernel reads and writes its rows by
  index in the caller's order (`schedule.over_tiles`, `tiling.slot_rows`);
  on the others the rows are gathered into tiles before and put back after
  (`tiling.in_tiles`). Both launch through `kernel_toolkit.launch`.

  Args:
    tile_plan: from `plan`, with no problems.
    ops: the loop's operands (consts: the caller's; the kernel takes the
      traced step's own constants from `tile_plan`).
    sort_rows: order rows by descending count before tiling.
    residual: track each row's last residual (else it is returned as 0).
    schedule: None, "grid" or "persistent" (`schedule.resolve`).
    programs: the persistent grid's size; None: the backend's rule
      (`kernel_toolkit.tile_count_programs`).
  """
  config = tile_plan.config
  assert not tile_plan.problems and config is not None, tile_plan.problems
  tb, padded = tile_plan.block_rows, tile_plan.rows
  tiles = padded // tb
  params, consts = toolkit.shared_operands(ops.params, tile_plan.traced.const_values,
                                           tile_plan.sliced)
  halting = tree_util.tree_map(lambda a: a.reshape(1, 1), ops.halting)
  kernel = functools.partial(_iterate_kernel, spec=tile_plan,
                             elems_per_row=loop_lib.elems_per_row(ops.h0), residual=residual)
  column = lambda dtype: jax.ShapeDtypeStruct((padded, 1), dtype)
  y_avals, y_tree = tree_util.tree_flatten(tile_plan.outputs)
  outs = _Outs(  # rows padded to whole tiles on both launches
      h=tree_util.tree_map(lambda a: jax.ShapeDtypeStruct((padded,) + a.shape[1:], a.dtype),
                           ops.h0),
      residual=column(jnp.float32), steps=column(jnp.int32), halted=column(jnp.int32),
      ys=[toolkit.output_layout(a, padded) for a in y_avals])  # written by the kernel

  def ins(counts, rows, h, x):
    return _Ins(counts=counts.reshape(-1, 1), rows=rows.reshape(-1, 1), params=params,
                consts=consts, halting=halting, h=h, x=x)

  launch = functools.partial(
      toolkit.launch, kernel, outs=outs, kinds=_KINDS, block_rows=tb, tiles=tiles,
      config=config, interpret=tile_plan.backend.interpret, name=KERNEL_NAME)

  def on_tiles(per_row, counts):
    h_in, x_in, index = per_row  # leaves [P, ...]; index int32 [P]
    got = launch(ins(counts, index, h_in, x_in))
    ys_out = [toolkit.from_output_layout(a, like) for a, like in zip(got.ys, y_avals)]
    return (got.h, got.residual[:, 0], got.steps[:, 0], got.halted[:, 0], ys_out), None

  batch = ops.counts.shape[0]
  if not tile_plan.backend.indexed_rows or batch == 0:
    (h, residual_out, steps, halted, ys_out), _ = tiling.in_tiles(
        on_tiles, (ops.h0, ops.x, ops.row_ids), ops.counts, rows=padded, sort=sort_rows,
        must_be_finite=False)
  else:  # rows read and written by index, in the caller's order
    load, store = tiling.slot_rows(ops.counts, padded, sort=sort_rows)
    n_programs = toolkit.tile_count_programs(tile_plan.backend, config, tiles, schedule,
                                             programs)
    got = launch(ins(ops.counts, ops.row_ids, ops.h0, ops.x),
                 by_index=toolkit.ByIndex(load, store, n_programs))
    cut = lambda a, axis=0: a if padded == batch else lax.slice_in_dim(a, 0, batch, axis=axis)
    h = tree_util.tree_map(cut, got.h)
    residual_out, steps, halted = (cut(a)[:, 0] for a in (got.residual, got.steps, got.halted))
    ys_out = [toolkit.from_output_layout(cut(a, 1), like) for a, like in zip(got.ys, y_avals)]
  ys_tree = None if tile_plan.outputs is None else tree_util.tree_unflatten(y_tree, ys_out)
  return LoopOutputs(h, residual_out, steps, halted > 0, ys_tree)
