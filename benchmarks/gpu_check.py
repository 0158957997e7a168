"""The one script for an H200 (or any GPU/TPU): compile, check, time the suite.

    python -m benchmarks.gpu_check --out results.json     # on the accelerator
    python -m benchmarks.gpu_check --smoke                # tiny, any machine

1. Compiles the Pallas kernel (forward, and forward+backward) for the local
   accelerator and checks it against `reference.iterate` on fresh random
   inputs, with padded rows poisoned with NaN so a leak shows.
2. Times pallas vs the masked scan vs vmap(lax.while_loop) vs the XLA
   implementation on `cases.gpu_suite()`: B=4096, D in {128, 256}, bfloat16,
   tanh RNN / GRU / residual MLP over every count distribution (forward, and
   forward+backward on the recurrent-depth counts), a transformer block (XLA
   path); prints the table (ratios within this run, medians, work
   efficiency, useful GFLOP/s) and writes JSON (and a PNG with --plot).
3. Times the kernel at block_rows 16 / 32 / 64 (`benchmarks/tiles.py`) on
   recurrent-depth counts, to check the default tile heuristic.
Exits non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp

import pallas_loop
import reference
from benchmarks import blocks
from benchmarks import cases
from benchmarks import grad_modes
from benchmarks import harness
from benchmarks import plot
from benchmarks import tiles
from pallas_loop import rows


def check_gradients(case: harness.Case) -> float:
  """Max |grad(pallas) - grad(masked scan)| w.r.t. params, poisoned padding."""
  step, params, h0, x = blocks.make(case.block, case.batch + 3, case.d, jnp.dtype(case.dtype),
                                    jax.random.key(11))
  n = jnp.asarray(harness.count_distribution(case.counts, case.batch + 3, case.max_iters, 11))

  def loss(run, p):
    out = run(step, p, h0, x, iters=n, max_iters=case.max_iters)
    return jnp.sum(jnp.tanh(out.astype(jnp.float32)))

  with rows.poisoned_padding():
    got = jax.jit(jax.grad(lambda p: loss(
        lambda *a, **k: pallas_loop.iterate(*a, implementation="pallas", **k), p)))(params)
  want = jax.jit(jax.grad(lambda p: loss(reference.iterate, p)))(params)
  return harness.max_error(got, want)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smoke", action="store_true", help="tiny cases, runs anywhere")
  parser.add_argument("--out", default=None, help="JSON output path")
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--plot", default=None, help="PNG of speedup vs ideal (matplotlib)")
  args = parser.parse_args(argv)

  start = time.time()
  device = jax.devices()[0]
  print(f"gpu_check: JAX {jax.__version__}, {device.device_kind} ({jax.default_backend()})")
  suite = list(cases.smoke_suite() if args.smoke else cases.gpu_suite())
  results, grad_errors, bad = [], {}, []
  for case in suite:
    with rows.poisoned_padding():
      results += harness.run_case(case, None, 1 if args.smoke else args.repeats,
                                  seed=len(results))
  for case in [c for c in suite if c.grad is None and c.impls is None][:2]:
    err = check_gradients(case)
    grad_errors[case.label] = err
    tol = harness.tolerance(case.dtype, case.max_iters) * 100
    print(f"gradient check {case.label}: max error {err:.3e} (tolerance {tol:.1e})")
    if not err <= tol:
      bad.append(f"gradient {case.label}")
  harness.print_table(results)
  bad += [f"{r['impl']} {r['case']}" for r in results if not r["ok"]]
  # Every gradient mode, forward kernel + fused backward kernel vs jit(grad)
  # of the masked scan: time and compiled memory.
  grad_cases = grad_modes.scaled_cases(*((16, 16) if args.smoke else (4096, 128)))
  grad_rows = grad_modes.run_all(["xla", "pallas"], 1 if args.smoke else args.repeats,
                                 cases=grad_cases)
  grad_modes.print_table(grad_rows)
  bad += [f"{r['impl']} gradient {r['case']}" for r in grad_rows if not r["ok"]]
  tile_rows = (tiles.sweep(64, 16, jnp.bfloat16, (8, 16), 1) if args.smoke else
               tiles.gpu_sweep(args.repeats))
  if args.plot and plot.have_matplotlib():
    plot.speedup_plot(results, args.plot, f"{device.device_kind}, JAX {jax.__version__}")
  payload = dict(jax=jax.__version__, device=device.device_kind,
                 backend=jax.default_backend(), seconds=time.time() - start,
                 results=results, gradient_max_errors=grad_errors, grad_modes=grad_rows,
                 block_rows_sweep=tile_rows)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(payload, f, indent=1)
  print(f"total {payload['seconds']:.0f} s")
  for b in bad:
    print(f"MISMATCH: {b}", file=sys.stderr)
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
