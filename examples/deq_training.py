"""Training a DEQ layer whose map is not a contraction, with per-row quasi-Newton solves.

    python examples/deq_training.py [--quick] [--implementation xla|pallas]

The layer h* = tanh(h* W + x U + b) starts with W of spectral radius 1.2, so
plain iteration does not converge on most rows. `pallas_loop.deq.fixed_point`
solves every row with a quasi-Newton solver (Broyden, the default; each row
halts on its own residual), and differentiates the map at the fixed point
(`ImplicitAdjoint`, whose adjoint solve uses the same solver). The script
prints:

1. at initialisation: the per-row spectral radius of df/dh at the solution,
   how many rows plain iteration, Anderson and Broyden solve, their step counts;
2. the implicit gradient against backpropagation through the solver
   (`UnrolledAdjoint`), as a relative difference;
3. a few hundred optax Adam steps with each gradient (and the implicit one with
   Anderson): loss, forward and adjoint step counts per row and the rows that did
   not converge, both counted inside the jitted step (the adjoint's through
   `deq.adjoint_probe`, no host callback), NaN check.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import pallas_loop
from pallas_loop import deq

D, DX, DY = 32, 16, 4


def layer(params, h, x):
  """The DEQ map f(params, h, x) = tanh(h W + x U + b), on a tile of rows."""
  return jnp.tanh(h @ params["w"] + x @ params["u"] + params["b"])


def make_problem(batch: int, radius: float = 1.2, seed: int = 0):
  """Parameters (W of spectral radius `radius`), inputs and regression targets."""
  k = jax.random.split(jax.random.key(seed), 6)
  w = np.asarray(jax.random.normal(k[0], (D, D))) / np.sqrt(D)
  w = w * (radius / np.max(np.abs(np.linalg.eigvals(w))))
  params = {"w": jnp.asarray(w, jnp.float32),
            "u": jax.random.normal(k[1], (DX, D)) / np.sqrt(DX),
            "b": jnp.zeros((D,)),
            "v": jax.random.normal(k[2], (D, DY)) / np.sqrt(D)}
  x = 0.3 * jax.random.normal(k[3], (batch, DX))
  targets = jnp.sin(3.0 * x @ jax.random.normal(k[4], (DX, DY)) / np.sqrt(DX))
  return params, x, targets


def jacobian_radius(params, h, x) -> np.ndarray:
  """Per-row spectral radius of df/dh at h (numpy eigenvalues of each row's D x D Jacobian)."""
  jac = jax.vmap(lambda hr, xr: jax.jacobian(lambda z: layer(params, z[None], xr[None])[0])(hr))(
      h, x)
  return np.max(np.abs(np.linalg.eigvals(np.asarray(jac, np.float64))), axis=-1)


def solve(params, x, solver, *, tol, max_iters, adjoint=None, implementation=None):
  """The DEQ's fixed point for each row of x, with its SolveInfo."""
  return deq.fixed_point(layer, params, jnp.zeros((x.shape[0], D)), x, solver=solver, tol=tol,
                         max_iters=max_iters, adjoint=adjoint, on_failure="ignore",
                         return_info=True,
                         options=pallas_loop.Options(implementation=implementation))


def loss_fn(params, x, targets, solver, adjoint, tol, max_iters, implementation):
  h, info = solve(params, x, solver, tol=tol, max_iters=max_iters, adjoint=adjoint,
                  implementation=implementation)
  return jnp.mean(jnp.square(h @ params["v"] - targets)), info


def _steps(s) -> str:
  s = np.asarray(s)
  return f"{s.min()}/{int(np.median(s))}/{s.max()}"


def train(params, x, targets, adjoint, *, steps, tol, max_iters, implementation, solver,
          lr=3e-3):
  """Adam on the regression loss; returns the losses and per-step solver statistics.

  Both solves' statistics come back from the jitted step as arrays: the forward's
  SolveInfo as an output, the adjoint's as the gradient of an adjoint probe (no
  host callback).
  """
  opt = optax.adam(lr)
  implicit = isinstance(adjoint, deq.ImplicitAdjoint)
  if implicit:
    adjoint = deq.ImplicitAdjoint(on_failure="ignore")

  def loss_with_probe(params, probe):
    h, info = deq.fixed_point(layer, params, jnp.zeros((x.shape[0], D)), x, solver=solver,
                              tol=tol, max_iters=max_iters, adjoint=adjoint,
                              on_failure="ignore", return_info=True,
                              adjoint_probe=probe if implicit else None,
                              options=pallas_loop.Options(implementation=implementation))
    return jnp.mean(jnp.square(h @ params["v"] - targets)), info

  @jax.jit
  def update(params, state):
    (loss, info), (grads, g_probe) = jax.value_and_grad(
        loss_with_probe, argnums=(0, 1), has_aux=True)(params, deq.adjoint_probe(x.shape[0]))
    # optax's bias correction mixes a float and an int32 power, which strict
    # dtype promotion (the tests) rejects: relax it for the optimizer only.
    with jax.numpy_dtype_promotion("standard"):
      updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss, info, deq.SolveInfo.from_probe(
        g_probe)

  state = opt.init(params)
  losses, infos, adjoint_infos = [], [], []
  for _ in range(steps):
    params, state, loss, info, adjoint_info = update(params, state)
    losses.append(float(loss))
    infos.append(jax.tree_util.tree_map(np.asarray, info))
    if implicit:
      adjoint_infos.append(jax.tree_util.tree_map(np.asarray, adjoint_info))
  return params, np.array(losses), infos, adjoint_infos


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="16 rows, 30 steps (the test)")
  parser.add_argument("--implementation", default=None, choices=[None, "pallas", "xla"])
  args = parser.parse_args(argv)
  batch, train_steps = (16, 30) if args.quick else (64, 300)
  tol, max_iters = 1e-4, 100
  params, x, targets = make_problem(batch)
  impl = args.implementation

  # 1. At initialisation: plain iteration against the accelerated solvers.
  print(f"{batch} rows, D={D}; spectral radius of W at init: "
        f"{np.max(np.abs(np.linalg.eigvals(np.asarray(params['w'])))):.2f}")
  for name, solver in [("plain iteration", deq.Damped(1.0)), ("Anderson(m=5)", deq.Anderson(m=5)),
                       ("Broyden(m=20)", deq.Broyden())]:
    h, info = solve(params, x, solver, tol=tol, max_iters=max_iters, implementation=impl)
    print(f"  {name:16s}: {int(info.converged.sum()):3d}/{batch} rows converged, "
          f"steps min/median/max {_steps(info.steps)}")
  radius = jacobian_radius(params, h, x)
  print(f"  spectral radius of df/dh at the fixed point, per row: min/median/max "
        f"{radius.min():.2f}/{np.median(radius):.2f}/{radius.max():.2f}; "
        f"{int((radius > 1).sum())} rows > 1")

  # 2. Implicit gradient of the map against backpropagation through the solver.
  for solver_name, solver in [("Anderson(m=5)", deq.Anderson(m=5)), ("Broyden(m=20)", deq.Broyden())]:
    grads = {}
    for name, adjoint in [("implicit", deq.ImplicitAdjoint(tol=1e-6, max_iters=200)),
                          ("unrolled", deq.UnrolledAdjoint())]:
      grads[name] = jax.grad(lambda p: loss_fn(p, x, targets, solver, adjoint,
                                                1e-6, 200, impl)[0])(params)
    diff = {k: float(jnp.linalg.norm(grads["implicit"][k] - grads["unrolled"][k])
                     / jnp.linalg.norm(grads["unrolled"][k])) for k in ("w", "u", "b")}
    print(f"relative difference implicit vs unrolled gradient through {solver_name} at init "
          "(tol 1e-6): " + ", ".join(f"{k} {v:.1e}" for k, v in diff.items()))

  # 3. Training with each gradient, and the implicit one with each solver.
  ok = True
  # The unrolled gradient goes through Anderson: Broyden's H is a constant of that
  # backward and, in directions its steps never explored, the unrolled tangent
  # iteration is plain iteration, which diverges on this map (printed above).
  runs = [("implicit", deq.ImplicitAdjoint(), deq.Broyden()),
          ("implicit, Anderson(m=5)", deq.ImplicitAdjoint(), deq.Anderson(m=5)),
          ("unrolled, Anderson(m=5)", deq.UnrolledAdjoint(), deq.Anderson(m=5))]
  for name, adjoint, solver in runs:
    start = time.perf_counter()
    _, losses, infos, adjoint_infos = train(params, x, targets, adjoint, steps=train_steps,
                                            tol=tol, max_iters=max_iters, implementation=impl,
                                            solver=solver)
    seconds = time.perf_counter() - start
    fwd_steps = np.stack([i.steps for i in infos])
    not_conv = sum(int((~i.converged).sum()) for i in infos)
    marks = sorted({0, train_steps // 3, 2 * train_steps // 3, train_steps - 1})
    line = (f"{name}: loss " + " -> ".join(f"{losses[i]:.4f}" for i in marks)
            + f" (steps {', '.join(map(str, marks))}) in {train_steps} Adam steps "
            f"({seconds:.1f} s); forward steps per row min/median/max {_steps(fwd_steps)}; "
            f"forward rows not converged {not_conv} of {fwd_steps.size}")
    if adjoint_infos:
      adj = np.stack([i.steps for i in adjoint_infos])
      adj_bad = sum(int((~i.converged).sum()) for i in adjoint_infos)
      line += (f"; adjoint steps per row min/median/max {_steps(adj)}, "
               f"not converged {adj_bad}")
    print(line)
    finite = bool(np.all(np.isfinite(losses)))
    ok &= finite and losses[-1] < 0.5 * losses[0]
  print("OK" if ok else "FAILED")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
