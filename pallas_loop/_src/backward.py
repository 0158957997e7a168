"""The backward pass of each gradient mode (one function per mode).

Each takes what the forward saved and the cotangent `g` of the final state,
and returns the cotangents of (params, consts, h0, x). The first three modes
are one `Window` VJP each (see `vjp_window.py`) over a different per-row
window of steps; `Implicit` solves the adjoint fixed point with `iterate`.
The backward replays exactly the steps each row applied (`steps`, saved by
the forward), so halting decisions need not be reproduced.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
from jax import tree_util
import jax.numpy as jnp

from pallas_loop._src import grad_modes
from pallas_loop._src import loop as masking


@dataclasses.dataclass(frozen=True)
class Context:
  """What the backward of every mode may use.

  Attributes:
    fn: the body as a `step_fn.StepFn` (fn(params, consts, h, x, t, rows)).
    forward: the dispatched forward (params, consts, h0, x, counts, row_ids,
      halting).
    window: the dispatched window VJP: window(params, consts, h_start, x, t0,
      n, row_ids, g, bound, every) -> (g_params, g_consts, g_h_start, g_x).
    max_iters: the forward's static step bound.
    iterate_options: implementation/interpret/tiling options of the call,
      reused by `Implicit`'s adjoint solve.
  """

  fn: Callable
  forward: Callable
  window: Callable
  max_iters: int
  iterate_options: dict


def _zero_rows(keep, tree):
  """Rows where `keep` ([B]) from `tree`, zeros elsewhere."""
  return masking.select_rows(keep[:, None], tree, tree_util.tree_map(jnp.zeros_like, tree))


def full(mode: grad_modes.Full, ctx: Context, saved, g):
  params, consts, h0, x, steps, row_ids, _, _ = saved
  return ctx.window(params, consts, h0, x, jnp.zeros_like(steps), steps, row_ids, g,
                    ctx.max_iters, mode.checkpoint_every)


def truncated(mode: grad_modes.Truncated, ctx: Context, saved, g):
  params, consts, h0, x, steps, row_ids, _, _ = saved
  n = jnp.minimum(steps, mode.k)
  skipped = steps - n
  # The state before each row's last n steps: rerun them, saving nothing.
  h_start = ctx.forward(params, consts, h0, x, skipped, row_ids, None)[0]
  g_params, g_consts, g_start, g_x = ctx.window(
      params, consts, h_start, x, skipped, n, row_ids, g, min(mode.k, ctx.max_iters), None)
  return g_params, g_consts, _zero_rows(skipped == 0, g_start), g_x


def phantom(mode: grad_modes.Phantom, ctx: Context, saved, g):
  params, consts, _, x, steps, row_ids, h_out, _ = saved
  n = jnp.minimum(steps, mode.k)
  g_params, g_consts, _, g_x = ctx.window(
      params, consts, h_out, x, steps - n, n, row_ids, g, min(mode.k, ctx.max_iters), None)
  return g_params, g_consts, _zero_rows(steps == 0, g), g_x


def implicit(mode: grad_modes.Implicit, ctx: Context, saved, g):
  from pallas_loop._src import iterate as api  # the adjoint solve is an iterate call

  params, consts, _, x, steps, row_ids, h_star, halting = saved
  # Unless given, the adjoint solve halts like the forward and has its budget.
  budget = ctx.max_iters if mode.max_iters is None else mode.max_iters
  tol = mode.tol
  if tol is None:
    forward_tol = None if halting is None else halting.tol
    tol = grad_modes.Implicit.DEFAULT_TOL if forward_tol is None else forward_tol
  t_last = jnp.maximum(steps - 1, 0)[:, None]
  rows = row_ids[:, None]

  def f(shared, h, x_, t, r):
    return ctx.fn(shared[0], shared[1], h, x_, t, r)[0]

  def adjoint_step(shared, u, ops):
    h_s, x_, g_, t, r = ops
    _, vjp = jax.vjp(lambda h: f(shared, h, x_, t, r), h_s)
    return tree_util.tree_map(lambda a, b: a + b, g_, vjp(u)[0])

  u = api.iterate(
      adjoint_step, (params, consts), g, (h_star, x, g, t_last, rows),
      iters=jnp.where(steps > 0, budget, 0), max_iters=budget,
      tol=tol, **ctx.iterate_options)
  _, vjp = jax.vjp(lambda shared, x_: f(shared, h_star, x_, t_last, rows),
                   (params, consts), x)
  (g_params, g_consts), g_x = vjp(_zero_rows(steps > 0, u))
  return g_params, g_consts, _zero_rows(steps == 0, g), g_x


BACKWARD: dict[type, Callable[..., Any]] = {
    grad_modes.Full: full,
    grad_modes.Truncated: truncated,
    grad_modes.Phantom: phantom,
    grad_modes.Implicit: implicit,
}


def backward(mode, ctx: Context, saved, g):
  """Cotangents of (params, consts, h0, x) under `mode`."""
  return BACKWARD[type(mode)](mode, ctx, saved, g)
