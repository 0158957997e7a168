"""`pallas_loop.iterate`: the public entry point.

Validates and normalises the arguments, hoists the arrays `step` closes over
into explicit operands (`step_fn.py`), picks the forward per lowering platform
(`dispatch.py`) and wires it into one `jax.custom_vjp` with the backward of
the requested gradient mode (`vjp_full.py`).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax import lax

from pallas_loop import dispatch
from pallas_loop import info as info_lib
from pallas_loop import sharding
from pallas_loop import step_fn as step_fn_lib
from pallas_loop import validation
from pallas_loop import vjp_full


def iterate(
    step: Callable[..., Any],
    params: Any,
    h0: Any,
    x: Any = None,
    *,
    iters: Any,
    max_iters: int,
    tol: Any = None,
    halt: Callable[..., Any] | None = None,
    min_iters: Any = 0,
    grad: str = "full",
    implementation: str | None = None,
    interpret: Any = None,
    block_rows: int | None = None,
    sort_rows: bool = True,
    return_info: bool = False,
):
  """Applies `step` to each row of `h0` its own number of times.

  Row i of the state is updated `n_i = clip(iters[i], 0, max_iters)` times:
  `h <- step(params, h, x)`. Rows are independent, so a row that has spent
  its count is frozen while the others go on, and (in the Pallas kernel) a
  tile of rows stops as soon as its slowest row is done. Differentiable
  w.r.t. `params`, `h0` and `x` (the counts are data and get no gradient),
  and composes with `jit`, `vmap` and `grad`.

  Args:
    step: `step(params, h, x) -> h_new`. It sees a group of rows: every leaf
      of `h` and `x` has a leading row axis. It must treat rows independently
      and return the structure, shapes and dtypes of `h`. Inside the Pallas
      kernel it may use only what Pallas lowers (jnp arithmetic, dot,
      reductions over non-row axes, where). Arrays it closes over are hoisted
      into operands and differentiated like `params`.
    params: pytree shared by every row (may be None).
    h0: pytree of arrays, each [B, ...]: the initial state.
    x: pytree of arrays [B, ...], constant across steps, or None.
    iters: int, or int array of shape () or [B]; may be traced (one
      compilation serves every count). Clipped to [0, max_iters].
    max_iters: static Python int >= 0, the largest count.
    tol: halt a row after the first step whose update has
      `rms(h_new - h) <= tol`, the rms over all state elements of the row,
      in float32. A float, or a float scalar array (may be traced). The step
      that met it is kept. A non-finite update never meets it (NaN compares
      false): such a row runs to its budget and reports a NaN residual.
    halt: `halt(params, h_new, h, x) -> bool [rows]`: a custom criterion
      evaluated on each update, same timing rule, OR-ed with `tol`. See
      `pallas_loop.halting` for ready ones. Counts as the step budget still
      caps every row.
    min_iters: int (static or traced): no halting before this many steps.
    grad: "full": exact backpropagation through every applied step.
    implementation: None (auto: the Pallas kernel on GPU/TPU when the step
      fits its rules, else XLA with a one-time warning saying why; XLA on
      CPU), "pallas" (the kernel; interpret mode on CPU; an error, never a
      silent fallback, if it cannot run) or "xla".
    interpret: run the kernel in Pallas interpret mode. None: only where no
      compiled backend exists (CPU). A `pltpu.InterpretParams()` interprets
      with TPU semantics.
    block_rows: rows per kernel tile (default chosen per backend: 32 with
      Triton, up to 128 on TPU, 32 in interpret mode).
    sort_rows: order rows by descending count before tiling so each tile's
      rows finish together (results do not depend on it).
    return_info: also return an `IterateInfo`.

  Returns:
    The final state, with the structure, shapes and dtypes of `h0`; with
    `return_info=True`, `(h, IterateInfo(steps, residual, halted))`: steps
    applied, rms of the last update, and whether a criterion (not the
    budget) stopped the row. Halting decisions are data: gradients flow
    through the steps each row actually applied.

  Example:
    >>> import jax.numpy as jnp, pallas_loop
    >>> double = lambda params, h, x: h * 2
    >>> pallas_loop.iterate(double, None, jnp.ones((3, 5)),
    ...                     iters=jnp.array([1, 2, 3]), max_iters=3)[:, 0]
    Array([2., 4., 8.], dtype=float32)
  """
  validation.check_options(step, implementation, interpret, block_rows, sort_rows, grad)
  max_iters = validation.check_max_iters(max_iters)
  batch = validation.batch_size(h0, x)
  counts = validation.counts_from_iters(iters, batch, max_iters)
  halting = validation.halting_operands(tol, halt, min_iters)
  body = step_fn_lib.with_halt(step, halt)
  consts, (h_shape, flag_shape) = step_fn_lib.trace_step(body, params, h0, x)
  step_fn_lib.check_step_output(h_shape, h0)
  step_fn_lib.check_halt_output(flag_shape, batch)
  fn = step_fn_lib.StepFn(body, tuple(consts))

  forward = dispatch.forward_fn(
      fn, implementation=implementation, interpret=interpret,
      block_rows=block_rows, sort_rows=sort_rows)
  loop = _with_custom_vjp(forward, fn, max_iters)
  # --- sharding hook: run `loop` (differentiable) on each device's own rows
  # when the rows are sharded over explicit mesh axes; else `loop` itself.
  loop = sharding.per_shard(loop, warn_auto=implementation != "xla")
  # --- end sharding hook
  h, residual, steps, halted = loop(params, consts, h0, x, counts, halting)
  if not return_info:
    return h
  return h, info_lib.IterateInfo(steps=steps, residual=lax.stop_gradient(residual),
                                 halted=halted)


def _with_custom_vjp(forward, fn, max_iters):
  """`forward` as a custom_vjp over (params, consts, h0, x, counts, halting).

  The backward needs only the steps each row applied (saved from the
  forward), not the halting decisions: it replays exactly those steps.
  """

  @jax.custom_vjp
  def run(params, consts, h0, x, counts, halting):
    return forward(params, consts, h0, x, counts, halting)

  def run_fwd(params, consts, h0, x, counts, halting):
    out = forward(params, consts, h0, x, counts, halting)
    return out, (params, consts, h0, x, out[2])

  def run_bwd(saved, cotangents):
    params, consts, h0, x, steps = saved
    g_h = cotangents[0]  # residual, steps and halted are not differentiated
    step = lambda shared, h, x_: fn(shared[0], shared[1], h, x_)[0]
    (g_params, g_consts), g_h0, g_x = vjp_full.backward(
        step, (params, consts), h0, x, steps, max_iters, g_h)
    return g_params, g_consts, g_h0, g_x, None, None

  run.defvjp(run_fwd, run_bwd)
  return run
