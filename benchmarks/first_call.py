"""First-call time of a small DEQ's `jit(value_and_grad)`: `iterate` against
optimistix's `fixed_point` and equinox's checkpointed while loop.

    python -m benchmarks.first_call                 # B=32 and 64, D=32, 5 rounds
    python -m benchmarks.first_call --batch 256 --rounds 3

What a user sees the first time their training step runs: tracing and
lowering (the library's Python) plus XLA's compile, each the median over
`--rounds` with JAX's caches cleared between rounds. The map is
`h <- tanh(h @ W + x)` with ||W||_2 = 0.9 (a contraction), tol 1e-5, at most
50 steps, the implicit gradient. optimistix and equinox are optional (the
`deq-bench` extra or `pip install optimistix`); a missing one is reported, not
timed. Run time per call is printed too, so a cut in compile time is seen
against what it costs at run time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

import pallas_loop

D, MAX_ITERS, TOL = 32, 50, 1e-5


def _problem(batch: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  k = jax.random.split(jax.random.key(0), 2)
  w = jax.random.normal(k[0], (D, D))
  w = 0.9 * w / jnp.linalg.norm(w, 2)
  return w, jax.random.normal(k[1], (batch, D)), jnp.zeros((batch, D))


def _step(w, h, x):
  return jnp.tanh(h @ w + x)


def losses(h0: jax.Array) -> dict[str, Callable[[Any, Any], Any] | str]:
  """Loss functions of (w, x) per implementation, or why one is missing."""
  out: dict[str, Callable[[Any, Any], Any] | str] = {}

  def iterate(w, x):
    h = pallas_loop.iterate(_step, w, h0, x, max_iters=MAX_ITERS, tol=TOL,
                            grad=pallas_loop.Implicit())
    return jnp.sum(h ** 2)

  out["pallas_loop.iterate"] = iterate
  try:
    import optimistix as optx  # pylint: disable=g-import-not-at-top
  except ImportError:
    out["optimistix.fixed_point"] = "not installed (pip install optimistix)"
  else:
    def fixed_point(w, x):
      sol = optx.fixed_point(lambda h, a: _step(a[0], h, a[1]),
                             optx.FixedPointIteration(rtol=TOL, atol=TOL), h0, (w, x),
                             max_steps=MAX_ITERS, throw=False)
      return jnp.sum(sol.value ** 2)

    out["optimistix.fixed_point"] = fixed_point
  try:
    import equinox as eqx  # pylint: disable=g-import-not-at-top
  except ImportError:
    out["equinox while_loop"] = "not installed (pip install equinox)"
  else:
    def while_loop(w, x):
      body = lambda c: (_step(w, c[0], x), c[1] + 1)
      h, _ = eqx.internal.while_loop(lambda c: c[1] < MAX_ITERS, body, (h0, 0),
                                     max_steps=MAX_ITERS, kind="checkpointed")
      return jnp.sum(h ** 2)

    out["equinox while_loop"] = while_loop
  return out


def measure(loss: Callable[[Any, Any], Any], w: jax.Array, x: jax.Array,
            rounds: int) -> dict[str, float]:
  """Median lowering, compile and run seconds of jit(value_and_grad(loss))."""
  lower, compile_, run = [], [], []
  for _ in range(rounds):
    jax.clear_caches()
    t0 = time.perf_counter()
    lowered = jax.jit(jax.value_and_grad(loss)).lower(w, x)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    lower.append(t1 - t0)
    compile_.append(t2 - t1)
    jax.block_until_ready(compiled(w, x))
    t3 = time.perf_counter()
    for _ in range(10):
      jax.block_until_ready(compiled(w, x))
    run.append((time.perf_counter() - t3) / 10)
  return {"lower": statistics.median(lower), "compile": statistics.median(compile_),
          "run": statistics.median(run)}


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, nargs="+", default=[32, 64])
  parser.add_argument("--rounds", type=int, default=5)
  args = parser.parse_args(argv)
  print(f"jax {jax.__version__}, backend {jax.default_backend()}, D={D}, "
        f"max_iters={MAX_ITERS}, tol={TOL}, medians of {args.rounds} rounds")
  print(f"{'B':>5s} {'implementation':24s} {'lower s':>8s} {'compile s':>9s} {'total s':>8s} "
        f"{'vs optimistix':>13s} {'run ms':>8s}")
  for batch in args.batch:
    w, x, h0 = _problem(batch)
    results: dict[str, dict[str, float]] = {}
    for name, loss in losses(h0).items():
      if isinstance(loss, str):
        print(f"{batch:5d} {name:24s} {loss}")
        continue
      results[name] = measure(loss, w, x, args.rounds)
    base = results.get("optimistix.fixed_point")
    for name, r in results.items():
      total = r["lower"] + r["compile"]
      ratio = f"{total / (base['lower'] + base['compile']):.2f}x" if base else "-"
      print(f"{batch:5d} {name:24s} {r['lower']:8.2f} {r['compile']:9.2f} {total:8.2f} "
            f"{ratio:>13s} {r['run'] * 1e3:8.2f}")


if __name__ == "__main__":
  main()
