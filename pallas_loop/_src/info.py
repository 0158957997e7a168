"""`IterateInfo`: the per-row statistics `iterate(..., return_info=True)` returns."""

from __future__ import annotations

from typing import NamedTuple

import jax


class IterateInfo(NamedTuple):
  """Per-row statistics of one `pallas_loop.iterate` call.

  A NamedTuple, so it is a pytree: it passes through `jit`, `vmap` and
  `tree_map` like the state does. None of its fields is differentiated.

  Attributes:
    steps: int32 [B], how many times `step` was applied to each row.
    residual: float32 [B], root-mean-square over all state elements of the
      row's last update `h_new - h`, computed in float32; 0 where no step ran.
      A non-finite update reports NaN or inf.
    halted: bool [B], True where a halting criterion (`tol`/`halt`, not the
      step budget) stopped the row, including on its last budgeted step.

  Examples:
    >>> import jax.numpy as jnp, pallas_loop
    >>> step = lambda params, h, x: h * 0.5
    >>> n = jnp.array([-1, 3, 20])
    >>> h, info = pallas_loop.iterate(step, None, jnp.ones((3, 2)), iters=n,
    ...                               max_iters=8, return_info=True)
    >>> info.steps      # == clip(n, 0, 8)
    Array([0, 3, 8], dtype=int32)
  """

  steps: jax.Array
  residual: jax.Array
  halted: jax.Array
