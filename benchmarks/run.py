"""The main job: every implementation on the default workload, checked and timed.

    python -m benchmarks.run            # CPU-safe default (< 2 min)
    python -m benchmarks.run --json out.json

Runs the masked-scan reference, vmap(while_loop), the XLA implementation and
the Pallas kernel (interpret mode on CPU, compiled on GPU/TPU) on a tanh-RNN
cell and a residual MLP with ragged counts, and a deep-equilibrium layer that
halts on convergence (`tol`; there the ideal uses the steps rows took); checks each against the reference
and exits non-zero on a mismatch; prints median time, speedup vs the masked
scan and vs vmap(while_loop), and the ideal speedup B*max_iters/sum(n_i).
"""

from __future__ import annotations

import argparse
import json
import sys

import jax

from benchmarks import harness

DEFAULT_CASES = (
    harness.Case("tanh_rnn", batch=256, d=64, max_iters=32, counts="uniform"),
    harness.Case("residual_mlp", batch=256, d=64, max_iters=32, counts="uniform"),
    harness.Case("tanh_rnn", batch=256, d=64, max_iters=32, counts="bimodal"),
    # Halting: a deep-equilibrium layer run to rms(update) <= tol within 64 steps.
    harness.Case("deq", batch=256, d=64, max_iters=64, counts="constant", tol=1e-5),
)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", help="also write the results to this file")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--impls", default=",".join(harness.IMPLEMENTATIONS),
                      help="comma-separated subset (masked_scan always runs first)")
  args = parser.parse_args(argv)
  impls = ["masked_scan"] + [i for i in args.impls.split(",") if i != "masked_scan"]

  device = jax.devices()[0]
  print(f"pallas_loop benchmarks: JAX {jax.__version__}, device {device.device_kind} "
        f"({jax.default_backend()})")
  if jax.default_backend() == "cpu":
    print("note: on CPU the Pallas kernel runs in interpret mode (a correctness "
          "check, not a speed claim); ratios are from one run, medians of "
          f"{args.repeats}.")
  results = []
  for case in DEFAULT_CASES:
    results += harness.run_case(case, impls, args.repeats)
  harness.print_table(results)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(jax=jax.__version__, device=device.device_kind, results=results), f, indent=1)
  bad = [r for r in results if not r["ok"]]
  for r in bad:
    print(f"MISMATCH: {r['impl']} on {r['case']}: max error {r['max_error']:.3e}",
          file=sys.stderr)
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
