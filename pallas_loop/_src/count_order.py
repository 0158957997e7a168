"""Rows in count order around the whole differentiable loop, on a TPU.

Legend:  B: rows of the batch

The TPU's kernels (`kernel_tpu_groups.py`, `kernel_tpu_groups_backward.py`)
run rows sorted by descending count, so that the running rows are a prefix.
Sorting inside each kernel's wrapper costs a training step two sorts and
three row gathers in the forward (h0, x in; h out) and as many again in the
backward (h0, x and the cotangent in; the gradients out), although a
`Full` backward's window lengths are the forward's counts: it sorts the same
rows by the same keys. `in_count_order` sorts once, around the custom_vjp:
the loop (forward and backward, kernels or XLA alike) sees rows already in
count order, which the kernels detect on the device and do not move again,
and the custom_vjp's residuals (h0, x) are kept in that order. The
permutation's own VJP is a gather by the inverse permutation, not the
scatter-add JAX would transpose a gather into. What is left of the backward's
permutation is the cotangent in and the gradients out.

Where the rows are moved: on a TPU (a branch per lowering platform, as
`dispatch.py` chooses kernels), and in interpret mode under the TPU's
semantics (`pltpu.InterpretParams`); with `sort_rows=False` or
`implementation="xla"` never. Rows whose counts already descend (constant
counts, say) are not moved: a branch on the device.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax import lax
from jax import tree_util
import jax.numpy as jnp

from pallas_loop._src.kernels import backend_interpret
from pallas_loop._src.kernels import backends
from pallas_loop._src import tiling
from pallas_loop._src.operands import LoopOperands, LoopOutputs
from pallas_loop._src.options import Options


@jax.custom_vjp
def permute_rows(tree: Any, order: jax.Array, inverse: jax.Array, keep: jax.Array) -> Any:
  """Rows `order` of every leaf of `tree` (`keep`: a bool scalar, rows left
  where they are), with the VJP a gather by `inverse` (the permutation's
  transpose), not a scatter-add.

  Args:
    tree: pytree of [B, ...] arrays.
    order, inverse: int32 [B], inverse permutations of each other.
    keep: bool []: leave the rows in place (no gather runs).

  Returns:
    `tree` with its rows permuted.

  Example:
    >>> o, i = jnp.array([2, 0, 1]), jnp.array([1, 2, 0])
    >>> permute_rows(jnp.arange(3.0), o, i, jnp.bool_(False))
    Array([2., 0., 1.], dtype=float32)
    >>> jax.grad(lambda a: permute_rows(a, o, i, jnp.bool_(False))[0])(jnp.arange(3.0))
    Array([0., 0., 1.], dtype=float32)
  """
  return _take_unless(tree, order, keep)


def _take_unless(tree: Any, index: jax.Array, keep: jax.Array) -> Any:
  leaves, treedef = tree_util.tree_flatten(tree)
  if not leaves:
    return tree
  moved = lax.cond(keep, lambda a: a, lambda a: tiling.take_rows(a, index), leaves)
  return tree_util.tree_unflatten(treedef, moved)


def _permute_fwd(tree, order, inverse, keep):
  return _take_unless(tree, order, keep), (order, inverse, keep)


def _permute_bwd(saved, g):
  order, inverse, keep = saved
  # An integer leaf's cotangent is float0 of its shape: it has no rows to move.
  floats = lambda a: a.dtype != jax.dtypes.float0
  leaves, treedef = tree_util.tree_flatten(g)
  moved = _take_unless([a for a in leaves if floats(a)], inverse, keep)
  it = iter(moved)
  g_tree = tree_util.tree_unflatten(treedef, [next(it) if floats(a) else a for a in leaves])
  zero = lambda a: jnp.zeros(a.shape, jax.dtypes.float0)
  return g_tree, zero(order), zero(inverse), zero(keep)


permute_rows.defvjp(_permute_fwd, _permute_bwd)


def _sorted(loop: Callable[[LoopOperands], LoopOutputs]) -> Callable[[LoopOperands], LoopOutputs]:
  """`loop` on its rows in descending count order, its outputs back in the
  caller's order."""

  def run(ops: LoopOperands) -> LoopOutputs:
    batch = ops.counts.shape[0]
    if batch < 2:
      return loop(ops)
    in_order = jnp.all(ops.counts[:-1] >= ops.counts[1:])
    # One sort yields the order and the sorted counts; the inverse by a
    # sort too (`tiling.inverse_permutation`).
    counts, order = tiling.sorted_descending(ops.counts)
    inverse = tiling.inverse_permutation(order, by_sort=True)
    h0, x = permute_rows((ops.h0, ops.x), order, inverse, in_order)
    row_ids = _take_unless(ops.row_ids, order, in_order)
    out = loop(ops._replace(h0=h0, x=x, counts=counts, row_ids=row_ids))
    h, ys = permute_rows((out.h, out.ys), inverse, order, in_order)
    residual, steps, halted = _take_unless((out.residual, out.steps, out.halted), inverse,
                                           in_order)
    return LoopOutputs(h, residual, steps, halted, ys)

  return run


def in_count_order(loop: Callable[[LoopOperands], LoopOutputs],
                   options: Options) -> Callable[[LoopOperands], LoopOutputs]:
  """`loop` (iterate's custom_vjp) on rows sorted by count where the TPU's
  kernels would run it (see the module's docstring), else `loop` itself.

  Args:
    loop: LoopOperands -> LoopOutputs, rows in any order.
    options: the call's `Options` (`implementation`, `interpret`, `sort_rows`).

  Returns:
    A function like `loop`, outputs in the caller's row order.
  """
  if not options.sort_rows or options.implementation == "xla":
    return loop
  interpret = options.interpret
  if interpret is not None and interpret is not False:
    # Interpret mode: the rows move where the backend's own kernels run
    # (the TPU's semantics), as they would on the device.
    own = backend_interpret.for_option(interpret).plan_forward is not None
    return _sorted(loop) if own else loop
  platforms = [p for b in backends.compiled() if b.plan_forward is not None
               for p in b.platforms]
  if not platforms:
    return loop
  # One trace of the loop for both branches (the same avals): each branch
  # calls this jitted function.
  inner = jax.jit(loop, inline=True)
  on_sorted = _sorted(inner)
  return lambda ops: lax.platform_dependent(
      ops, default=inner, **{platform: on_sorted for platform in platforms})
