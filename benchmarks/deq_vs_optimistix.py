"""The same DEQ solved by `pallas_loop.deq` and by `optimistix`, timed in one run.

    pip install -e ".[deq-bench]"     # optimistix: a benchmark extra only
    python -m benchmarks.deq_vs_optimistix [--rows 256] [--dim 32] [--max-steps 100] [--repeats 20]

The DEQ layer of `examples/deq_training.py` (h = tanh(h W + x U + b), W of
spectral radius 1.2: not a contraction) for a batch of rows, each row its own
fixed-point problem:

  deq.Broyden       pallas_loop.deq.fixed_point, Broyden(m=20) (the default),
                    XLA loop, ImplicitAdjoint (Broyden adjoint), each row
                    halting on rms(f(h) - h) <= tol
  deq.Anderson      the same with Anderson(m=5)
  optx.Newton       jax.vmap over rows of optimistix.fixed_point with Newton
                    and ImplicitAdjoint (the while loop under vmap runs until
                    the slowest row is done)
  optx.FixedPoint   the same with optimistix.FixedPointIteration (plain
                    iteration: the map is not a contraction)

Printed per solver: forward and forward+backward (jax.grad of a weighted sum of
h*) median times and their ratio to optx.Newton, map evaluations or solver
steps per row (min/median/max), rows converged, the largest rms(f(h) - h), and
the relative difference of the gradients from optx.Newton's (w.r.t. (W, U, b),
and per row w.r.t. x over the rows both converged).
The optimistix solvers stop on their own criterion (|dh| <= atol + rtol |h|
in the max norm, set here to atol = tol), at least as strict as the rms one.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

import pallas_loop
from pallas_loop import deq
from pallas_loop import tuning

DX = 16


def layer(params, h, x):
  """f(params, h, x) = tanh(h W + x U + b) on rows of h: [R, D], x: [R, DX]."""
  return jnp.tanh(h @ params["w"] + x @ params["u"] + params["b"])


def make_problem(rows: int, dim: int = 32, radius: float = 1.2, seed: int = 0):
  """Parameters with W of spectral radius `radius`, inputs and an output weighting.

  Example:
    >>> params, x, g = make_problem(4, dim=32)
    >>> params["w"].shape, x.shape, g.shape
    ((32, 32), (4, 16), (4, 32))
  """
  k = jax.random.split(jax.random.key(seed), 4)
  w = np.asarray(jax.random.normal(k[0], (dim, dim))) / np.sqrt(dim)
  w = w * (radius / np.max(np.abs(np.linalg.eigvals(w))))
  params = {"w": jnp.asarray(w, jnp.float32),
            "u": jax.random.normal(k[1], (DX, dim)) / np.sqrt(DX),
            "b": jnp.zeros((dim,))}
  x = 0.3 * jax.random.normal(k[2], (rows, DX))
  g = jax.random.normal(k[3], (rows, dim))
  return params, x, g


def ours(tol: float, max_steps: int, solver: deq.Solver):
  """Forward (h*, steps per row, converged) with pallas_loop.deq."""

  def solve(params, x):
    h0 = jnp.zeros((x.shape[0], params["w"].shape[0]))
    h, info = deq.fixed_point(layer, params, h0, x,
                              solver=solver, tol=tol, max_iters=max_steps,
                              on_failure="ignore", return_info=True,
                              options=pallas_loop.Options(implementation="xla"))
    return h, info.steps, info.converged

  return solve


def optimistix_solver(name: str, tol: float, max_steps: int):
  """Forward (h*, steps per row, converged) with optimistix, vmapped over rows."""
  import optimistix as optx  # pylint: disable=g-import-not-at-top

  solver = (optx.Newton(rtol=1e-8, atol=tol) if name == "optx.Newton"
            else optx.FixedPointIteration(rtol=1e-8, atol=tol))

  def solve_row(params, x_row):
    fn = lambda h, args: layer(args[0], h[None], args[1][None])[0]
    h0 = jnp.zeros(params["w"].shape[:1])
    sol = optx.fixed_point(fn, solver, h0, (params, x_row), max_steps=max_steps,
                           adjoint=optx.ImplicitAdjoint(), throw=False)
    return sol.value, sol.stats["num_steps"], sol.result == optx.RESULTS.successful

  return jax.vmap(solve_row, in_axes=(None, 0))


def run(rows: int = 256, dim: int = 32, repeats: int = 20, tol: float = 1e-5,
        max_steps: int = 100) -> list[dict]:
  """Times every solver on the same problem; returns one dict per solver."""
  params, x, g = make_problem(rows, dim)
  solvers = {"deq.Broyden": ours(tol, max_steps, deq.Broyden()),
             "deq.Anderson": ours(tol, max_steps, deq.Anderson(m=5)),
             "optx.Newton": optimistix_solver("optx.Newton", tol, max_steps),
             "optx.FixedPoint": optimistix_solver("optx.FixedPoint", tol, max_steps)}
  results = []
  for name, solve in solvers.items():
    forward = jax.jit(solve)
    grad = jax.jit(jax.grad(lambda p, xx, s=solve: jnp.sum(g * s(p, xx)[0]), argnums=(0, 1)))
    h, steps, converged = forward(params, x)
    residual = np.sqrt(np.mean(np.square(np.asarray(layer(params, h, x) - h)), axis=-1))
    results.append(dict(
        name=name, forward_s=tuning.median_seconds(forward, params, x, repeats=repeats),
        grad_s=tuning.median_seconds(grad, params, x, repeats=repeats), steps=np.asarray(steps),
        converged=np.asarray(converged), residual=float(residual.max()),
        grad=grad(params, x)))
  return results


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, default=256)
  parser.add_argument("--dim", type=int, default=32, help="state size D per row")
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--max-steps", type=int, default=100, help="budget of every solver")
  args = parser.parse_args(argv)
  try:
    import optimistix  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    print('needs optimistix: pip install -e ".[deq-bench]"')
    return 1
  results = run(args.rows, args.dim, args.repeats, max_steps=args.max_steps)
  base = next(r for r in results if r["name"] == "optx.Newton")
  print(f"DEQ tanh(hW + xU + b), D={args.dim}, rows={args.rows}, W spectral radius 1.2, "
        f"tol 1e-5, max_steps {args.max_steps}; "
        f"{jax.devices()[0].device_kind}, JAX {jax.__version__}, medians of {args.repeats}")
  print(f"{'solver':16s} {'fwd ms':>8s} {'x Newton':>8s} {'fwd+bwd ms':>10s} {'x Newton':>8s} "
        f"{'steps min/med/max':>17s} {'converged':>9s} {'max rms(f-h)':>12s} "
        f"{'d(params)':>9s} {'d(x), conv':>10s}")
  for r in results:
    g_params, g_x = r["grad"]
    b_params, b_x = base["grad"]
    diff = max(float(jnp.linalg.norm(g_params[k] - b_params[k]) / jnp.linalg.norm(b_params[k]))
               for k in b_params)
    both = r["converged"] & base["converged"]
    row_diff = (np.linalg.norm(np.asarray(g_x - b_x), axis=-1)
                / np.linalg.norm(np.asarray(b_x), axis=-1))
    row_diff = float(row_diff[both].max()) if both.any() else float("nan")
    s = r["steps"]
    print(f"{r['name']:16s} {1e3 * r['forward_s']:8.2f} {base['forward_s'] / r['forward_s']:8.2f} "
          f"{1e3 * r['grad_s']:10.2f} {base['grad_s'] / r['grad_s']:8.2f} "
          f"{f'{s.min()}/{int(np.median(s))}/{s.max()}':>17s} "
          f"{int(r['converged'].sum()):>5d}/{len(s):<3d} {r['residual']:12.2e} {diff:9.1e} "
          f"{row_diff:10.1e}")
  print("x Newton: optx.Newton's time / this solver's (> 1: faster than optx.Newton).\n"
        "d(params): relative difference (2-norm, worst of W, U, b) of the gradient w.r.t. the\n"
        "parameters from optx.Newton's; d(x), conv: the largest per-row relative difference of\n"
        "the gradient w.r.t. x over the rows both solvers converged (a row's x gradient\n"
        "depends on that row alone).")
  return 0


if __name__ == "__main__":
  sys.exit(main())
