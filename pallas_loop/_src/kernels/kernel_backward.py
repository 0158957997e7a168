"""The fused backward kernel: the checkpointed window VJP, one row tile per program.

Legend (shapes in comments):
  P: rows, ordered by descending window length and padded to whole tiles
  TB: rows per tile       ...: a leaf's trailing (per-row) dimensions
  S: checkpoint slots     C: states per recomputed segment (both powers of 2)
  NT: tiles (P / TB)

Each program runs `loop_reverse.reverse_window` (the same function the XLA path
runs on the whole batch) on its TB rows: the window forward saving a state
every C steps, then each segment recomputed and reversed with `jax.vjp` of
the step traced inside the kernel. Its buffers are Pallas refs
(`RefBuffer`): the checkpoint and segment states are outputs of the call
that nobody reads afterwards, [S, P, ...] and [C, P, ...] in HBM (on TPU a
tile's blocks live in VMEM), so the kernel needs no scratch-memory feature
that only one backend has. Gradients of the shared operands are summed per
tile in float32 into [NT, ...] outputs and added up outside, in a fixed
order (deterministic); input gradients are per row.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
from jax import tree_util
import jax.numpy as jnp
import numpy as np

from pallas_loop._src.kernels import backend as backend_lib
from pallas_loop._src.step import footprint as footprint_lib
from pallas_loop._src.step import jaxpr_eval
from pallas_loop._src.kernels import kernel_forward as kernel
from pallas_loop._src.kernels import kernel_toolkit as toolkit
from pallas_loop._src import loop_reverse
from pallas_loop._src.kernels import schedule as schedule_lib
from pallas_loop._src.step import step_fn as step_fn_lib
from pallas_loop._src import tiling
from pallas_loop._src.operands import Gradients, WindowOperands

KERNEL_NAME = "pallas_loop_iterate_bwd"


class RefBuffer:
  """States in refs [slots, TB, ...] (one per state leaf), indexed by slot.

  A pytree without leaves, so loops may carry it: writes are side effects.
  """

  def __init__(self, refs, treedef):
    self.refs, self.treedef = refs, treedef

  def read(self, k):
    return tree_util.tree_unflatten(self.treedef, [r[k] for r in self.refs])

  def write(self, k, value) -> RefBuffer:
    for r, v in zip(self.refs, tree_util.tree_leaves(value)):
      r[k] = v.astype(r.dtype)
    return self


class RefSum:
  """float32 sums in refs, one per leaf of the summed pytree (None: skipped)."""

  def __init__(self, refs):
    self.refs = refs

  def sinks(self, offset: int = 0) -> dict:
    """{flat output index: add(value)} for `jaxpr_eval.call_with_matched_dots`."""
    def add(r):
      def sink(v):
        r[...] += v.astype(jnp.float32).reshape(r.shape)
      return sink
    return {offset + i: add(r) for i, r in enumerate(self.refs) if r is not None}


tree_util.register_pytree_node(RefBuffer, lambda s: ((), s), lambda s, _: s)
tree_util.register_pytree_node(RefSum, lambda s: ((), s), lambda s, _: s)


def float_vjp(step, shared, h, x, t, rows, index, ct, ct_y, acc_shared: RefSum, acc_x: RefSum, *,
              rules: jaxpr_eval.Rules, plain_step, shared_float):
  """The step's VJP w.r.t. the float leaves only, with single-dtype dots
  (`jaxpr_eval.py`: Triton rejects mixed-dtype dots), each shared-operand and
  input gradient added to its ref where it is computed.

  Adding each gradient as soon as it exists, rather than after the whole VJP,
  keeps one [D, D] float32 weight gradient live at a time instead of all of
  them.

  The VJP is traced from `plain_step` (the step evaluated as traced) and
  the backend's rewrites (`rules`) are applied to the VJP's jaxpr: some of
  them are exact but not differentiable (an integer-mask select would give
  zero gradients), so they must not be differentiated.

  Args:
    shared_float: per shared leaf, whether it gets a gradient (the float
      params and the float constants that stand for a caller's; a constant
      made inside the step gets none and is not differentiated).

  Returns:
    (d_h, acc_shared, acc_x) as `loop_reverse.step_vjp`.
  """
  del step  # the kernel's evaluation of it: `plain_step` is differentiated
  # Operands without a gradient (integer key data, constants made inside the
  # step) are closed over by the traced VJP: load them.
  shared_leaves, shared_tree = tree_util.tree_flatten(shared)
  shared = tree_util.tree_unflatten(shared_tree, [
      a.load() if isinstance(a, jaxpr_eval.LoadOnUse) and not f else a
      for a, f in zip(shared_leaves, shared_float)])
  x = tree_util.tree_map(
      lambda a: a.load() if isinstance(a, jaxpr_eval.LoadOnUse) and not loop_reverse.is_float(a)
      else a, x)
  # Outputs of the VJP, one per wanted float leaf of (shared, h, x): the
  # shared and input gradients go to their refs, the state's come back.
  x_refs = [r for r, a in zip(acc_x.refs, tree_util.tree_leaves(x)) if loop_reverse.is_float(a)]
  n_h = len(loop_reverse.float_leaves(h))
  sinks = RefSum([r for r, f in zip(acc_shared.refs, shared_float) if f] + [None] * n_h
                 + x_refs).sinks()
  evaluate = lambda vjp_fn, floats, ct_: jaxpr_eval.call_with_matched_dots(
      vjp_fn, floats, ct_, sinks=sinks, rules=rules)
  n_x = len(tree_util.tree_leaves(x))
  _, d_h, _ = loop_reverse.vjp_of_floats(
      lambda s_, h_, x_: plain_step(s_, h_, x_, t, rows, index), (shared, h, x),
      loop_reverse.float_leaves(ct) + loop_reverse.float_leaves(ct_y), evaluate=evaluate,
      wanted=list(shared_float) + [True] * (len(tree_util.tree_leaves(h)) + n_x))
  return loop_reverse.with_integer_zeros(d_h, h), acc_shared, acc_x


class _Ins(NamedTuple):
  """The kernel's input groups (refs in the body; `kernel_toolkit.launch`)."""

  n: Any        # int32 [TB, 1]: window length per row
  t0: Any       # int32 [TB, 1]: first step index per row
  rows: Any     # int32 [TB, 1]: each row's index in the caller's batch
  params: Any   # full blocks, in params' structure
  consts: Any   # list of full blocks: the step's constants
  h: Any        # [TB, ...], in h's structure: the state at the window's start
  x: Any        # [TB, ...], in x's structure: inputs
  g: Any        # [TB, ...], in h's structure: cotangent of the state after the window
  g_ys: Any     # list of [S, TB, ...]: cotangents of the per-step outputs (float
                # leaves only; `kernel_toolkit.output_layout`), read at the
                # window step's slot


class _Outs(NamedTuple):
  """The kernel's output groups."""

  g_h: Any       # [TB, ...], in h's structure: cotangent of the state at the window's start
  g_x: Any       # list per x leaf: f32 [TB, ...] input gradient (None: not a float leaf)
  g_shared: Any  # list per shared operand (params leaves, then constants): f32 [1, ...],
                 # this tile's gradient (None: not a float leaf)
  ckpt: Any      # list per h leaf: [S, TB, ...] checkpoints (scratch)
  seg: Any       # list per h leaf: [C, TB, ...] a segment's states (scratch)


# How each group is launched (`kernel_toolkit.launch`, `schedule.over_tiles`):
# the padding positions read a window length of 0 (no step: no gradient).
_KINDS = (_Ins(n=schedule_lib.ROWS_PADDED_IN, t0=schedule_lib.ROWS_IN, rows=schedule_lib.ROWS_IN,
               params=schedule_lib.SHARED, consts=schedule_lib.SHARED,
               h=schedule_lib.ROWS_IN, x=schedule_lib.ROWS_IN, g=schedule_lib.ROWS_IN,
               g_ys=schedule_lib.ROWS_IN_SLOTS),
          _Outs(g_h=schedule_lib.ROWS_OUT, g_x=schedule_lib.ROWS_OUT,
                g_shared=schedule_lib.TILE, ckpt=schedule_lib.SLOTS, seg=schedule_lib.SLOTS))


def _window_kernel(ins: _Ins, outs: _Outs, *, wp, every):
  """The kernel body: the tile's window VJP from `ins` ([TB, ...] blocks
  and shared full blocks, `_Ins`) to `outs` (`_Outs`)."""
  h_tree = tree_util.tree_structure(ins.h)
  for r in outs.g_x + outs.g_shared:
    if r is not None:
      r[...] = jnp.zeros(r.shape, r.dtype)
  shared = toolkit.shared_loader(ins.params, ins.consts, wp.shared_shapes,
                                 wp.config.shared_on_chip)
  x = tree_util.tree_map(lambda r: r[...], ins.x)
  h = tree_util.tree_map(lambda r: r[...], ins.h)
  g = tree_util.tree_map(lambda r: r[...], ins.g)

  def step(shared, h, x, t, rows, index, rules=wp.config.eval_rules):
    params, consts = shared
    return wp.tile.traced.apply(consts, params, h, x, t, rows, index, rules=rules)[:2]

  g_h, _, _ = loop_reverse.reverse_window(
      step, shared, h, x, ins.t0[...], ins.n[...], ins.rows[...], g, every=every,
      ckpt=RefBuffer(outs.ckpt, h_tree), seg=RefBuffer(outs.seg, h_tree),
      acc_shared=RefSum(outs.g_shared), acc_x=RefSum(outs.g_x),
      vjp=functools.partial(float_vjp, rules=wp.config.eval_rules,
                            plain_step=functools.partial(step, rules=None),
                            shared_float=wp.shared_float),
      aligned=wp.aligned,
      g_ys_at=None if wp.outputs is None else functools.partial(_output_cotangents, ins.g_ys, wp))
  for r, leaf in zip(tree_util.tree_leaves(outs.g_h), tree_util.tree_leaves(g_h)):
    r[...] = leaf.astype(r.dtype)


def _output_cotangents(refs, wp, index):
  """The cotangents of step `index`'s outputs ([TB, ...] leaves, None at
  the non-float ones), read from their refs at slot `index`."""
  leaves, tree = tree_util.tree_flatten(wp.outputs)
  it = iter(refs)
  tb = wp.tile.block_rows
  return tree_util.tree_unflatten(tree, [
      next(it)[index].reshape((tb,) + tuple(a.shape[2:])) if f else None
      for a, f in zip(leaves, wp.y_float)])


@dataclasses.dataclass(frozen=True)
class WindowPlan:
  """The backward kernel on one backend, or why it cannot run.

  Attributes:
    tile: the forward's `kernel.TilePlan` at this kernel's tile height
      (rows, traced step, backend, the step operands' block rules).
    config: the backend's configuration of this kernel (None: none fits).
    footprint: what one program holds on chip (the step and its VJP).
    every: checkpoint interval C; slots: (S, C) buffer sizes (powers of 2).
    shared_shapes: true shapes of params leaves then the traced constants.
    shared_float/x_float: which of those (and of x's leaves) get gradients.
    problems: violated backend rules; empty when the kernel can run.
    aligned: the rows' windows run on one clock (`loop_reverse.reverse_window`),
      for a step that takes its scalar step index or has per-step outputs.
    outputs: the per-step outputs' [B, T, ...] avals (their cotangents are
      read, `y_float` says which leaves have one), or None.
  """

  tile: kernel.TilePlan
  config: backend_lib.KernelConfig | None
  footprint: footprint_lib.Footprint | None
  every: int
  slots: tuple[int, int]
  shared_shapes: tuple
  shared_float: tuple[bool, ...]
  x_float: tuple[bool, ...]
  problems: tuple[str, ...]
  aligned: bool = False
  outputs: Any = None
  y_float: tuple[bool, ...] = ()

  def run(self, ops: WindowOperands, *, sort_rows: bool, in_order: bool = False,
          schedule: str | None = None) -> Gradients:
    """`run` with this plan (the interface the TPU's group backward shares;
    `in_order`: the windows are known in length order, so no row is sorted)."""
    return run(self, ops, sort_rows=sort_rows and not in_order, schedule=schedule)


def plan(backend, step_fn, params, consts, h, x, *, block_rows, bound: int,
         every: int | None, outputs=None, approx_tanh: bool | None = None) -> WindowPlan:
  """Plans the backward kernel: the forward's tile plan (`kernel.plan`: tile
  shape, traced step, block rules of the step's operands) plus the VJP's needs.

  Args:
    backend: the Pallas backend.
    step_fn, params, consts, h, x: as for the forward.
    block_rows: rows per tile or None.
    bound: static bound on the window length; every: checkpoint interval.
    outputs: the per-step outputs' [B, T, ...] avals, or None.
    approx_tanh: `Options.approx_tanh` (the configuration's evaluation rules
      take it: `backend.configure`).
  """
  every = every or loop_reverse.default_every(bound)
  batch = tree_util.tree_leaves(h)[0].shape[0]
  return toolkit.configured(backend, batch, block_rows, lambda tb: _plan_at(
      backend, step_fn, params, consts, h, x, tb, given=block_rows is not None,
      bound=bound, every=every, outputs=outputs, approx_tanh=approx_tanh))


class VjpParts(NamedTuple):
  """What any backward kernel over rows needs of the step's VJP at `tb` rows
  (`vjp_parts`): the kernel layouts decide the rest."""

  tile: kernel.TilePlan   # the forward's plan at tb rows (traced step, problems)
  slots: tuple[int, int]  # (S, C) buffer sizes (powers of 2)
  shared: list            # the shared operands: params leaves, then traced constants
  shared_float: tuple[bool, ...]
  y_float: tuple[bool, ...]
  jaxpr: Any              # the VJP of one step, traced at tb rows
  step_problems: list     # the VJP's against the backend's step rules


def vjp_parts(backend, step_fn, params, consts, h, x, tb, *, bound, every, outputs=None,
              approx_tanh=None) -> VjpParts | WindowPlan:
  """The step's VJP at `tb` rows, traced and checked against the backend's
  step rules; a `WindowPlan` with no configuration where the forward's plan
  declined before measuring."""
  tile = kernel.plan(backend, step_fn, params, consts, h, x, tb, approx_tanh=approx_tanh)
  if tile.config is None and tile.footprint is None:  # declined before measuring
    return WindowPlan(tile=tile, config=None, footprint=None, every=every, slots=(0, 0),
                      shared_shapes=(), shared_float=(), x_float=(), problems=tile.problems)
  slots = (backend_lib.next_power_of_2(loop_reverse.checkpoint_slots(bound, every)),
           backend_lib.next_power_of_2(every))
  shared = list(tree_util.tree_leaves(params)) + list(tile.traced.const_values)
  y_float = tuple(loop_reverse.is_float(a) for a in tree_util.tree_leaves(outputs))
  # The outputs' cotangents at one step, [TB, ...] (None: no outputs).
  g_y = tree_util.tree_map(lambda a: jax.ShapeDtypeStruct((tb,) + a.shape[2:], a.dtype),
                           outputs)

  # A constant made inside the step (no caller's const behind it, `sources`)
  # gets no gradient: differentiating it would only be thrown away (and
  # Mosaic cannot sum a bfloat16 scalar's: `x / jnp.sqrt(d).astype(x.dtype)`).
  n_params = len(tree_util.tree_leaves(params))
  shared_float = tuple(loop_reverse.is_float(a) and (i < n_params
                                                     or tile.traced.sources[i - n_params] is not None)
                       for i, a in enumerate(shared))

  def vjp_of_step(shared, h, x, t, rows, index, g, g_y):
    f = lambda s_, h_, x_: tile.traced.apply(s_[1], s_[0], h_, x_, t, rows, index)[:2]
    wanted = list(shared_float) + [True] * len(tree_util.tree_leaves((h, x)))
    return loop_reverse.vjp_of_floats(
        f, (shared, h, x), loop_reverse.float_leaves(g) + loop_reverse.float_leaves(g_y),
        wanted=wanted)

  avals = functools.partial(step_fn_lib.avals, rows=tb)
  jaxpr = jax.make_jaxpr(vjp_of_step)(
      (params, list(tile.traced.const_values)), avals(h), avals(x),
      *step_fn_lib.row_index_avals(avals(h)), avals(h), g_y).jaxpr
  return VjpParts(tile=tile, slots=slots, shared=shared, shared_float=shared_float,
                  y_float=y_float, jaxpr=jaxpr,
                  step_problems=backend_lib.step_problems(backend, jaxpr))


def _plan_at(backend, step_fn, params, consts, h, x, tb, *, given, bound, every, outputs=None,
             approx_tanh=None):
  parts = vjp_parts(backend, step_fn, params, consts, h, x, tb, bound=bound, every=every,
                    outputs=outputs, approx_tanh=approx_tanh)
  if isinstance(parts, WindowPlan):
    return parts
  tile, slots, shared = parts.tile, parts.slots, parts.shared
  padded = tile.rows
  blocks = []
  for name, size in zip(("checkpoints", "segment states"), slots):
    for path, a in tree_util.tree_flatten_with_path(h)[0]:
      blocks.append(backend_lib.Block(
          f"{name} of h{tree_util.keystr(path)}", (size, tb) + a.shape[1:],
          (size, padded) + a.shape[1:], row_axis=1))
  for i, a in enumerate(shared):
    blocks.append(backend_lib.Block(f"per-tile gradient #{i}", (1,) + toolkit.shared_2d(a),
                                    (padded // tb,) + toolkit.shared_2d(a), row_axis=None))
  g_ys_blocks = []
  for (path, a), f in zip(tree_util.tree_flatten_with_path(outputs)[0], parts.y_float):
    if f:
      g_ys_blocks.append(toolkit.output_layout(a, tb))
      blocks.append(backend_lib.Block(
          f"cotangent of the per-step output y{tree_util.keystr(path)}",
          g_ys_blocks[-1].shape, toolkit.output_layout(a, padded).shape, row_axis=1))
  problems = list(tile.problems) + backend.block_problems(blocks) + parts.step_problems
  shared_avals = [jax.ShapeDtypeStruct(toolkit.shared_2d(a), jnp.result_type(a)) for a in shared]
  avals = functools.partial(step_fn_lib.avals, rows=tb)
  column = jax.ShapeDtypeStruct((tb, 1), np.int32)
  h_tiles, x_tiles = tree_util.tree_leaves(avals(h)), tree_util.tree_leaves(avals(x))
  h_tiles_batch = tree_util.tree_leaves(h)[0].shape[0]
  # Row blocks: h, x, g in; g_h, g_x out; 3 int columns; the checkpoint and
  # segment buffers; a float32 per-tile gradient per shared operand.
  row_blocks = (3 * h_tiles + x_tiles + h_tiles
                + [jax.ShapeDtypeStruct(a.shape, jnp.float32) for a in x_tiles]
                + [column] * 3
                + [jax.ShapeDtypeStruct((size,) + a.shape, a.dtype)
                   for size in slots for a in h_tiles]
                + [jax.ShapeDtypeStruct(a.shape, jnp.float32) for a in shared_avals]
                + g_ys_blocks)
  fp = footprint_lib.measure([(parts.jaxpr, len(shared))], batch=h_tiles_batch, block_rows=tb,
                             shared_avals=shared_avals, row_block_avals=row_blocks)
  config, config_problems = backend_lib.configure(backend, fp, given, state=h,
                                                  approx_tanh=approx_tanh)
  return WindowPlan(
      tile=tile, config=config, footprint=fp, every=every, slots=slots,
      shared_shapes=tuple(np.shape(a) for a in shared),
      shared_float=parts.shared_float,
      x_float=tuple(loop_reverse.is_float(a) for a in tree_util.tree_leaves(x)),
      problems=tuple(dict.fromkeys(problems + config_problems)),
      aligned=step_fn.indexed or step_fn.outputs, outputs=outputs, y_float=parts.y_float)


def run(wp: WindowPlan, ops: WindowOperands, *, sort_rows: bool, schedule: str | None = None,
        programs: int | None = None) -> Gradients:
  """Runs the backward kernel on the rows in tiles: read and written by index
  on a backend with `indexed_rows` (`schedule.over_tiles`), else gathered
  into tiles before and put back after (`tiling.in_tiles`), as the forward
  (`kernel.run`); both launch through `kernel_toolkit.launch`.

  Args:
    wp: from `plan`, with no problems.
    ops: the window (consts: the caller's, in `step_fn.StepFn` order).
    sort_rows: order rows by descending window length before tiling.
    schedule: None, "grid" or "persistent" (`schedule.resolve`).
    programs: the persistent grid's size; None: the backend's rule.

  Returns:
    (g_params, g_consts, g_h_start, g_x), in the operands' dtypes (None for
    integer leaves).
  """
  config = wp.config
  assert not wp.problems and config is not None, wp.problems
  tile = wp.tile
  tb, padded = tile.block_rows, tile.rows
  n_tiles = padded // tb
  x_leaves = tree_util.tree_leaves(ops.x)
  params, consts = toolkit.shared_operands(ops.params, tile.traced.const_values)
  shared = tree_util.tree_leaves(params) + consts
  struct = jax.ShapeDtypeStruct
  rows_like = lambda a, dtype=None: struct((padded,) + a.shape[1:], dtype or a.dtype)
  h_leaves = tree_util.tree_leaves(ops.h_start)
  outs = _Outs(  # rows padded to whole tiles on both launches
      g_h=tree_util.tree_map(rows_like, ops.h_start),
      g_x=[rows_like(a, jnp.float32) if f else None for a, f in zip(x_leaves, wp.x_float)],
      g_shared=[struct((n_tiles,) + a.shape, jnp.float32) if f else None
                for a, f in zip(shared, wp.shared_float)],
      ckpt=[struct((wp.slots[0], padded) + a.shape[1:], a.dtype) for a in h_leaves],
      seg=[struct((wp.slots[1], padded) + a.shape[1:], a.dtype) for a in h_leaves])

  def ins(n, t0, rows, h, x, g, g_ys):  # g_ys: in the kernels' layout
    return _Ins(n=n.reshape(-1, 1), t0=t0.reshape(-1, 1), rows=rows.reshape(-1, 1),
                params=params, consts=consts, h=h, x=x, g=g, g_ys=g_ys)

  launch = functools.partial(
      toolkit.launch,
      functools.partial(_window_kernel, wp=wp, every=wp.every), outs=outs, kinds=_KINDS,
      block_rows=tb, tiles=n_tiles, config=config, interpret=tile.backend.interpret,
      name=KERNEL_NAME)

  def on_tiles(per_row, n):
    h_in, x_in, g_in, t0, index, g_ys_in = per_row
    got = launch(ins(n, t0, index, h_in, x_in, g_in,
                     [toolkit.to_output_layout(a) for a in g_ys_in]))
    return (tree_util.tree_leaves(got.g_h), got.g_x), got.g_shared

  g_ys_in = [a for a, f in zip(tree_util.tree_leaves(ops.g_ys), wp.y_float) if f]
  batch = ops.n.shape[0]
  if not tile.backend.indexed_rows or batch == 0:
    (g_h, g_x), tile_sums = tiling.in_tiles(
        on_tiles, (ops.h_start, ops.x, ops.g, ops.t0, ops.row_ids, g_ys_in),
        ops.n, rows=padded,
        sort=sort_rows, must_be_finite=True)
  else:  # rows read and written by index, in the caller's order
    g_ys = [toolkit.to_output_layout(a) for a in g_ys_in]
    # The padding positions read a window length of 0 (no step: no gradient).
    n_col = jnp.pad(ops.n, (0, padded - batch)).reshape(padded, 1)
    operands = ins(n_col, ops.t0, ops.row_ids, ops.h_start, ops.x, ops.g, g_ys)
    n_programs = toolkit.tile_count_programs(tile.backend, config, n_tiles, schedule, programs)
    load, store = tiling.slot_rows(ops.n, padded, sort=sort_rows)
    got = launch(operands, by_index=toolkit.ByIndex(load, store, n_programs))
    cut = lambda a: a if padded == batch else a[:batch]
    g_h = [cut(a) for a in tree_util.tree_leaves(got.g_h)]
    g_x = [None if a is None else cut(a) for a in got.g_x]
    tile_sums = got.g_shared
  return assemble(ops, tile_sums, g_h, g_x, shared_shapes=wp.shared_shapes,
                  sources=tile.traced.sources)


def assemble(ops: WindowOperands, tile_sums, g_h, g_x, *, shared_shapes, sources) -> Gradients:
  """The gradients from a backward kernel's outputs, in the operands' dtypes.

  Args:
    ops: the window the kernel differentiated.
    tile_sums: per shared operand (params leaves, then the traced step's
      constants), float32 [programs, ...] per-program sums, or None (no gradient).
    g_h: the state's cotangent at the window's start, a list per h leaf [B, ...].
    g_x: per x leaf, float32 [B, ...] or None (not a float leaf).
    shared_shapes: the shared operands' true shapes.
    sources: per traced constant, the caller's const it stands for (or None).

  Returns:
    (g_params, g_consts, g_h_start, g_x), None for integer leaves.
  """
  params_leaves, params_tree = tree_util.tree_flatten(ops.params)
  x_leaves, x_tree = tree_util.tree_flatten(ops.x)
  g_x = loop_reverse.cast_like(g_x, x_leaves)
  # Per-program sums -> gradients of params, and of the caller's consts (a
  # traced constant stands for the caller's const `sources[j]`, or for a
  # constant made inside step, which gets none). Summed outside the kernel,
  # in a fixed order: deterministic.
  sums = [None if s is None else jnp.sum(s, axis=0).reshape(shape)
          for s, shape in zip(tile_sums, shared_shapes)]
  n_params = len(params_leaves)
  g_params = loop_reverse.cast_like(sums[:n_params], params_leaves)
  g_consts = [loop_reverse.float32_zeros(c) for c in ops.consts]
  for s, source in zip(sums[n_params:], sources):
    if s is not None and source is not None:
      g_consts[source] = g_consts[source] + s
  g_consts = loop_reverse.cast_like(g_consts, list(ops.consts))
  return (tree_util.tree_unflatten(params_tree, g_params), g_consts,
          tree_util.tree_unflatten(tree_util.tree_structure(ops.h_start), g_h),
          tree_util.tree_unflatten(x_tree, g_x))
