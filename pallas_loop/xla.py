"""The XLA implementation: a `lax.while_loop` to the batch's largest count.

Finished rows are frozen by masking (`masking.masked_step`, the same logic as
the kernel), and the loop stops when the slowest row is done, so the batch
pays for `max(counts)` steps rather than `max_iters`. This is the default on
CPU, the fallback elsewhere, and what the backward pass recomputes with.
"""

from __future__ import annotations

import jax
from jax import lax
from jax import tree_util
import jax.numpy as jnp
import numpy as np

from pallas_loop import masking


def elems_per_row(h) -> int:
  """Number of state elements in one row (over all leaves)."""
  return sum(int(np.prod(a.shape[1:])) for a in tree_util.tree_leaves(h))


def forward(step, params, h0, x, counts):
  """Applies `step` counts[i] times to row i.

  Args:
    step: step(params, h, x) -> h_new, row independent.
    params, h0, x: operands (h0/x leaves [B, ...]).
    counts: int32 [B], already clipped to [0, max_iters].

  Returns:
    (h, residual): final state and float32 [B] rms of each row's last update.
  """
  column = counts[:, None]
  n_elems = elems_per_row(h0)

  def body(t, carry):
    h, residual = carry
    active = t < column
    h, rms = masking.masked_step(step, params, h, x, active, n_elems)
    return h, jnp.where(active, rms, residual)

  residual = jnp.zeros(column.shape, jnp.float32)
  h, residual = lax.fori_loop(0, jnp.max(counts, initial=0), body, (h0, residual))
  return h, residual[:, 0]
