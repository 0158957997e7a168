"""The implicit adjoint: the one core behind `grad=Implicit` and `deq.ImplicitAdjoint`.

# R: rows of a tile (any count)

At a per-row fixed point h* = f(shared, h*, per_row), the cotangent g of h*
reaches (shared, per_row) as u df/d(shared, per_row) at h*, where u solves
the adjoint fixed point u = g + u df/dh(h*), row by row. `vjp` is that rule:
the adjoint map as an `iterate` step (`adjoint_step`), solved by the caller's
`Solve`, then the pull-back through f alone (`pull_back`). Only the float
leaves of the state carry an adjoint (counters and flags have no derivative),
and only float leaves of (shared, per_row) get a cotangent (None elsewhere).

What differs between the two callers is how the adjoint fixed point is
solved, and that is their `Solve`:

  * `grad=Implicit` (`grad_modes.Implicit`): `iterate`'s plain iteration
    u <- g + u df/dh, halting per row at rms(update) <= tol (absolute), within
    its budget, no steps for a row that applied none forward; no statistics.
  * `pallas_loop.deq` (`deq_solve.ImplicitAdjoint`): the DEQ's row solve
    (`deq_solve.solve_rows`: Broyden, Anderson, ... on the adjoint map),
    halting at a tolerance relative to each row's rms(g), returning its
    `SolveInfo`, which the DEQ reports by its policy and returns through
    `adjoint_probe`.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from jax import tree_util

from pallas_loop._src import loop_reverse

# The map on a tile: (shared, h [R, ...], per_row [R, ...]) -> h_new like h.
Map = Callable[[Any, Any, Any], Any]


class Solve(Protocol):
  """How a caller solves the adjoint fixed point: `solve(step, shared, g,
  per_row) -> (u, info)`, iterating `step(shared, u, per_row)` per row from
  `g` (as `iterate`'s step, params and state), `info` the solve's
  statistics (None where it keeps none)."""

  def __call__(self, step: Callable[[Any, Any, Any], Any], shared: Any, g: Any,
               per_row: Any) -> tuple[Any, Any]:
    ...


def adjoint_step(fmap: Map) -> Callable[[Any, Any, Any], Any]:
  """The adjoint map u -> g + u df/dh(h*) as an `iterate` step.

  Args:
    fmap: the map f on a tile.

  Returns:
    `step(shared, u, (h_star, per_row, g))`: `u` and `g` hold the float
    leaves of the state (any pytree of them, the same for both: a list of
    leaves, or one [R, D] array); the result has `g`'s structure.
  """

  def step(shared: Any, u: Any, rows: Any) -> Any:
    h_star, per_row, g = rows
    (d_h,) = loop_reverse.vjp_of_floats(lambda h: fmap(shared, h, per_row), (h_star,),
                                        tree_util.tree_leaves(u))
    sums = [a + b for a, b in zip(tree_util.tree_leaves(g), loop_reverse.float_leaves(d_h))]
    return tree_util.tree_unflatten(tree_util.tree_structure(g), sums)

  return step


def pull_back(fmap: Map, shared: Any, h_star: Any, per_row: Any, u: Any) -> tuple[Any, Any]:
  """u df/d(shared, per_row) at h*: (cotangent of shared, of per_row), None at
  their non-float leaves (`loop_reverse.vjp_of_floats`)."""
  g_shared, g_per_row = loop_reverse.vjp_of_floats(
      lambda s, r: fmap(s, h_star, r), (shared, per_row), tree_util.tree_leaves(u))
  return g_shared, g_per_row


def vjp(fmap: Map, shared: Any, h_star: Any, per_row: Any, g: Any, solve: Solve,
        settle: Callable[[Any, Any], Any] | None = None) -> tuple[Any, Any, Any]:
  """The implicit-function VJP at the fixed point `h_star` of `fmap`.

  Args:
    fmap: the map f on a tile: (shared, h, per_row) -> h_new.
    shared: the operands every row shares (differentiated).
    h_star: the fixed point, [B, ...] per leaf.
    per_row: the rows' constant operands, [B, ...] per leaf (differentiated
      at its float leaves; integer ones such as step indices or key data are
      carried as they are).
    g: the cotangent of h*'s float leaves: a list of them, or one [B, D]
      array; u has its structure.
    solve: how the adjoint fixed point is solved (`Solve`).
    settle: None, or `settle(u, info) -> u`, applied between the solve and
      the pull-back: what the caller does with rows of u (zero those that
      took no step; report, NaN those that did not converge).

  Returns:
    (cotangent of shared, cotangent of per_row, the solve's info).

  Example:
    >>> import jax.numpy as jnp
    >>> from pallas_loop._src import implicit_adjoint
    >>> f = lambda w, h, x: 0.5 * h * w + x  # h* = 2x at w = 1; df/dh = w / 2
    >>> def plain(step, shared, g, rows):  # 50 steps of u <- g + u df/dh
    ...   u = g
    ...   for _ in range(50):
    ...     u = step(shared, u, rows)
    ...   return u, None
    >>> x = jnp.ones((2, 3))
    >>> g_w, g_x, _ = implicit_adjoint.vjp(f, jnp.float32(1.0), 2 * x, x, jnp.ones((2, 3)),
    ...                                    plain)
    >>> float(g_w), g_x[0, 0].item()  # d(sum h*)/dw = sum(x / (1 - w/2)^2 / 2), dh*/dx = 2
    (12.0, 2.0)
  """
  u, info = solve(adjoint_step(fmap), shared, g, (h_star, per_row, g))
  if settle is not None:
    u = settle(u, info)
  g_shared, g_per_row = pull_back(fmap, shared, h_star, per_row, u)
  return g_shared, g_per_row, info
