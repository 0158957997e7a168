"""Checkpointed reverse-mode through a per-row window of steps.

Every gradient mode that backpropagates through applied steps reduces to the
same computation: row r starts the window in state `h_start[r]`, applies
`n[r]` steps (its step indices `t0[r]`, `t0[r] + 1`, ...), and we want the
vector-Jacobian product of the window's final state. `"full"` is the window
of all `steps` from `h0`; `Truncated(k)` the last `min(k, steps)` steps from
the state before them; `Phantom(k)` `min(k, steps)` steps from the output.

Memory is bounded by checkpointing. With C = `every` and W = the window bound:

  1. run the window forward, saving the state every C steps: ceil(W/C) states;
  2. for each segment, last first: recompute its C states from its checkpoint,
     then apply `jax.vjp` of the step from the segment's last step to its first.

So the buffers hold ceil(W/C) + C states (O(sqrt(W)) for C ~ sqrt(W)) and the
step runs about twice forward plus once backward. Rows are masked exactly as
in the forward: a row's cotangent passes unchanged through the window steps it
does not apply and feeds a zero cotangent to those steps, so they contribute
nothing to the parameter or input gradients (accumulated in float32).

The algorithm is written once against small storage interfaces, so the same
function runs on the whole batch in XLA (`ArrayBuffer`/`ArraySum`, carried
through the loops) and on one row tile inside the fused backward kernel
(`bwd_kernel.py`, where buffers and accumulators are Pallas refs).
"""

from __future__ import annotations

import math
from typing import Callable

import jax
from jax import lax
from jax import tree_util
import jax.numpy as jnp

from pallas_loop._src import jaxpr_eval
from pallas_loop._src import loop as masking
from pallas_loop._src import tiling as rows_lib


def default_every(window: int) -> int:
  """The checkpoint interval for a window bound: ceil(sqrt(window)), >= 1.

  Minimises ceil(W/C) + C, the number of states held at once.
  """
  return max(1, math.isqrt(max(window - 1, 0)) + 1)


def checkpoint_slots(window: int, every: int) -> int:
  """States the checkpoint buffer holds: ceil(window / every), at least 1."""
  return max(1, -(-window // every))


def is_float(a) -> bool:
  dtype = a.dtype if isinstance(a, jaxpr_eval.LoadOnUse) else jnp.result_type(a)
  return jnp.issubdtype(dtype, jnp.inexact)


def float32_zeros(tree):
  """float32 zeros like the float leaves of `tree`; None for the others."""
  return tree_util.tree_map(
      lambda a: jnp.zeros(jnp.shape(a), jnp.float32) if is_float(a) else None, tree)


def cast_like(acc, ref):
  """`acc` (float32 or None leaves) cast to the dtypes of `ref`'s leaves."""
  return tree_util.tree_map(
      lambda a, r: None if a is None else a.astype(jnp.result_type(r)), acc, ref,
      is_leaf=lambda v: v is None)


@tree_util.register_pytree_node_class
class ArrayBuffer:
  """`size` states in arrays [size, R, ...], carried through the loops."""

  def __init__(self, arrays):
    self.arrays = arrays

  @classmethod
  def zeros(cls, size: int, like):
    return cls(tree_util.tree_map(lambda a: jnp.zeros((size,) + a.shape, a.dtype), like))

  def read(self, k):
    return tree_util.tree_map(
        lambda b: lax.dynamic_index_in_dim(b, k, 0, keepdims=False), self.arrays)

  def write(self, k, value) -> ArrayBuffer:
    return ArrayBuffer(tree_util.tree_map(
        lambda b, v: lax.dynamic_update_index_in_dim(b, v, k, 0), self.arrays, value))

  def tree_flatten(self):
    return (self.arrays,), None

  @classmethod
  def tree_unflatten(cls, _, children):
    return cls(children[0])


@tree_util.register_pytree_node_class
class ArraySum:
  """A float32 running sum of a pytree (None leaves stay None)."""

  def __init__(self, total):
    self.total = total

  @classmethod
  def zeros(cls, like):
    return cls(float32_zeros(like))

  def add(self, value) -> ArraySum:
    return ArraySum(tree_util.tree_map(
        lambda a, b: a if a is None else a + b.astype(jnp.float32), self.total, value,
        is_leaf=lambda v: v is None))

  def tree_flatten(self):
    return (self.total,), None

  @classmethod
  def tree_unflatten(cls, _, children):
    return cls(children[0])


def step_vjp(step: Callable, shared, h, x, t, rows, ct, acc_shared, acc_x):
  """The VJP of `step` at (shared, h, x) for `ct`, summed into the accumulators.

  Returns:
    (d_h, acc_shared + d_shared, acc_x + d_x).
  """
  _, vjp = jax.vjp(lambda s_, h_, x_: step(s_, h_, x_, t, rows), shared, h, x)
  d_shared, d_h, d_x = vjp(ct)
  return d_h, acc_shared.add(d_shared), acc_x.add(d_x)


def _counted_loop(lo, hi, body, init):
  """`lax.fori_loop(lo, hi, body, init)`, as a loop Triton does not hoist from.

  Pallas' Triton lowering turns a `fori_loop` into `scf.for`, out of which
  Triton hoists loop-invariant loads: every weight a step re-reads would then
  be loaded once and held in shared memory for the whole loop (a GRU's
  backward at D=128: 200 KB instead of one weight's 64 KB). A `while_loop`
  whose condition closes over the bound is lowered to `scf.while`, from which
  it does not hoist; XLA compiles both forms alike.
  """
  def cond(carry):
    return carry[0] < hi

  def step(carry):
    i, value = carry
    return i + 1, body(i, value)

  return lax.while_loop(cond, step, (jnp.asarray(lo, jnp.int32), init))[1]


def reverse_window(step: Callable, shared, h_start, x, t0, n, rows, g, *,
                   every: int, ckpt, seg, acc_shared, acc_x, vjp: Callable = step_vjp):
  """The VJP of each row's window of steps, checkpointed.

  Args:
    step: step(shared, h, x, t, rows) -> h_new (row independent).
    shared: the differentiable shared operands.
    h_start, x: leaves [R, ...]: each row's state at the window's start, inputs.
    t0, n: int32 [R, 1]: each row's first step index and window length.
    rows: int32 [R, 1]: each row's index in the caller's batch.
    g: cotangent of the state after the window, like h_start.
    every: static checkpoint interval C.
    ckpt: a buffer (`read(k)`, `write(k, h) -> buffer`) with at least
      ceil(max(n) / C) states; seg: a buffer with at least C states.
    acc_shared, acc_x: accumulators (`add(tree) -> accumulator`) for the
      shared-operand and input gradients (float32).
    vjp: vjp(step, shared, h, x, t, rows, ct, acc_shared, acc_x) -> (d_h,
      acc_shared, acc_x): the step's VJP with its shared-operand and input
      gradients added to the accumulators (`step_vjp`).

  Returns:
    (g_h_start, acc_shared, acc_x).
  """
  n_max = jnp.max(n)
  n_seg = (n_max + every - 1) // every

  def advance(h, w):
    """The state after window step w (rows past their window stay put)."""
    active = w < n
    h_new = step(shared, h, x, t0 + w, rows)
    return masking.select_rows(active, h_new, h)

  def checkpoint_segment(s, carry):
    h, ckpt = carry
    ckpt = ckpt.write(s, h)
    h = _counted_loop(0, every, lambda j, h: advance(h, s * every + j), h)
    return h, ckpt

  h_last, ckpt = _counted_loop(0, n_seg - 1, checkpoint_segment, (h_start, ckpt))
  ckpt = ckpt.write(jnp.maximum(n_seg - 1, 0), h_last)

  def reverse_segment(i, carry):
    g, acc_shared, acc_x, seg = carry
    s = n_seg - 1 - i
    first = s * every
    length = jnp.minimum(every, n_max - first)

    def recompute(j, c):
      h, seg = c
      return advance(h, first + j), seg.write(j, h)

    h, seg = _counted_loop(0, length - 1, recompute, (ckpt.read(s), seg))
    seg = seg.write(length - 1, h)

    def back(jj, c):
      g, acc_shared, acc_x = c
      j = length - 1 - jj
      w = first + j
      active = w < n
      masked = masking.select_rows(active, g, tree_util.tree_map(jnp.zeros_like, g))
      d_h, acc_shared, acc_x = vjp(step, shared, seg.read(j), x, t0 + w, rows, masked,
                                   acc_shared, acc_x)
      return masking.select_rows(active, d_h, g), acc_shared, acc_x

    g, acc_shared, acc_x = _counted_loop(0, length, back, (g, acc_shared, acc_x))
    return g, acc_shared, acc_x, seg

  g, acc_shared, acc_x, _ = _counted_loop(
      0, n_seg, reverse_segment, (g, acc_shared, acc_x, seg))
  return g, acc_shared, acc_x


# Rows per group of the XLA backward: the batch is ordered by window length
# and cut into groups of about this many rows (at most MAX_GROUPS groups),
# each reversed only to its own longest window, like the kernel's tiles.
GROUP_ROWS = 128
MAX_GROUPS = 8


def group_count(batch: int) -> int:
  """How many row groups the XLA backward uses for a batch of `batch` rows."""
  return max(1, min(MAX_GROUPS, batch // GROUP_ROWS))


def backward_xla(step: Callable, shared, h_start, x, t0, n, row_ids, g, *, window: int,
                 every: int | None = None):
  """`reverse_window` in XLA, skipping most of the finished rows' work.

  Rows are ordered by descending window length and cut into
  `group_count(B)` equal groups (padded with length-0 copies of a real row);
  `lax.map` runs `reverse_window` on one group after another, each to its own
  longest window, so the work tracks sum(n) roughly as the kernel's sorted
  tiles do, and the buffers hold one group's states at a time. Parameter
  gradients are summed over the groups in float32.

  Args:
    step, shared, h_start, x, g: as in `reverse_window` (leaves [B, ...]).
    t0, n: int32 [B]: first step index and window length per row.
    row_ids: int32 [B]: each row's index in the caller's batch.
    window: static bound on `n`.
    every: checkpoint interval (default `default_every(window)`).

  Returns:
    (g_shared, g_h_start, g_x), cast to the operands' dtypes (None for
    integer leaves).
  """
  every = every or default_every(window)
  batch = n.shape[0]
  groups = group_count(batch)
  size = -(-batch // groups)
  order = rows_lib.descending_order(n)
  per_row = rows_lib.take_rows((h_start, x, g, t0, row_ids), order)
  h_s, x_s, g_s, t0_s, ids_s = rows_lib.pad_rows(per_row, groups * size, poison_ok=False)
  n_s = rows_lib.pad_counts(jnp.take(n, order), groups * size)
  split = lambda tree: tree_util.tree_map(
      lambda a: a.reshape((groups, size) + a.shape[1:]), tree)

  def one_group(operands):
    h, x_, g_, t0_, n_, ids = operands
    g_h, acc_shared, acc_x = reverse_window(
        step, shared, h, x_, t0_[:, None], n_[:, None], ids[:, None], g_, every=every,
        ckpt=ArrayBuffer.zeros(checkpoint_slots(window, every), h),
        seg=ArrayBuffer.zeros(every, h),
        acc_shared=ArraySum.zeros(shared), acc_x=ArraySum.zeros(x_))
    return g_h, acc_shared.total, acc_x.total

  g_h, g_shared, g_x = lax.map(one_group, split((h_s, x_s, g_s, t0_s, n_s, ids_s)))
  merge = lambda tree: tree_util.tree_map(
      lambda a: a.reshape((groups * size,) + a.shape[2:])[:batch], tree)
  inverse = rows_lib.inverse_permutation(order)
  g_h, g_x = rows_lib.take_rows((merge(g_h), merge(g_x)), inverse)
  g_shared = tree_util.tree_map(lambda a: jnp.sum(a, axis=0), g_shared)
  return cast_like(g_shared, shared), g_h, cast_like(g_x, x)
