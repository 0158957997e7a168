"""Backward pass for `grad="full"`: exact reverse-mode through every applied step.

The forward is recomputed in XLA, saving the state before each step into a
[max_iters, B, ...] buffer (memory O(max_iters): bounded checkpointing and a
fused Pallas backward are the gradient-modes issue's), then a reverse loop
applies `jax.vjp` of the step from each row's last step to its first. A row's
cotangent passes unchanged through the steps it did not apply, and it feeds
zero cotangent to the step there, so it contributes nothing to the parameter
or input gradients. Gradients of params/x are accumulated in float32.
"""

from __future__ import annotations

import jax
from jax import lax
from jax import tree_util
import jax.numpy as jnp

from pallas_loop import masking


def _is_float(a) -> bool:
  return jnp.issubdtype(jnp.result_type(a), jnp.inexact)


def _zeros_f32(tree):
  return tree_util.tree_map(
      lambda a: jnp.zeros(jnp.shape(a), jnp.float32) if _is_float(a) else None, tree)


def _add_f32(acc, g):
  return tree_util.tree_map(
      lambda a, b: a if a is None else a + b.astype(jnp.float32), acc, g,
      is_leaf=lambda v: v is None)


def _cast_like(acc, ref):
  return tree_util.tree_map(
      lambda a, r: None if a is None else a.astype(jnp.result_type(r)), acc, ref,
      is_leaf=lambda v: v is None)


def backward(step, shared, h0, x, counts, max_iters: int, g_h):
  """Cotangents of (shared, h0, x) for the cotangent `g_h` of the final state.

  Args:
    step: step(shared, h, x) -> h_new.
    shared: the differentiable shared operands (params and step constants).
    h0, x: the operands of the forward (leaves [B, ...]).
    counts: int32 [B], clipped step counts.
    max_iters: static bound on counts (sizes the trajectory buffer).
    g_h: cotangent of the final state, structured like h0.

  Returns:
    (g_shared, g_h0, g_x); integer leaves get None (zero cotangent).
  """
  column = counts[:, None]
  rows = lax.broadcasted_iota(jnp.int32, column.shape, 0)
  n_max = jnp.max(counts, initial=0)

  def record(t, carry):
    h, trajectory = carry
    trajectory = tree_util.tree_map(
        lambda buf, a: lax.dynamic_update_index_in_dim(buf, a, t, 0), trajectory, h)
    active = t < column
    h_new = step(shared, h, x, jnp.broadcast_to(t, column.shape), rows)
    h = tree_util.tree_map(
        lambda n, o: jnp.where(masking.row_mask(active, o.shape), n, o), h_new, h)
    return h, trajectory

  empty = tree_util.tree_map(lambda a: jnp.zeros((max_iters,) + a.shape, a.dtype), h0)
  _, trajectory = lax.fori_loop(0, n_max, record, (h0, empty))

  def reverse(i, carry):
    g, g_shared, g_x = carry
    t = n_max - 1 - i
    h_t = tree_util.tree_map(
        lambda buf: lax.dynamic_index_in_dim(buf, t, 0, keepdims=False), trajectory)
    active = t < column
    masked = tree_util.tree_map(
        lambda a: jnp.where(masking.row_mask(active, a.shape), a, jnp.zeros_like(a)), g)
    t_col = jnp.broadcast_to(t, column.shape)
    _, vjp = jax.vjp(lambda s_, h_, x_: step(s_, h_, x_, t_col, rows), shared, h_t, x)
    d_shared, d_h, d_x = vjp(masked)
    g = tree_util.tree_map(
        lambda n, o: jnp.where(masking.row_mask(active, o.shape), n, o), d_h, g)
    return g, _add_f32(g_shared, d_shared), _add_f32(g_x, d_x)

  g_h0, g_shared, g_x = lax.fori_loop(
      0, n_max, reverse, (g_h, _zeros_f32(shared), _zeros_f32(x)))
  return _cast_like(g_shared, shared), g_h0, _cast_like(g_x, x)
