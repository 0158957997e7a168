"""The one script for an H200 (or any GPU/TPU): compile, check, time. < 8 min.

    python -m benchmarks.gpu_check --out results.json     # on the accelerator
    python -m benchmarks.gpu_check --smoke                # tiny, any machine

1. Compiles the Pallas kernel (forward, and forward+backward) for the local
   accelerator and checks it against `reference.iterate` on fresh random
   inputs, with padded rows poisoned with NaN so a leak shows.
2. Times pallas vs the masked scan vs vmap(lax.while_loop) vs the XLA
   implementation in float32 and bfloat16 at B=4096, D in {128, 256}, and
   prints the table (ratios within this run, medians) and writes JSON.
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
from benchmarks import harness
from pallas_loop import rows


def full_cases(batch: int = 4096):
  for dtype in ("float32", "bfloat16"):
    for d in (128, 256):
      for block in ("tanh_rnn", "residual_mlp"):
        for counts in ("uniform", "bimodal", "constant"):
          yield harness.Case(block, batch, d, 32, counts, dtype)


def smoke_cases():
  yield harness.Case("tanh_rnn", 64, 16, 8, "uniform", "float32")
  yield harness.Case("residual_mlp", 64, 16, 8, "bimodal", "bfloat16")


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
  args = parser.parse_args(argv)

  start = time.time()
  device = jax.devices()[0]
  print(f"gpu_check: JAX {jax.__version__}, {device.device_kind} ({jax.default_backend()})")
  cases = list(smoke_cases() if args.smoke else full_cases())
  results, grad_errors, bad = [], {}, []
  for case in cases:
    with rows.poisoned_padding():
      results += harness.run_case(case, list(harness.IMPLEMENTATIONS),
                                  1 if args.smoke else args.repeats, seed=len(results))
  for case in cases[:2]:
    err = check_gradients(case)
    grad_errors[case.label] = err
    tol = harness.tolerance(case.dtype, case.max_iters) * 100
    print(f"gradient check {case.label}: max error {err:.3e} (tolerance {tol:.1e})")
    if not err <= tol:
      bad.append(f"gradient {case.label}")
  harness.print_table(results)
  bad += [f"{r['impl']} {r['case']}" for r in results if not r["ok"]]
  payload = dict(jax=jax.__version__, device=device.device_kind,
                 backend=jax.default_backend(), seconds=time.time() - start,
                 results=results, gradient_max_errors=grad_errors)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(payload, f, indent=1)
  print(f"total {payload['seconds']:.0f} s")
  for b in bad:
    print(f"MISMATCH: {b}", file=sys.stderr)
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
