"""The main job: every implementation on named cases, checked and timed.

    python -m benchmarks.run                      # quick default (< 2 min on CPU)
    python -m benchmarks.run --suite full         # every block/width/distribution
    python -m benchmarks.run --json out.json --plot speedup.png

Runs the masked-scan reference, vmap(while_loop), the XLA implementation and
the Pallas kernel (interpret mode on CPU, compiled on GPU/TPU) in one process
on the cases of `benchmarks/cases.py`; checks each against the masked scan and
exits non-zero on a mismatch; prints per case the median time, the speedup vs
the masked scan and vs vmap(while_loop), the ideal speedup B*max_iters/sum(n_i),
the fraction of it achieved and the work efficiency (useful row-steps / row-
steps computed). The quick suite is the issue's CPU target (B=1024, D=64,
uniform[1,64] and recurrent-depth-like counts, tanh RNN and residual MLP), a
halting DEQ layer and a forward+backward case; then the gradient-mode table of
`benchmarks/grad_modes.py` (time and compiled memory of jit(grad) per mode vs
the masked scan's; skip with --no-grad-modes).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax

from benchmarks import cases
from benchmarks import grad_modes
from benchmarks import harness
from benchmarks import plot


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--suite", default="quick", choices=sorted(cases.SUITES))
  parser.add_argument("--json", help="also write the results to this file")
  parser.add_argument("--plot", help="write a PNG of speedup vs ideal (needs matplotlib)")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--no-grad-modes", action="store_true",
                      help="skip the gradient-mode table (benchmarks/grad_modes.py)")
  parser.add_argument("--impls", default=",".join(harness.IMPLEMENTATIONS),
                      help="comma-separated subset (masked_scan always runs first)")
  args = parser.parse_args(argv)
  impls = ["masked_scan"] + [i for i in args.impls.split(",") if i != "masked_scan"]
  unknown = set(impls) - set(harness.IMPLEMENTATIONS)
  if unknown:
    parser.error(f"unknown --impls {sorted(unknown)}; known: {list(harness.IMPLEMENTATIONS)}")

  start = time.time()
  device = jax.devices()[0]
  print(f"pallas_loop benchmarks ({args.suite}): JAX {jax.__version__}, device "
        f"{device.device_kind} ({jax.default_backend()}); medians of {args.repeats} "
        "round-robin calls; ratios within this run.")
  results = []
  for case in cases.SUITES[args.suite]():
    results += harness.run_case(case, impls, args.repeats)
  harness.print_table(results)
  grad_rows = []
  if not args.no_grad_modes:
    print("\nForward+backward per gradient mode (jit(grad(loss)), vs the masked scan's):")
    grad_impls = [i for i in impls if i in ("xla", "pallas")]
    grad_cases = (grad_modes.scaled_cases(16, 16) if args.suite == "smoke"
                  else grad_modes.DEFAULT_CASES)
    grad_rows = grad_modes.run_all(grad_impls, args.repeats, cases=grad_cases)
    grad_modes.print_table(grad_rows)
  seconds = time.time() - start
  print(f"total {seconds:.0f} s")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(jax=jax.__version__, device=device.device_kind,
                     backend=jax.default_backend(), suite=args.suite,
                     seconds=seconds, results=results, grad_modes=grad_rows), f, indent=1)
  if args.plot:
    if plot.have_matplotlib():
      interpret = " (pallas: interpret mode)" if jax.default_backend() == "cpu" else ""
      plot.speedup_plot(results, args.plot,
                        f"{device.device_kind}, JAX {jax.__version__}{interpret}")
      print(f"plot: {args.plot}")
    else:
      print("--plot: matplotlib is not installed (pip install .[bench]); no plot.")
  bad = [r for r in results if not r["ok"]]
  for r in bad:
    print(f"MISMATCH: {r['impl']} on {r['case']}: max error {r['max_error']:.3e}",
          file=sys.stderr)
  bad_grads = [r for r in grad_rows if not r["ok"]]
  for r in bad_grads:
    print(f"MISMATCH: {r['impl']} gradient on {r['case']}: relative difference "
          f"{r['rel_diff_vs_ref']:.3e}", file=sys.stderr)
  return 1 if bad or bad_grads else 0


if __name__ == "__main__":
  sys.exit(main())
