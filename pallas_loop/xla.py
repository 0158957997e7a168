"""The XLA implementation: `lax.while_loop`s that skip finished rows.

Rows are ordered so that the running ones form a prefix, and each step runs
the body only on that prefix, padded to one of a few static bucket sizes
(`buckets.py`), so the work tracks sum(n_i), not B * max(n_i). With halting,
running rows are compacted to the front at each bucket change. Per row the
semantics are those of `masking.run_loop` (shared with the kernel). This is
the default on CPU and the fallback elsewhere.
"""

from __future__ import annotations

from pallas_loop import buckets


def forward(body, params, h0, x, counts, row_ids, halting, residual=True):
  """Runs the rows of the batch to their budgets or halting.

  Args:
    body: body(params, h, x, t, rows) -> (h_new, flag), row independent.
    params, h0, x: operands (h0/x leaves [B, ...]).
    counts: int32 [B], already clipped to [0, max_iters].
    row_ids: int32 [B], each row's index in the caller's batch.
    halting: None or `masking.Halting`.
    residual: track each row's last residual (else it is returned as 0).

  Returns:
    (h, residual, steps, halted): final state; float32, int32, bool [B].
  """
  return buckets.forward(body, params, h0, x, counts, row_ids, halting, residual)
