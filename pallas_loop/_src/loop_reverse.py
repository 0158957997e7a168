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
function runs on a group of rows in XLA (`xla_backward.py`, with
`ArrayBuffer`/`ArraySum` carried through the loops) and on one row tile inside
the fused backward kernel (`kernel_backward.py`, where buffers and
accumulators are Pallas refs).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence, TypeVar

import jax
from jax import lax
from jax import tree_util
import jax.numpy as jnp

from pallas_loop._src.step import jaxpr_eval
from pallas_loop._src import loop as loop_lib

_T = TypeVar("_T")


def default_every(window: int) -> int:
  """The checkpoint interval for a window bound: ceil(sqrt(window)), >= 1.

  Minimises ceil(W/C) + C, the number of states held at once.
  """
  return max(1, math.isqrt(max(window - 1, 0)) + 1)


def checkpoint_slots(window: int, every: int) -> int:
  """States the checkpoint buffer holds: ceil(window / every), at least 1."""
  return max(1, -(-window // every))


def is_float(a: Any) -> bool:
  dtype = a.dtype if isinstance(a, jaxpr_eval.LoadOnUse) else jnp.result_type(a)
  return jnp.issubdtype(dtype, jnp.inexact)


def float32_zeros(tree: Any) -> Any:
  """float32 zeros like the float leaves of `tree`; None for the others."""
  return tree_util.tree_map(
      lambda a: jnp.zeros(jnp.shape(a), jnp.float32) if is_float(a) else None, tree)


def cast_like(acc: Any, ref: Any) -> Any:
  """`acc` (float32 or None leaves, as `float32_zeros` gives) cast to the
  dtypes of `ref`'s leaves."""
  return tree_util.tree_map(
      lambda a, r: None if a is None else a.astype(jnp.result_type(r)), acc, ref,
      is_leaf=lambda v: v is None)


def float_leaves(tree: Any) -> list[Any]:
  """The leaves of `tree` whose dtype is floating (the differentiable ones)."""
  return [a for a in tree_util.tree_leaves(tree) if is_float(a)]


def with_integer_zeros(d: Any, like: Any) -> Any:
  """`d` (a cotangent tree with None at the non-float leaves of `like`) with
  those Nones replaced by zeros of the leaf's own dtype.

  Inside the backwards, the cotangent of an integer or bool state leaf is an
  array of zeros of that leaf's dtype: every implementation carries it the
  same way (a Pallas kernel cannot hold float0), so the per-platform branches
  agree on their output types. float0 appears only at the custom_vjp boundary
  (`iterate._differentiable`).
  """
  return tree_util.tree_map(lambda a, r: jnp.zeros(jnp.shape(r), jnp.result_type(r))
                            if a is None else a, d, like, is_leaf=lambda v: v is None)


def vjp_of_floats(fn: Callable[..., Any], args: tuple[Any, ...], ct_floats: list[Any],
                  *, evaluate: Callable[..., Any] | None = None,
                  wanted: Sequence[bool] | None = None) -> tuple[Any, ...]:
  """The VJP of `fn(*args)` with respect to the float leaves of `args` only.

  Integer and bool leaves (step counters, flags, key data) have no
  derivative: they are closed over, not differentiated, so no float0 value
  enters the computation (it could not inside a Pallas kernel).

  Args:
    fn: the function; its output may mix float and non-float leaves.
    args: a tuple of pytrees.
    ct_floats: the cotangents of `fn`'s float output leaves, in order.
    evaluate: evaluate(vjp_fn, floats, ct_floats) -> cotangents of floats;
      None calls `vjp_fn(floats, ct_floats)` directly (the backward kernel
      passes one that evaluates it with its backend's rules).
    wanted: per leaf of `args`, whether its cotangent is wanted (None: every
      float leaf's); a float leaf not wanted is closed over like an integer.

  Returns:
    A tuple like `args`: the cotangent of each float leaf (that is wanted),
    None elsewhere.
  """
  leaves, tree = tree_util.tree_flatten(args)
  is_f = [is_float(a) and (wanted is None or w)
          for a, w in zip(leaves, wanted if wanted is not None else [True] * len(leaves))]

  def on_floats(floats: list[Any]) -> list[Any]:
    it = iter(floats)
    out = fn(*tree_util.tree_unflatten(tree, [next(it) if f else a
                                              for a, f in zip(leaves, is_f)]))
    return float_leaves(out)

  def vjp_fn(floats: list[Any], ct: list[Any]) -> list[Any]:
    return jax.vjp(on_floats, floats)[1](ct)[0]

  floats = [a for a, f in zip(leaves, is_f) if f]
  d = vjp_fn(floats, list(ct_floats)) if evaluate is None else evaluate(
      vjp_fn, floats, list(ct_floats))
  it = iter(d)
  return tuple(tree_util.tree_unflatten(tree, [next(it) if f else None for f in is_f]))


def step_vjp(step: Callable, shared: Any, h: Any, x: Any, t: jax.Array, rows: jax.Array,
             index: jax.Array, ct: Any, ct_y: Any, acc_shared: Any,
             acc_x: Any) -> tuple[Any, Any, Any]:
  """The VJP of `step` ((h_new, y)) at (shared, h, x) for the cotangents
  (`ct`, `ct_y`; `ct_y` None without per-step outputs), summed into the
  accumulators.

  Only float leaves are differentiated; integer state leaves get zero
  cotangents of their own dtype (`with_integer_zeros`).

  Returns:
    (d_h, acc_shared + d_shared, acc_x + d_x).
  """
  d_shared, d_h, d_x = vjp_of_floats(lambda s_, h_, x_: step(s_, h_, x_, t, rows, index),
                                     (shared, h, x), float_leaves(ct) + float_leaves(ct_y))
  return with_integer_zeros(d_h, h), acc_shared.add(d_shared), acc_x.add(d_x)


def _counted_loop(lo: int | jax.Array, hi: int | jax.Array,
                  body: Callable[[jax.Array, _T], _T], init: _T) -> _T:
  """`lax.fori_loop(lo, hi, body, init)`, as a loop Triton does not hoist from.

  Pallas' Triton lowering turns a `fori_loop` into `scf.for`, out of which
  Triton hoists loop-invariant loads: every weight a step re-reads would then
  be loaded once and held in shared memory for the whole loop (RESULTS.md,
  "Figures behind the code's choices"). A `while_loop` whose condition closes
  over the bound is lowered to `scf.while`, from which it does not hoist; XLA
  compiles both forms alike.
  """
  def cond(carry: tuple[jax.Array, _T]) -> jax.Array:
    return carry[0] < hi

  def step(carry: tuple[jax.Array, _T]) -> tuple[jax.Array, _T]:
    i, value = carry
    return i + 1, body(i, value)

  return lax.while_loop(cond, step, (jnp.asarray(lo, jnp.int32), init))[1]


def _bool_as_int32(tree: Any) -> Any:
  """`tree` with its bool leaves as int32 (0/1): what the window's loops carry."""
  return tree_util.tree_map(
      lambda a: a.astype(jnp.int32) if jnp.result_type(a) == jnp.bool_ else a, tree)


def _int32_as_bool(tree: Any, like: Any) -> Any:
  """The inverse of `_bool_as_int32`: the leaves that are bool in `like` back to bool."""
  return tree_util.tree_map(
      lambda a, r: a != 0 if jnp.result_type(r) == jnp.bool_ else a, tree, like)


def reverse_window(step: Callable, shared: Any, h_start: Any, x: Any, t0: jax.Array,
                   n: jax.Array, rows: jax.Array, g: Any, *, every: int, ckpt: Any, seg: Any,
                   acc_shared: Any, acc_x: Any, vjp: Callable = step_vjp,
                   aligned: bool = False,
                   g_ys_at: Callable[[jax.Array], Any] | None = None) -> tuple[Any, Any, Any]:
  """The VJP of each row's window of steps, checkpointed.

  Args:
    step: step(shared, h, x, t, rows, index) -> (h_new, y) (row
      independent; y the per-step output or None); t int32 [R, 1] each row's
      step index, index the int32 scalar one (valid when `aligned`).
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
    vjp: vjp(step, shared, h, x, t, rows, index, ct, ct_y, acc_shared,
      acc_x) -> (d_h, acc_shared, acc_x): the step's VJP with its
      shared-operand and input gradients added to the accumulators
      (`step_vjp`).
    aligned: run the rows' windows on one clock, for a step that takes one
      scalar step index for all its rows: window step w is step `lo + w` of
      every row (lo: the earliest first step among the rows), and a row
      applies it when it lies in the row's own window. Rows whose windows
      start later wait (frozen, their cotangent passed through), so the loop
      is up to max(t0 + n) - lo trips long instead of max(n). Without it,
      window step w is step `t0 + w` of each row.
    g_ys_at: g_ys_at(index) -> the cotangents of the per-step outputs of
      step `index` ([R, ...] leaves; needs `aligned`), or None: no per-step
      outputs.

  Returns:
    (g_h_start, acc_shared, acc_x).
  """
  if aligned:
    # Rows without a window neither count for `lo` nor ever apply a step.
    lo = jnp.min(jnp.where(n > 0, t0, jnp.iinfo(jnp.int32).max))
    lo = jnp.where(jnp.max(n) > 0, lo, 0)
    start = jnp.where(n > 0, t0 - lo, 0)
  else:
    lo, start = jnp.int32(0), jnp.zeros_like(n)
  end = start + n
  n_max = jnp.max(end)
  n_seg = (n_max + every - 1) // every

  def clock(w: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(active [R, 1], t [R, 1], index) at window step w."""
    active = (w >= start) & (w < end)
    if aligned:
      return active, jnp.broadcast_to(lo + w, n.shape), lo + w
    return active, t0 + w, w  # the scalar index is not used: rows differ

  # The loops carry bool state leaves (flags, ACT's halted) as int32: Mosaic
  # TPU cannot carry a bool vector through a while loop ("failed to legalize
  # operation 'scf.yield'", libtpu 0.0.42.1 and 0.0.48.1, `examples/act.py`
  # compiled deviceless); the step and the buffers see them as bool.
  words = _bool_as_int32
  flags = lambda tree: _int32_as_bool(tree, h_start)

  def advance(h: Any, w: jax.Array) -> Any:
    """The state after window step w (rows outside their window stay put);
    `h` and the result carry bool leaves as int32."""
    active, t, index = clock(w)
    h_new = step(shared, flags(h), x, t, rows, index)[0]
    return loop_lib.select_rows(active, words(h_new), h)

  def checkpoint_segment(s: jax.Array, carry: tuple[Any, Any]) -> tuple[Any, Any]:
    h, ckpt = carry
    ckpt = ckpt.write(s, flags(h))
    h = _counted_loop(0, every, lambda j, h: advance(h, s * every + j), h)
    return h, ckpt

  h_last, ckpt = _counted_loop(0, n_seg - 1, checkpoint_segment, (words(h_start), ckpt))
  ckpt = ckpt.write(jnp.maximum(n_seg - 1, 0), flags(h_last))

  def reverse_segment(i: jax.Array, carry: tuple[Any, Any, Any, Any]
                      ) -> tuple[Any, Any, Any, Any]:
    g, acc_shared, acc_x, seg = carry
    s = n_seg - 1 - i
    first = s * every
    length = jnp.minimum(every, n_max - first)

    def recompute(j: jax.Array, c: tuple[Any, Any]) -> tuple[Any, Any]:
      h, seg = c
      return advance(h, first + j), seg.write(j, flags(h))

    h, seg = _counted_loop(0, length - 1, recompute, (words(ckpt.read(s)), seg))
    seg = seg.write(length - 1, flags(h))

    def back(jj: jax.Array, c: tuple[Any, Any, Any]) -> tuple[Any, Any, Any]:
      g, acc_shared, acc_x = c
      j = length - 1 - jj
      w = first + j
      active, t, index = clock(w)
      zeros_where_idle = lambda tree: loop_lib.select_rows(
          active, tree, tree_util.tree_map(jnp.zeros_like, tree))
      ct_y = None if g_ys_at is None else zeros_where_idle(g_ys_at(index))
      d_h, acc_shared, acc_x = vjp(step, shared, seg.read(j), x, t, rows, index,
                                   zeros_where_idle(flags(g)), ct_y, acc_shared, acc_x)
      return loop_lib.select_rows(active, words(d_h), g), acc_shared, acc_x

    g, acc_shared, acc_x = _counted_loop(0, length, back, (g, acc_shared, acc_x))
    return g, acc_shared, acc_x, seg

  # The cotangents carry a bool leaf's (zeros of its dtype) as int32 too.
  g, acc_shared, acc_x, _ = _counted_loop(
      0, n_seg, reverse_segment, (words(g), acc_shared, acc_x, seg))
  return flags(g), acc_shared, acc_x
