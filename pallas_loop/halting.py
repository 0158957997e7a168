"""Ready halting criteria for `iterate(..., halt=...)`.

A criterion is `halt(params, h_new, h, x) -> bool [rows]`, evaluated on every
update; a row halts after the first update that meets it (once `min_iters`
steps have been applied). The criteria here use only row-wise arithmetic and
reductions over trailing axes, so they run inside the Pallas kernels too.
`tol=` of `iterate` is the absolute test `rms(h_new - h) <= tol`; these cover
the other common cases.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax import tree_util
import jax.numpy as jnp

from pallas_loop._src import loop as loop_lib

Criterion = Callable[[Any, Any, Any, Any], jax.Array]


def _row_sum(a: jax.Array) -> jax.Array:
  """[R, ...] -> [R]: sum over the trailing axes, one at a time (lowers everywhere)."""
  while a.ndim > 1:
    a = jnp.sum(a, axis=-1)
  return a


def row_rms(tree: Any) -> jax.Array:
  """Root-mean-square over all elements of each row of `tree`, in float32.

  Args:
    tree: a pytree of arrays [R, ...] (e.g. the state `h`).

  Returns:
    float32 [R]: sqrt(mean of squares over every element of the row, all
    leaves together).

  Examples:
    >>> import jax.numpy as jnp
    >>> from pallas_loop import halting
    >>> halting.row_rms(jnp.array([[3.0, 4.0], [0.0, 0.0]]))
    Array([3.535534, 0.      ], dtype=float32)
  """
  squares = sum(_row_sum(jnp.square(a.astype(jnp.float32)))
                for a in tree_util.tree_leaves(tree))
  return jnp.sqrt(squares * (1.0 / max(loop_lib.elems_per_row(tree), 1)))


def relative_change(rtol: float, atol: float = 0.0) -> Criterion:
  """Halts a row once `rms(h_new - h) <= rtol * rms(h) + atol`.

  Scale-free convergence, for states whose magnitude varies across rows.
  The rms is over all state elements of the row, in float32.

  Args:
    rtol: relative tolerance (>= 0).
    atol: absolute floor (>= 0), so a state converging to 0 still halts.

  Returns:
    A criterion for `iterate(..., halt=...)`.

  Examples:
    >>> import jax.numpy as jnp, pallas_loop
    >>> step = lambda w, h, x: 0.5 * h + x            # converges to 2x
    >>> h0, x = jnp.zeros((2, 3)), jnp.ones((2, 3))
    >>> halt = pallas_loop.halting.relative_change(1e-3)
    >>> h, info = pallas_loop.iterate(step, None, h0, x, max_iters=100,
    ...                               halt=halt, return_info=True)
    >>> info.steps
    Array([10, 10], dtype=int32)
  """
  if not (rtol >= 0 and atol >= 0):
    raise ValueError(f"{rtol=} and {atol=} must be >= 0.")

  def halt(params: Any, h_new: Any, h: Any, x: Any) -> jax.Array:
    del params, x
    diff = tree_util.tree_map(lambda a, b: a.astype(jnp.float32) - b.astype(jnp.float32),
                              h_new, h)
    return row_rms(diff) <= rtol * row_rms(h) + atol

  return halt


def below(score: Callable[[Any, Any, Any, Any], jax.Array], threshold: float) -> Criterion:
  """Halts a row once a per-row score of the update is <= threshold.

  Turns any per-row scalar you compute from an update into a criterion:
  e.g. the KL divergence between the output distributions of successive
  steps (PonderNet/ACT-style exits), or a task-specific confidence gap.

  Args:
    score: score(params, h_new, h, x) -> float [rows]. Must be row-wise and
      lowerable inside the kernel (see `iterate`).
    threshold: the row halts when score <= threshold (NaN never halts).

  Returns:
    A criterion for `iterate(..., halt=...)`.

  Examples:
    >>> import jax, jax.numpy as jnp, pallas_loop
    >>> def kl(params, h_new, h, x):         # successive softmax outputs
    ...   p = jax.nn.log_softmax(h_new @ params)
    ...   q = jax.nn.log_softmax(h @ params)
    ...   return jnp.sum(jnp.exp(p) * (p - q), axis=-1)
    >>> halt = pallas_loop.halting.below(kl, 1e-4)
  """

  def halt(params: Any, h_new: Any, h: Any, x: Any) -> jax.Array:
    s = score(params, h_new, h, x)
    return s.reshape(s.shape[0]) <= threshold

  return halt


def any_of(*criteria: Criterion) -> Criterion:
  """Halts a row when any of `criteria` holds (e.g. converged OR confident).

  Args:
    *criteria: one or more `halt(params, h_new, h, x) -> bool [rows]`
      criteria (e.g. from this module).

  Returns:
    A criterion: the elementwise OR of theirs.

  Examples:
    >>> from pallas_loop import halting
    >>> rms = lambda params, h_new, h, x: halting.row_rms(h_new - h)
    >>> halt = halting.any_of(halting.relative_change(1e-3),
    ...                       halting.below(rms, 1e-4))
  """
  if not criteria:
    raise ValueError("any_of needs at least one criterion.")

  def halt(params: Any, h_new: Any, h: Any, x: Any) -> jax.Array:
    flags = [c(params, h_new, h, x) for c in criteria]
    out = flags[0]
    for f in flags[1:]:
      out = out | f
    return out

  return halt
