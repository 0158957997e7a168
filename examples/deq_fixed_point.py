"""A deep-equilibrium layer run to its fixed point with `tol`, per row.

    python examples/deq_fixed_point.py [--quick]

h* = tanh(W h* + U x + b) is found by iterating the layer until each row's
update has rms <= tol. Rows converge after different numbers of steps (W is
scaled to spectral norm 0.9, a contraction; inputs with larger norm saturate tanh and
converge faster), and each row stops on its own: the kernel stops a tile when
all its rows have converged. Prints the per-row step histogram, checks the
result against `reference.iterate` and that h* is a fixed point.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

import pallas_loop
from pallas_loop import _reference as reference


def deq_layer(params, h, x):
  w, u, b = params
  z = jnp.dot(h, w, preferred_element_type=jnp.float32) + jnp.dot(x, u, preferred_element_type=jnp.float32)
  return jnp.tanh(z + b).astype(h.dtype)


def make_problem(batch: int, d: int, seed: int = 0):
  k = jax.random.split(jax.random.key(seed), 4)
  w = jax.random.normal(k[0], (d, d))
  # Spectral norm 0.9: with tanh 1-Lipschitz, the layer is a contraction, so every
  # row converges (a spectral radius < 1 alone lets some rows oscillate).
  w = w * (0.9 / jnp.linalg.norm(w, ord=2))
  u = jax.random.normal(k[1], (d, d)) / jnp.sqrt(d)
  b = jnp.zeros((d,))
  # Per-row input scale spreads the convergence speed across rows.
  x = jax.random.normal(k[2], (batch, d)) * jnp.linspace(0.1, 3.0, batch)[:, None]
  return (w, u, b), jnp.zeros((batch, d)), x


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="small sizes (used by the tests)")
  parser.add_argument("--implementation", default=None, choices=[None, "pallas", "xla"])
  args = parser.parse_args(argv)
  batch, d, max_iters, tol = (64, 16, 100, 1e-5) if args.quick else (1024, 64, 200, 1e-6)

  params, h0, x = make_problem(batch, d)
  options = pallas_loop.Options(implementation=args.implementation)
  run = jax.jit(lambda p, h, x: pallas_loop.iterate(
      deq_layer, p, h, x, iters=max_iters, max_iters=max_iters, tol=tol, return_info=True,
      options=options))
  h_star, info = run(params, h0, x)

  steps = np.asarray(info.steps)
  print(f"{batch} rows, D={d}, tol={tol:g}, max_iters={max_iters}: "
        f"{int(info.halted.sum())} converged, steps min/median/max = "
        f"{steps.min()}/{int(np.median(steps))}/{steps.max()}")
  counts, edges = np.histogram(steps, bins=min(10, max(1, steps.max() - steps.min() + 1)))
  for c, lo, hi in zip(counts, edges[:-1], edges[1:]):
    print(f"  steps {lo:6.1f}-{hi:6.1f} | {'#' * int(np.ceil(40 * c / batch))} {c}")
  print(f"work: {steps.sum()} row-steps of {batch * max_iters} for a masked scan "
        f"(ideal speedup {batch * max_iters / steps.sum():.1f}x)")

  want = reference.iterate(deq_layer, params, h0, x, iters=max_iters, max_iters=max_iters,
                           tol=tol, return_info=True)
  err = float(jnp.max(jnp.abs(h_star - want[0])))
  fixed_point_gap = float(jnp.max(jnp.abs(deq_layer(params, h_star, x) - h_star)))
  print(f"max |h - reference| = {err:.2e}; max |f(h*) - h*| = {fixed_point_gap:.2e}")
  ok = (err <= 1e-5 and np.array_equal(steps, want[1].steps) and bool(info.halted.all())
        and fixed_point_gap <= 10 * tol)
  print("OK" if ok else "MISMATCH")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
