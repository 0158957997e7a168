"""What the Pallas kernels share: operand layouts, specs, named refs, the launch.

Legend (shapes in comments):
  P: rows, padded to whole tiles    TB: rows per tile (block_rows)
  S: slots of a per-step block      NT: tiles (P / TB)
  ...: a leaf's trailing (per-row) dimensions

The tile kernels (`kernel_forward.py`, `kernel_backward.py`) and the TPU's
group kernel (`kernel_tpu_groups.py`) are clients of this module:

  * Layouts. The shared operands (params leaves, then the step's constants)
    travel at least 2-D (`shared_2d`, `shared_operands`) and are seen by the
    step loaded once or read on use (`shared_loader`); per-step outputs and
    their cotangents travel time-major (`output_layout`).
  * Named refs. A kernel's operands are named groups (a NamedTuple per
    kernel: counts, params, h, x, ...), each a pytree. The launch site
    flattens them once and the kernel body gets them back unflattened with
    the same treedef (`unflattened`), so the order of the refs is the
    pytree's, never counted by hand. Each group has a kind (`schedule.SHARED`,
    `schedule.ROWS_IN`, ...), given as a pytree prefix of the operands
    (`leaf_kinds`).
  * The launch. `launch` builds the `pallas_call` of a tile kernel from its
    named operands and their kinds, on either launch path: one program per
    tile with a `BlockSpec` per operand (`block_spec`), or rows read and
    written by index over whole arrays (`ByIndex`, `schedule.over_tiles`).
    The group kernel keeps its own `pallas_call`: its grid takes two
    scalar-prefetched tables and scratch in SMEM (`PrefetchScalarGridSpec`),
    which the tile kernels' launch has no use for.
  * Planning. `configured` chooses the tile height (a default halved while
    no configuration fits), `tile_count_programs` the grid of the persistent
    schedule, `named_operands` names the operands in messages.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
from jax import tree_util
from jax.experimental import pallas as pl
import jax.numpy as jnp
import numpy as np

from pallas_loop._src.kernels import backend as backend_lib
from pallas_loop._src.step import jaxpr_eval
from pallas_loop._src.kernels import schedule as schedule_lib


# --- Shared operands: at least 2-D, loaded once or read on use --------------


def shared_2d(a) -> tuple[int, ...]:
  """The shape a shared operand travels in: at least 2-D ([1, 1] for 0-d,
  [1, N] for 1-D), so that its per-tile gradient block [1, ...] keeps the
  operand's last two dimensions whole, as Mosaic requires."""
  shape = tuple(np.shape(a))
  return (1,) * (2 - len(shape)) + shape if len(shape) < 2 else shape


def shared_operands(params, const_values, sliced: frozenset[int] = frozenset()) -> tuple[Any, list]:
  """(params, consts) as the kernels take them: each leaf reshaped by `shared_2d`.

  A 2-D operand the step reads one leading slice at a time (`sliced`:
  positions among params leaves then constants; `params[index]` of stacked
  [T, N] weights) travels as [T, 1, N]: its step axis is then a leading
  axis, which Mosaic indexes dynamically, not the sublane axis, whose
  dynamic offsets it must prove multiples of 8.

  Args:
    params: the params pytree.
    const_values: the traced step's constants.
    sliced: positions read one leading slice at a time.

  Returns:
    (params reshaped, in its structure; the constants reshaped, a list).
  """
  leaves, tree = tree_util.tree_flatten(params)

  def shaped(i, a):
    if i in sliced and np.ndim(a) == 2:
      return jnp.reshape(a, (np.shape(a)[0], 1, np.shape(a)[1]))
    return jnp.reshape(a, shared_2d(a))
  shared = [shaped(i, a) for i, a in enumerate(leaves + list(const_values))]
  return tree_util.tree_unflatten(tree, shared[:len(leaves)]), shared[len(leaves):]


def shared_loader(params_refs, const_refs, shapes, on_chip: bool,
                  sliced: frozenset[int] = frozenset()) -> tuple[Any, list]:
  """The shared operands as the step sees them inside a kernel.

  `on_chip`: loaded now, once (held across the loop); else a
  `jaxpr_eval.LoadOnUse` per operand, read where each use needs it. The
  operands in `sliced` (positions: stacked per-step weights the step reads
  as `params[index]`, `backend.leading_slices`) are always read on use, one
  step's slice at a time.

  Args:
    params_refs: the params' refs, in params' structure.
    const_refs: the constants' refs.
    shapes: true shapes of params leaves, then of the constants.
    on_chip: load once (else read on use).
    sliced: positions read one leading slice at a time.

  Returns:
    (params, consts) as values or `LoadOnUse`s, in their structures.
  """
  leaves, tree = tree_util.tree_flatten(params_refs)
  loaded = [jaxpr_eval.LoadOnUse(r, s) if i in sliced or not on_chip else r[...].reshape(s)
            for i, (r, s) in enumerate(zip(leaves + list(const_refs), shapes))]
  return tree_util.tree_unflatten(tree, loaded[:len(leaves)]), loaded[len(leaves):]


def named_operands(params, traced, h0, x) -> list[tuple[str, Any]]:
  """The kernel's operands with names for messages: params leaves, the
  step's constants, h0 and x leaves."""
  named = [(f"{name}{tree_util.keystr(path)}", a)
           for name, tree in (("params", params), ("h0", h0), ("x", x))
           for path, a in tree_util.tree_flatten_with_path(tree)[0]]
  return named + [(f"the array #{i} that step closes over", c)
                  for i, c in enumerate(traced.const_values)]


# --- Per-step outputs: time-major blocks, a slot per trip --------------------


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


# --- Specs of the blocked launch, by operand kind -----------------------------


def row_spec(a, block_rows: int) -> pl.BlockSpec:
  """Tiles of `block_rows` rows of an operand [P, ...], one per program."""
  trailing = (0,) * (len(a.shape) - 1)
  return pl.BlockSpec((block_rows,) + tuple(a.shape[1:]), lambda i: (i,) + trailing)


def full_spec(a) -> pl.BlockSpec:
  """The whole operand in every program."""
  return pl.BlockSpec(a.shape, lambda i: (0,) * len(a.shape))


def slot_spec(a, block_rows: int) -> pl.BlockSpec:
  """Blocks [S, block_rows, ...] of an [S, P, ...] operand, one per program."""
  return pl.BlockSpec((a.shape[0], block_rows) + tuple(a.shape[2:]),
                      lambda i: (0, i) + (0,) * (len(a.shape) - 2))


def block_spec(kind: str, a, block_rows: int) -> pl.BlockSpec:
  """The block of an operand of kind `kind` (`schedule.SHARED`, ...) that
  program i of a one-program-per-tile grid sees: the same rows, slots or
  tile `schedule.over_tiles` gives the body on the indexed launch.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> block_spec(schedule_lib.TILE, jax.ShapeDtypeStruct((4, 8, 128), jnp.float32),
    ...            16).block_shape
    (1, 8, 128)
  """
  if kind == schedule_lib.SHARED:
    return full_spec(a)
  if kind in (schedule_lib.ROWS_IN, schedule_lib.ROWS_OUT, schedule_lib.ROWS_PADDED_IN):
    return row_spec(a, block_rows)
  if kind in (schedule_lib.ROWS_IN_SLOTS, schedule_lib.ROWS_OUT_SLOTS, schedule_lib.SLOTS):
    return slot_spec(a, block_rows)
  if kind == schedule_lib.TILE:
    return row_spec(a, 1)
  raise ValueError(f"unknown operand kind {kind!r}")


# --- Named refs: operand groups flattened once, unflattened in the body ------


def leaf_kinds(kinds, operands) -> list[str]:
  """The kind of each leaf of `operands`, in their flattened order.

  Args:
    kinds: a pytree prefix of `operands` with a kind at each leaf (e.g. the
      kernel's NamedTuple of groups with a kind per group).
    operands: the operand groups (arrays, avals or refs as leaves).

  Example:
    >>> from typing import NamedTuple
    >>> class Ins(NamedTuple):
    ...   w: object
    ...   h: object
    >>> leaf_kinds(Ins(w="shared", h="rows_in"), Ins(w=None, h=(1, [2, 3])))
    ['rows_in', 'rows_in', 'rows_in']
  """
  per_group = tree_util.tree_map(
      lambda kind, group: [kind] * len(tree_util.tree_leaves(group)), kinds, operands)
  return tree_util.tree_leaves(per_group)


def unflattened(body: Callable[..., None], *trees, leading: int = 0) -> Callable[..., None]:
  """A kernel over flat refs that calls `body` with them as named groups.

  Args:
    body: body(*leading refs, *one pytree of refs per tree).
    trees: the treedefs the launch site flattened its operands with, in
      the order of the refs (e.g. inputs, outputs, scratch).
    leading: refs before the groups passed as they are (scalar-prefetched
      tables).

  Returns:
    kernel(*refs).
  """
  sizes = [t.num_leaves for t in trees]

  def kernel(*refs):
    assert len(refs) == leading + sum(sizes), (len(refs), leading, sizes)
    groups, at = [], leading
    for tree, size in zip(trees, sizes):
      groups.append(tree_util.tree_unflatten(tree, refs[at:at + size]))
      at += size
    body(*refs[:leading], *groups)

  # Debug info (the kernel's source in errors and locations) names `body`.
  return functools.update_wrapper(kernel, body)


# --- The launch of a tile kernel ----------------------------------------------


class ByIndex(NamedTuple):
  """The indexed launch (`Backend.indexed_rows`): per-row operands whole in
  the caller's order, each program reading and writing its tiles' rows by
  index (`schedule.over_tiles`)."""

  load: jax.Array   # int32 [P]: the row each sorted position reads (`tiling.slot_rows`)
  store: jax.Array  # int32 [P]: the row each sorted position writes
  programs: int     # the grid's size (`tile_count_programs`)


def launch(body: Callable[..., None], ins, outs, kinds, *, block_rows: int, tiles: int,
           config: backend_lib.KernelConfig, interpret: Any, name: str,
           by_index: ByIndex | None = None) -> Any:
  """Runs a tile kernel: the one `pallas_call` of both launch paths.

  Args:
    body: body(ins, outs): the per-tile kernel body, called with `ins` and
      `outs` as pytrees of refs ([TB, ...] row blocks, whole shared operands).
    ins: the input groups (a NamedTuple of pytrees of arrays).
    outs: the output groups (a NamedTuple of pytrees of `ShapeDtypeStruct`s;
      None where a group has nothing).
    kinds: (input kinds, output kinds), each a pytree prefix of `ins` /
      `outs` with a kind (`schedule.SHARED`, ...) per group.
    block_rows: TB.
    tiles: NT.
    config: the backend's configuration (its compiler params).
    interpret: `pallas_call(interpret=)`, the backend's.
    name: the kernel's name (HLO tests look for it).
    by_index: the indexed launch; None: one program per tile, each seeing
      its blocks (`block_spec`).

  Returns:
    The outputs, as `outs` (arrays [P, ...], [S, P, ...], [NT, ...]).
  """
  in_leaves, in_tree = tree_util.tree_flatten(ins)
  out_leaves, out_tree = tree_util.tree_flatten(outs)
  in_kinds, out_kinds = leaf_kinds(kinds[0], ins), leaf_kinds(kinds[1], outs)
  kernel = unflattened(body, in_tree, out_tree)
  specs: dict[str, Any] = {}  # pallas_call's defaults: whole arrays, no blocks
  if by_index is None:  # program i runs tile i, on its blocks
    grid, args = (tiles,), in_leaves
    specs.update(
        in_specs=[block_spec(k, a, block_rows) for k, a in zip(in_kinds, in_leaves)],
        out_specs=[block_spec(k, a, block_rows) for k, a in zip(out_kinds, out_leaves)])
  else:  # whole arrays; each program its tiles' rows, by index
    kernel = schedule_lib.over_tiles(kernel, in_kinds + out_kinds, block_rows=block_rows,
                                     tiles=tiles, n_programs=by_index.programs)
    grid, args = (by_index.programs,), [by_index.load, by_index.store, *in_leaves]
  results = pl.pallas_call(
      kernel,
      grid=grid,
      **specs,
      out_shape=out_leaves,
      compiler_params=config.compiler_params,
      interpret=interpret,
      name=name,
  )(*args)
  return tree_util.tree_unflatten(out_tree, results)


# --- Planning: the tile height, the persistent grid ---------------------------


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


def tile_count_programs(backend: backend_lib.Backend, config: backend_lib.KernelConfig,
                        tiles: int, schedule: str | None, programs: int | None) -> int:
  """The grid size of a kernel over `tiles` tiles: `tiles` for the grid
  schedule; for the persistent one `programs`, or the backend's rule
  (`Backend.persistent_programs`).

  Args:
    backend: the kernel's backend.
    config: its configuration (the persistent rule reads it).
    tiles: the tile count.
    schedule: the caller's schedule (`schedule.resolve`).
    programs: the persistent grid's size, or None.

  Returns:
    The number of programs, in [1, tiles].
  """
  rule = backend.persistent_programs
  if rule is None or schedule_lib.resolve(backend, schedule) == "grid":
    return tiles
  if programs is None:
    programs = rule(config, tiles)
  return max(1, min(tiles, programs))
