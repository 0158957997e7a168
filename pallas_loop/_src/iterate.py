"""`pallas_loop.iterate`: the public entry point.

Validates and normalises the arguments, hoists the arrays `step` closes over
into explicit operands (`step_fn.py`), picks the forward and the backward per
lowering platform (`dispatch.py`) and wires them into one `jax.custom_vjp`
with the rule of the requested gradient mode (`grad_modes.py`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
from jax import lax
from jax import tree_util
import jax.numpy as jnp

from pallas_loop._src import dispatch
from pallas_loop._src import grad_modes
from pallas_loop._src.step import hoist as hoist_lib
from pallas_loop._src import info as info_lib
from pallas_loop._src import jax_versions
from pallas_loop._src import loop_reverse
from pallas_loop._src import options as options_lib
from pallas_loop import random as random_lib
from pallas_loop._src.step import row_checks
from pallas_loop._src import sharding
from pallas_loop._src.step import step_fn as step_fn_lib
from pallas_loop._src import validation
from pallas_loop._src.operands import LoopOperands, LoopOutputs
from pallas_loop._src.options import Options


def iterate(
    step: Callable[..., Any],
    params: Any,
    h0: Any,
    x: Any = None,
    *,
    iters: Any = None,
    max_iters: int,
    tol: Any = None,
    halt: Callable[..., Any] | None = None,
    min_iters: Any = 0,
    key: Any = None,
    grad: Any = "full",
    return_info: bool = False,
    per_example: bool = False,
    step_index: bool = False,
    step_outputs: bool = False,
    options: Options | None = None,
    **kwargs: Any,
) -> Any:
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
      compilation serves every count). Clipped to [0, max_iters]. None (the
      default): every row's budget is `max_iters`, e.g. a deep equilibrium
      layer that halts on `tol`: `iterate(f, params, h0, x, max_iters=100,
      tol=1e-5)`. When every row runs the same count, give it as one number
      (int, 0-d array, or None): the kernels then know the rows are in count
      order and move none; a [B] array of equal counts is sorted like any.
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
    key: a JAX PRNG key (`jax.random.key(...)` or a legacy uint32[2] key) or
      None. With a key, `step` gets the keyword argument `key`, uint32
      [rows, 2]: row i's key at its step t (0-based) is
      `pallas_loop.random.step_keys(key_data(key), i, t)`, a pure function
      of (key, i, t) with i the row's index in this batch, so results do not
      depend on the implementation, tiling or row order. Draw with
      `pallas_loop.random.uniform/normal/bernoulli/dropout(key, shape)`
      (jax.random does not lower inside the Triton kernel).
    grad: the gradient mode: "full" (= `Full()`: exact, checkpointed, memory
      O(sqrt(max_iters))), `Truncated(k)` (through each row's last k steps),
      `Implicit()` (implicit-function gradient at a fixed
      point) or `Phantom(k)` (k steps unrolled from the stopped output). When
      to use which, and their memory: the docs' "Gradients and memory" page.
    return_info: also return an `IterateInfo`.
    per_example: `step` is written for one row (`h` and `x` without the row
      axis, and the key of that row), as optimistix and equinox users write
      it; `iterate` vmaps it over the rows, so rows are independent by
      construction (no `testing.check_row_independence` needed). `halt`
      still sees all rows.
    step_index: `step` also gets the keyword argument `index`, the int32
      scalar number of steps the rows it is applied to have applied before
      (0 at the first step). Rows start together, so every row applying a
      step at the same trip shares it: stacked per-step parameters
      `[max_iters, ...]` are read as `params[index]` (a dynamic slice, not a
      gather), e.g. a Universal Transformer with untied layers or a
      step-dependent schedule.
    step_outputs: `step` returns `(h_new, y)`, `y` a pytree of [rows, ...]
      arrays (a prediction, a halting probability), and `iterate` returns
      the stacked outputs too, like `lax.scan`'s `ys`: [max_iters, B, ...]
      per leaf, slot t holding the output of step t, 0 where the row did
      not apply it. Differentiable with `grad="full"` and `Truncated(k)`
      (there the outputs of steps before a row's last k get no gradient);
      `Implicit` and `Phantom` raise. Every implementation runs them; in
      the kernels they stream out of the loop (written to time-major output
      blocks at each trip's slot, no per-step buffer in the loop's state).
    options: how to run it, a `pallas_loop.Options` (None: `Options()`):
      the implementation (auto, "pallas" or "xla"), interpret mode, rows
      per kernel tile, row sorting, the GPU schedule, hoisting of the
      step's state-independent part and the GPU kernels' tanh. See
      `Options` for each field.
    **kwargs: nothing else is taken; the how-to-run keywords of earlier
      versions (`implementation=`, `block_rows=`, ...) raise a TypeError
      that shows their spelling with `options=`.

  The step's extras are keyword arguments, passed only when asked for:
  `step(params, h, x)`, `step(params, h, x, key=k)`,
  `step(params, h, x, index=t)` or `step(params, h, x, key=k, index=t)`;
  `def step(params, h, x, *, key, index)` takes both.

  Returns:
    The final state, with the structure, shapes and dtypes of `h0`; with
    `step_outputs=True`, `(h, ys)`; with `return_info=True`, an
    `IterateInfo(steps, residual, halted)` appended (`(h, info)` or
    `(h, ys, info)`): steps applied, rms of the last update, and whether a
    criterion (not the budget) stopped the row. Halting decisions are data:
    gradients flow through the steps each row actually applied.

  Examples:
    >>> import jax.numpy as jnp, pallas_loop
    >>> double = lambda params, h, x: h * 2
    >>> pallas_loop.iterate(double, None, jnp.ones((3, 5)),
    ...                     iters=jnp.array([1, 2, 3]), max_iters=3)[:, 0]
    Array([2., 4., 8.], dtype=float32)
    >>> opts = pallas_loop.Options(implementation="xla")
    >>> pallas_loop.iterate(double, None, jnp.ones((3, 5)), iters=2, max_iters=3,
    ...                     options=opts)[:, 0]
    Array([4., 4., 4.], dtype=float32)
  """
  options_lib.reject_keywords("iterate", kwargs)
  validation.check_step(step)
  options = options_lib.check_options(options)
  mode = grad_modes.as_mode(grad)
  max_iters = validation.check_max_iters(max_iters)
  batch = validation.batch_size(h0, x)
  counts = validation.counts_from_iters(iters, batch, max_iters)
  halting = validation.halting_operands(tol, halt, min_iters)
  # One count for every row (a scalar `iters`, or none): the rows are in
  # count order as they come, and so are the backward's windows unless rows
  # halt on their own. The kernels then move no row (known at trace time).
  in_order = validation.same_count_every_row(iters)
  keys = None
  if key is not None:
    # Closed over by the body, the key's words become one of the step's
    # hoisted operands (an integer one: it gets no gradient).
    words = random_lib.key_data(key).reshape(1, 2)
    keys = lambda t, rows: random_lib.step_keys(words, rows, t)
  step_index = validation.check_step_index(step_index)
  step_outputs = validation.check_step_outputs(step_outputs, mode)
  if per_example:
    step = step_fn_lib.vmapped(step)
  body = step_fn_lib.with_halt(step, halt, keys, indexed=step_index, outputs=step_outputs)
  try:
    consts, (h_shape, y_shape, flag_shape) = step_fn_lib.trace_step(body, params, h0, x)
  except (TypeError, ValueError, IndexError) as e:  # say what to do, where we can
    clearer = (step_fn_lib.explain_extras_error(e, keyed=key is not None, indexed=step_index)
               or row_checks.explain_trace_error(e, h0, keyed=key is not None))
    if clearer is None:
      raise
    raise clearer from e
  step_fn_lib.check_step_output(h_shape, h0)
  step_fn_lib.check_halt_output(flag_shape, batch)
  # Per-step outputs travel row-major, [B, max_iters, ...], inside.
  ys_avals = None if not step_outputs else step_fn_lib.output_buffer_avals(
      y_shape, batch, max_iters)
  hoisted = hoist_lib.split(body, params, h0, x)[0] if options.hoist else None
  if hoisted is not None:
    body = hoisted.body
    consts, _ = step_fn_lib.trace_step(body, *_hoisted_shapes(hoisted, params, h0, x))
  fn = step_fn_lib.StepFn(body, tuple(consts), indexed=step_index, outputs=step_outputs)

  # The residual is only computed when it is returned.
  ctx = grad_modes.Context(
      fn=fn, forward=dispatch.forward_fn(fn, options, max_iters=max_iters,
                                         residual=return_info, outputs=ys_avals,
                                         in_order=in_order),
      window=dispatch.window_fn(fn, options, in_order=in_order and halting is None),
      max_iters=max_iters,
      iterate=functools.partial(iterate, options=options))
  loop = _differentiable(mode, ctx, step_fn_lib.avals(h0), ys_avals)
  loop_params = params
  if hoisted is not None:
    loop = _with_residuals(hoisted, loop)
    loop_params = (params, list(hoisted.consts))
  # Rows sharded over explicit mesh axes: run the loop (differentiable, and
  # the hoisted residuals before it) on each device's own rows
  # (`sharding.py`); else the loop itself.
  out = sharding.per_shard(loop)(LoopOperands(
      loop_params, consts, h0, x, counts, jnp.arange(batch, dtype=jnp.int32), halting))
  result = out.h
  if step_outputs:  # stacked like lax.scan's ys: [max_iters, B, ...]
    result = (out.h, tree_util.tree_map(lambda a: jnp.swapaxes(a, 0, 1), out.ys))
  if not return_info:
    return result
  info = info_lib.IterateInfo(steps=out.steps, residual=lax.stop_gradient(out.residual),
                              halted=out.halted)
  return (*result, info) if step_outputs else (result, info)


def _hoisted_shapes(hoisted: hoist_lib.Hoisted, params: Any, h0: Any, x: Any) -> tuple:
  """The avals `(params2, h0, x2)` the hoisted body is traced at."""
  params2, x2 = jax.eval_shape(hoisted.operands, params, x)
  return params2, h0, x2


def _with_residuals(hoisted: hoist_lib.Hoisted,
                    loop: Callable[[LoopOperands], LoopOutputs]) -> Callable[[LoopOperands], LoopOutputs]:
  """`loop` on the hoisted operands: `ops.params` is `(params, the residuals'
  constants)`, and the residuals are computed from it and `ops.x` as batched
  ops over the rows at hand, outside `loop`'s custom_vjp, so JAX
  differentiates them. Under `sharding.per_shard` that is each device's own
  rows: no row moves, and `x @ U` over sharded rows needs no transpose rule
  of its own."""

  def run(ops: LoopOperands) -> LoopOutputs:
    params, consts = ops.params
    params2, x2 = hoisted.operands(params, ops.x, consts)
    return loop(ops._replace(params=params2, x=x2))

  return run


def _differentiable(mode: grad_modes.GradMode, ctx: grad_modes.Context,
                    h_avals: Any, ys_avals: Any = None) -> Callable[[LoopOperands], LoopOutputs]:
  """`ctx.forward` with the backward of `mode`, as one custom_vjp.

  `h_avals` (the state's leaves' dtypes) translate between JAX's float0
  cotangents of integer and bool state leaves and the backwards' convention:
  zeros of the leaf's own dtype in, None (no gradient) out
  (`loop_reverse.with_integer_zeros`).
  """

  @jax.custom_vjp
  def run(ops: LoopOperands) -> LoopOutputs:
    return ctx.forward(ops)

  def run_fwd(ops: LoopOperands) -> tuple[LoopOutputs, grad_modes.Saved]:
    out = ctx.forward(ops)
    saved = mode.saves(ops, out)
    if jax_versions.BACKWARD_TRACED_AFTER_VMAP or mode.traces_backward_early(ctx):
      # Trace the backward now, while what step closes over is live; the
      # backward proper reuses the step's traced shapes (`StepFn.traced`).
      jax.eval_shape(run_bwd, saved, out)
    return out, saved

  def run_bwd(saved: grad_modes.Saved, cotangents: LoopOutputs) -> tuple[LoopOperands]:
    # Only the state is differentiated (residual, steps and halted are not).
    # Integer leaves' float0 cotangents as zeros of their dtype (state and
    # per-step outputs alike).
    as_zeros = lambda c, a: c if loop_reverse.is_float(a) else jnp.zeros(c.shape, a.dtype)
    g = tree_util.tree_map(as_zeros, cotangents.h, h_avals)
    g_ys = None if ys_avals is None else tree_util.tree_map(as_zeros, cotangents.ys, ys_avals)
    g_params, g_consts, g_h0, g_x = mode.backward(ctx, saved, g, g_ys)
    g_h0 = tree_util.tree_map(lambda c, a: c if loop_reverse.is_float(a) else None,
                              g_h0, h_avals)
    return (LoopOperands(g_params, g_consts, g_h0, g_x, None, None, None),)

  run.defvjp(run_fwd, run_bwd)
  return run
