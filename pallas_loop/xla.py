"""The XLA implementation: one `lax.while_loop` over the whole batch.

Finished rows are frozen by masking (`masking.run_loop`, the same logic as
the kernel), and the loop stops when no row is running any more, so the batch
pays for its slowest row rather than `max_iters`. This is the default on CPU
and the fallback elsewhere.
"""

from __future__ import annotations

from jax import lax
import jax.numpy as jnp

from pallas_loop import masking


def forward(body, params, h0, x, counts, halting):
  """Runs the rows of the batch to their budgets or halting.

  Args:
    body: body(params, h, x, t, rows) -> (h_new, flag), row independent.
    params, h0, x: operands (h0/x leaves [B, ...]).
    counts: int32 [B], already clipped to [0, max_iters].
    halting: None or `masking.Halting`.

  Returns:
    (h, residual, steps, halted): final state; float32, int32, bool [B].
  """
  rows = lax.broadcasted_iota(jnp.int32, (counts.shape[0], 1), 0)
  s = masking.run_loop(body, params, h0, x, counts[:, None], rows, halting,
                       masking.elems_per_row(h0))
  return s.h, s.residual[:, 0], s.steps[:, 0], s.halted[:, 0] > 0
