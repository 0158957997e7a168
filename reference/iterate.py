"""The oracle's `iterate`: the semantics of `pallas_loop.iterate`, written plainly."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

# The one thing taken from the library: the public per-(row, step) key
# derivation, which the oracle shares by design.
from pallas_loop import random as pl_random


class IterateInfo(NamedTuple):
  """Per-row statistics of one oracle run (the fields of `pallas_loop.IterateInfo`).

  Attributes:
    steps: int32 [B], how many times `step` was applied to each row.
    residual: float32 [B], rms over the row's state elements of its last
      update `h_new - h`, in float32; 0 where no step ran.
    halted: bool [B], True where `tol`/`halt` (not the budget) stopped the row.

  Example:
    >>> import jax.numpy as jnp
    >>> from pallas_loop import _reference as reference
    >>> _, info = reference.iterate(lambda p, h, x: h / 2, None, jnp.ones((2, 3)),
    ...                             iters=jnp.array([1, 4]), max_iters=4, tol=0.1,
    ...                             return_info=True)
    >>> info.steps, info.halted
    (Array([1, 4], dtype=int32), Array([False,  True], dtype=bool))
  """

  steps: jax.Array
  residual: jax.Array
  halted: jax.Array


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
    truncate: int | None = None,
    return_info: bool = False,
    per_example: bool = False,
    step_index: bool = False,
    step_outputs: bool = False,
):
  """Applies `step` clip(iters[i], 0, max_iters) times to row i of `h0`.

  Args:
    step: step(params, h, x) -> h_new on all rows at once (row independent);
      with `key`, step(params, h, x, key=k); with `step_index`, also
      `index=t`.
    params: pytree shared by every row, or None.
    h0: pytree of arrays [B, ...].
    x: pytree of arrays [B, ...], or None.
    iters: int or int array of shape () or [B]; None: max_iters.
    max_iters: static int >= 0: the scan's length.
    tol: a row halts after the first step t (1-based) with t >= min_iters
      whose update has rms(h_new - h) <= tol (float32 rms over all state
      elements of the row); that step is kept. None: no tolerance test.
    halt: halt(params, h_new, h, x) -> bool [B], the same timing rule, OR-ed
      with tol.
    min_iters: no halting before this many steps.
    key: a JAX PRNG key, or None. At scan step t (0-based) `step` gets
      k = pallas_loop.random.step_keys(pallas_loop.random.key_data(key),
      rows, t), uint32 [B, 2], with rows = arange(B)[:, None] and t
      broadcast to [B, 1]: row i's key at step t, a pure function of
      (key, i, t). A row applies its steps at t = 0, 1, ... (later steps
      are computed and discarded), so the j-th step a row applies (0-based)
      gets the key of (i, j) in every implementation.
    truncate: None (plain autodiff through the scan) or an int k >= 1: each
      row's steps before its last k applied ones have their result
      `stop_gradient`-ed, so the gradient flows through the last k steps only
      (and reaches h0 only if the row applied <= k): the gradient of
      `pallas_loop.Truncated(k)`.
    return_info: also return an `IterateInfo`.
    per_example: `step` is written for one row (vmapped over the rows here).
    step_index: pass `step` the scan step t (an int32 scalar) as `index=`.
    step_outputs: `step` returns (h_new, y); the per-step outputs come back
      stacked like `lax.scan`'s ys, [max_iters, B, ...], 0 where a row did
      not apply that step (with `truncate`, the outputs of the steps before
      a row's last k are `stop_gradient`-ed too).

  Returns:
    The final state; `(h, ys)` with `step_outputs`; and an `IterateInfo`
    last with `return_info=True`.

  Example:
    >>> import jax.numpy as jnp
    >>> from pallas_loop import _reference as reference
    >>> reference.iterate(lambda p, h, x: 2 * h, None, jnp.ones((3, 5)),
    ...                   iters=jnp.array([1, 2, 3]), max_iters=3)[:, 0]
    Array([2., 4., 8.], dtype=float32)
  """
  if per_example:
    one_row = step

    def step(params, h, x, **extra):
      mapped = {k: v for k, v in extra.items() if k == "key"}
      shared = {k: v for k, v in extra.items() if k != "key"}
      return jax.vmap(lambda h_, x_, m: one_row(params, h_, x_, **m, **shared))(h, x, mapped)
  if truncate is not None:
    if isinstance(truncate, bool) or not isinstance(truncate, int) or truncate < 1:
      raise ValueError(f"truncate must be None or an int >= 1, got {truncate!r}.")
    # Which steps are the last k is known only once halting has run: find the
    # applied steps first (no gradient needed), then replay exactly them.
    *_, info = iterate(step, params, h0, x, iters=iters, max_iters=max_iters, tol=tol,
                       halt=halt, min_iters=min_iters, key=key, return_info=True,
                       step_index=step_index, step_outputs=step_outputs)
    steps = lax.stop_gradient(info.steps)
    h, _, _, _, ys = _scan(step, params, h0, x, steps, max_iters, None, None, 0, key,
                           truncate=(steps, truncate), step_index=step_index,
                           step_outputs=step_outputs)
  else:
    h, residual, steps, halted, ys = _scan(step, params, h0, x, iters, max_iters, tol, halt,
                                           min_iters, key, truncate=None,
                                           step_index=step_index, step_outputs=step_outputs)
    info = IterateInfo(steps=steps, residual=lax.stop_gradient(residual), halted=halted)
  result = (h, ys) if step_outputs else (h,)
  if return_info:
    result = result + (info,)
  return result[0] if len(result) == 1 else result


def _scan(step, params, h0, x, iters, max_iters, tol, halt, min_iters, key, truncate,
          step_index, step_outputs):
  """The masked scan; `truncate=(steps, k)` stops gradients before the last k."""
  leaves = jax.tree_util.tree_leaves(h0)
  batch = leaves[0].shape[0]
  iters = max_iters if iters is None else iters
  n = jnp.clip(jnp.broadcast_to(jnp.asarray(iters), (batch,)), 0, max_iters)
  n = n.astype(jnp.int32)
  n_elems = sum(int(np.prod(a.shape[1:])) for a in leaves)

  if key is not None:
    key_words = pl_random.key_data(key)
    rows = jnp.arange(batch, dtype=jnp.int32)[:, None]

  def per_row(mask, leaf):
    return mask.reshape((batch,) + (1,) * (leaf.ndim - 1))

  def body(carry, t):
    h, residual, steps, halted = carry
    extra = {}
    if key is not None:
      extra["key"] = pl_random.step_keys(key_words, rows, jnp.full((batch, 1), t, jnp.int32))
    if step_index:
      extra["index"] = t
    h_new = step(params, h, x, **extra)
    y = None
    if step_outputs:
      h_new, y = h_new
    active = (t < n) & ~halted
    squares = sum(
        jnp.sum(jnp.square(a.astype(jnp.float32) - b.astype(jnp.float32)).reshape(batch, -1), axis=1)
        for a, b in zip(jax.tree_util.tree_leaves(h_new), jax.tree_util.tree_leaves(h)))
    rms = jnp.sqrt(squares / max(n_elems, 1))
    met = jnp.zeros((batch,), bool)
    if tol is not None:
      met = met | (rms <= tol)
    if halt is not None:
      met = met | jnp.reshape(halt(params, h_new, h, x), (batch,))
    halted = halted | (active & met & (t + 1 >= min_iters))
    residual = jnp.where(active, rms, residual)
    steps = steps + active.astype(jnp.int32)
    if truncate is not None:
      applied, k = truncate
      frozen = t + 1 <= applied - k  # this step's result precedes the last k
      h_new, y = jax.tree_util.tree_map(
          lambda a: jnp.where(per_row(frozen, a), lax.stop_gradient(a), a), (h_new, y))
    h = jax.tree_util.tree_map(
        lambda new, old: jnp.where(per_row(active, old), new, old), h_new, h)
    y = jax.tree_util.tree_map(lambda a: jnp.where(per_row(active, a), a, jnp.zeros_like(a)), y)
    return (h, residual, steps, halted), y

  init = (h0, jnp.zeros((batch,), jnp.float32), jnp.zeros((batch,), jnp.int32),
          jnp.zeros((batch,), bool))
  (h, residual, steps, halted), ys = lax.scan(body, init,
                                              jnp.arange(max_iters, dtype=jnp.int32))
  return h, residual, steps, halted, ys
