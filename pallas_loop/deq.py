"""Deep equilibrium layers: per-row fixed-point solvers with implicit gradients of the map.

`fixed_point(f, params, h0, x, solver=..., tol=..., max_steps=...)` solves
h = f(params, h, x) for each row with an accelerated solver, each row halting
on its own residual (one `pallas_loop.iterate` call), and differentiates the
map f at the solution (`ImplicitAdjoint`, the default), whatever solver found
it. Rows that do not converge, in the forward or the adjoint solve, are
reported (`on_failure`: a warning by default, or an error, or NaN rows). The
recipe, the solvers and the measured figures: the docs' "Deep equilibrium
models" page.

Solvers: `Anderson(m)` (the default), `Damped(beta)`, or a subclass of
`Solver` with its own state.
"""

from pallas_loop._src.deq_solve import (ImplicitAdjoint, NonConvergenceError,
                                        NonConvergenceWarning, SolveInfo, UnrolledAdjoint,
                                        fixed_point)
from pallas_loop._src.deq_solvers import Anderson, Damped, Solver

__all__ = ["Anderson", "Damped", "ImplicitAdjoint", "NonConvergenceError",
           "NonConvergenceWarning", "SolveInfo", "Solver", "UnrolledAdjoint", "fixed_point"]
