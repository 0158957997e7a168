"""Deep equilibrium solves (`pallas_loop.deq`): the solvers as per-row steps
(`deq_solvers`) and the fixed-point solve with its implicit adjoint
(`deq_solve`).
"""
