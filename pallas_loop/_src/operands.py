"""The bundles that travel from `iterate` to the implementations and back.

`LoopOperands` is what every forward takes (and what the custom_vjp
differentiates), `LoopOutputs` what it returns; `WindowOperands` is what
every backward (the VJP of a per-row window of steps) takes. The caller's
static choice of how to run travels beside them as one `options.Options`.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class Halting(NamedTuple):
  """Halting operands (a pytree), as arrays broadcastable against [R, 1].

  Whether a `halt=` criterion is used is not stored: the body's flag output
  is None without one.
  """

  tol: Any        # float32, or None: no tolerance test
  min_iters: Any  # int32


# The cotangents of (params, consts, h0 or h_start, x) every backward returns.
Gradients = tuple[Any, list, Any, Any]


class LoopOperands(NamedTuple):
  """The operands of the loop over a batch of B rows.

  The fields are typed Any: as a pytree the same tuple also carries their
  cotangents (None for the integer ones) and their shard_map specs.
  """

  params: Any   # pytree shared by every row
  consts: Any   # the arrays `step` closes over (`step_fn.py`)
  h0: Any       # pytree of [B, ...]: the initial state
  x: Any        # pytree of [B, ...] or None: constant inputs
  counts: Any   # int32 [B]: step budgets, in [0, max_iters]
  row_ids: Any  # int32 [B]: each row's index in the caller's batch
  halting: Any  # Halting, or None: apply exactly `counts` steps


class LoopOutputs(NamedTuple):
  """What the loop returns, in the caller's row order."""

  h: Any         # pytree like h0: the final state
  residual: Any  # float32 [B]: rms of each row's last update
  steps: Any     # int32 [B]: steps applied
  halted: Any    # bool [B]: a criterion (not the budget) stopped the row
  ys: Any = None  # pytree of [B, T, ...]: per-step outputs, or None


class WindowOperands(NamedTuple):
  """A per-row window of steps to differentiate: row r starts in state
  `h_start[r]` and applies `n[r]` steps, with step indices `t0[r]`, ...;
  `g` is the cotangent of the state after the window."""

  params: Any
  consts: Any
  h_start: Any  # pytree of [B, ...]
  x: Any        # pytree of [B, ...] or None
  t0: Any       # int32 [B]
  n: Any        # int32 [B]
  row_ids: Any  # int32 [B]
  g: Any        # pytree like h_start
  g_ys: Any = None  # cotangents of the per-step outputs [B, T, ...], or None
