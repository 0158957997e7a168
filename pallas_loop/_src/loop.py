"""The masked loop over steps, shared by the kernel and the XLA implementation.

Written with operations both Pallas backends lower (where, broadcasts,
reductions over trailing axes, int flags instead of boolean reductions, which
Triton lacks), so the kernel and the XLA path run literally the same logic.
Rows are the leading axis; a per-row quantity travels as [R, 1].

Per row, a step is applied while the row is *running*: its count is not spent
and no halting criterion has fired. With halting, the step after which the
criterion holds (once at least `min_iters` steps have been applied) is kept
and is the row's last. The loop ends when no row is running.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
from jax import lax
from jax import tree_util
import jax.numpy as jnp
import numpy as np

from pallas_loop._src.operands import Halting


class LoopState(NamedTuple):
  """Per-row loop state: h leaves [R, ...]; the rest [R, 1]."""

  h: Any
  residual: jax.Array  # float32: rms of the last applied update
  steps: jax.Array     # int32: steps applied
  halted: jax.Array    # int32 0/1: a criterion stopped the row


def elems_per_row(h: Any) -> int:
  """Number of state elements in one row (over all leaves of `h`, [R, ...])."""
  return sum(int(np.prod(np.shape(a)[1:])) for a in tree_util.tree_leaves(h))


def row_mask(active: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Broadcasts a [R, 1] row predicate to a leaf of shape [R, ...]."""
  if len(shape) == 1:
    return active.reshape(shape)
  return lax.broadcast_in_dim(active, shape, (0, 1))


def row_sum_squares(d: jax.Array) -> jax.Array:
  """[R, ...] -> [R, 1]: per-row sum of squares, reducing one axis at a time."""
  d = d * d
  while d.ndim > 2:
    d = jnp.sum(d, axis=-1)
  if d.ndim == 1:
    return d.reshape(d.shape[0], 1)
  return jnp.sum(d, axis=1, keepdims=True)


def update_rms(h_new: Any, h: Any, elems_per_row: int) -> jax.Array:
  """[R, 1] float32 rms over all state elements of the row of `h_new - h`."""
  ss = sum(row_sum_squares(n.astype(jnp.float32) - o.astype(jnp.float32))
           for n, o in zip(tree_util.tree_leaves(h_new), tree_util.tree_leaves(h)))
  return jnp.sqrt(ss * (1.0 / max(elems_per_row, 1)))


def select_rows(active: jax.Array, new: Any, old: Any) -> Any:
  """Per leaf: rows where `active` ([R, 1]) from `new`, others from `old`."""
  return tree_util.tree_map(lambda n, o: _select(row_mask(active, o.shape), n, o), new, old)


def _select(mask: jax.Array, new: jax.Array, old: jax.Array) -> jax.Array:
  if new.dtype == jnp.bool_:
    # Bool leaves (ACT's per-token flags) by logic, not a select: Mosaic in
    # libtpu 0.0.42.1 widens a select of bool vectors to int8 in a layout
    # it then rejects ("Invalid input layout" on `arith.extsi`).
    return (mask & new) | (~mask & old)
  return jnp.where(mask, new, old)


def _as_column(flag: jax.Array, rows: int) -> jax.Array:
  """A user's criterion, bool [R] or [R, 1], as bool [R, 1]."""
  return flag.astype(jnp.int32).reshape(rows, 1) > 0


def apply_update(s: Any, running: jax.Array, t: jax.Array, h_new: Any, flag: jax.Array | None,
                 halting: Halting | None, elems_per_row: int, residual: bool = True) -> Any:
  """One step's effect on the per-row state (shared by every loop).

  Args:
    s: the state before the step: any NamedTuple with fields h, residual,
      steps, halted (h leaves [R, ...], the rest [R, 1]).
    running: bool [R, 1]: rows that apply this step.
    t: int32 scalar: the trip (a running row has applied t steps).
    h_new: the body's result; flag: None or the user's criterion, bool
      [R]/[R, 1].
    halting: None or the halting operands.
    elems_per_row: state elements per row, for the rms.
    residual: track the rms of each row's last update. False when nobody
      reads it (no `return_info`): the residual then stays as it was, and
      without a tolerance the rms is not computed at all (a reduction over
      the state per step).

  Returns:
    `s` with the step applied to the running rows: new state, residual (rms
    of the update), steps + 1, and halted set where a criterion is met once
    at least `min_iters` steps have been applied.
  """
  tol = None if halting is None else halting.tol
  rms = update_rms(h_new, s.h, elems_per_row) if residual or tol is not None else None
  halted = s.halted
  if halting is not None:
    met = jnp.zeros_like(running)
    if tol is not None:
      met = met | (rms <= tol)  # NaN never converges
    if flag is not None:
      met = met | _as_column(flag, running.shape[0])
    stop = running & met & (t + 1 >= halting.min_iters)
    halted = jnp.where(stop, 1, halted)
  return s._replace(
      h=select_rows(running, h_new, s.h),
      residual=jnp.where(running, rms, s.residual) if residual and rms is not None
      else s.residual,
      steps=s.steps + running.astype(jnp.int32),
      halted=halted)


def run_loop(body: Callable[..., Any], params: Any, h: Any, x: Any, counts: jax.Array,
             rows: jax.Array, halting: Halting | None, elems_per_row: int,
             residual: bool = True,
             write_output: Callable[[jax.Array, jax.Array, Any], None] | None = None
             ) -> LoopState:
  """Runs `body` on the rows until none is running.

  Args:
    body: body(params, h, x, t, rows, index) -> (h_new, y, flag); t, rows int32
      [R, 1] (step index, row's index in the caller's batch), index the int32
      scalar step index (every row is at step `index`); flag is None or bool
      [R]/[R, 1] (the user's halt criterion evaluated on this update).
    params, h, x: operands; h/x leaves [R, ...].
    counts: int32 [R, 1], the step budgets, already in [0, max_iters].
    rows: int32 [R, 1], each row's index in the caller's batch.
    halting: None (apply exactly `counts` steps) or the halting operands.
    elems_per_row: state elements per row, for the rms.
    residual: track each row's last residual (see `apply_update`).
    write_output: write_output(t, running, y): stores the per-step output y
      of trip t for the running rows (a side effect, e.g. into a kernel's
      output ref), or None.

  Returns:
    The final `LoopState`.
  """

  # "Any row still running" is reduced over the tile in the loop's condition,
  # from the carried state, not in the body: XLA's Triton (JAX 0.11.2) rejects
  # a while loop that carries a tile-wide reduction computed in its body next
  # to a [R, D] state ("'arith.addi' op requires the same encoding for all
  # operands and results", or a segfault), see benchmarks/RESULTS.md.
  def running_rows(t: jax.Array, s: LoopState) -> jax.Array:
    return (t < counts) & (s.halted == 0)

  if halting is None:
    # Without halting the tile's trips are its largest count, known before
    # the loop: the condition compares two scalars instead of reducing a
    # [R, 1] mask on every trip (on a TPU a vector-to-scalar reduction per
    # trip, which stalls the step's pipeline; on a GPU a barrier).
    trips = jnp.max(counts)

    def any_running(carry: tuple[jax.Array, LoopState]) -> jax.Array:
      return carry[0] < trips
  else:
    def any_running(carry: tuple[jax.Array, LoopState]) -> jax.Array:
      t, s = carry
      return jnp.max(running_rows(t, s).astype(jnp.int32)) > 0

  def step(carry: tuple[jax.Array, LoopState]) -> tuple[jax.Array, LoopState]:
    t, s = carry
    running = running_rows(t, s)
    h_new, y, flag = body(params, s.h, x, jnp.broadcast_to(t, counts.shape), rows, t)
    if write_output is not None:
      write_output(t, running, y)
    return t + 1, apply_update(s, running, t, h_new, flag, halting, elems_per_row, residual)

  init = LoopState(h, jnp.zeros(counts.shape, jnp.float32),
                   jnp.zeros(counts.shape, jnp.int32), jnp.zeros(counts.shape, jnp.int32))
  _, state = lax.while_loop(any_running, step, (jnp.int32(0), init))
  return state
