"""The XLA implementation: one `lax.while_loop` over the whole batch.

Finished rows are frozen by masking (`masking.run_loop`, the same logic as
the kernel), and the loop stops when no row is running any more, so the batch
pays for its slowest row rather than `max_iters`. This is the default on CPU
and the fallback elsewhere.
"""

from __future__ import annotations

from pallas_loop import masking


def forward(body, params, h0, x, counts, row_ids, halting):
  """Runs the rows of the batch to their budgets or halting.

  Args:
    body: body(params, h, x, t, rows) -> (h_new, flag), row independent.
    params, h0, x: operands (h0/x leaves [B, ...]).
    counts: int32 [B], already clipped to [0, max_iters].
    row_ids: int32 [B], each row's index in the caller's batch.
    halting: None or `masking.Halting`.

  Returns:
    (h, residual, steps, halted): final state; float32, int32, bool [B].
  """
  s = masking.run_loop(body, params, h0, x, counts[:, None], row_ids[:, None], halting,
                       masking.elems_per_row(h0))
  return s.h, s.residual[:, 0], s.steps[:, 0], s.halted[:, 0] > 0
