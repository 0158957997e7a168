"""Deep equilibrium layers: per-row fixed-point solvers with implicit gradients of the map.

`fixed_point(f, params, h0, x, solver=..., tol=..., max_iters=...)` solves
h = f(params, h, x) for each row with an accelerated solver, each row halting
on its own residual (one `pallas_loop.iterate` call), and differentiates the
map f at the solution (`ImplicitAdjoint`, the default), whatever solver found
it. With `key=`, f gets one key per row, fixed through the solve. Rows that
do not converge, in the forward or the adjoint solve, are reported
(`on_failure`: one warning per call site by default, or an error, or NaN
rows) and counted without host callbacks (`return_info`, `adjoint_probe`).
The recipe, the solvers and the measured figures: the docs' "Deep equilibrium
models" page.

Solvers: `Broyden(m)` (the default), `Anderson(m)`, `Damped(beta)`, their
names as strings ("broyden", "anderson", "damped"), or a subclass of
`Solver` with its own state.
"""

from pallas_loop._src.deq.deq_solve import (ImplicitAdjoint, NonConvergenceError,
                                        NonConvergenceWarning, SolveInfo, UnrolledAdjoint,
                                        adjoint_probe, fixed_point)
from pallas_loop._src.deq.deq_solvers import Anderson, Broyden, Damped, Solver

__all__ = ["Anderson", "Broyden", "Damped", "ImplicitAdjoint", "NonConvergenceError",
           "NonConvergenceWarning", "SolveInfo", "Solver", "UnrolledAdjoint", "adjoint_probe",
           "fixed_point"]
