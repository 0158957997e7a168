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
steps computed), each case's rows as it finishes; then one line saying whether
every implementation matched. The quick suite: B=1024, D=64, uniform[1,64] and
recurrent-depth-like counts, tanh RNN and residual MLP, a halting DEQ layer and
a forward+backward case; then the gradient-mode table of
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
  suite = cases.SUITES[args.suite]()
  print(f"pallas_loop benchmarks ({args.suite}): JAX {jax.__version__}, device "
        f"{device.device_kind} ({jax.default_backend()}); {len(suite)} cases, each "
        f"compiled, checked against the masked scan and timed (applications chained "
        f"inside one jit, medians of {args.repeats} round-robin calls; ratios within "
        "this run). Columns:")
  print(harness.COLUMNS)
  print()
  # Each case's rows are printed as it finishes (a case takes seconds).
  harness.print_header()
  results = []
  for case in suite:
    rows = harness.run_case(case, impls, args.repeats)
    harness.print_rows(rows)
    results += rows
  grad_rows = []
  if not args.no_grad_modes:
    print("\nForward+backward per gradient mode (jit(grad(loss)), vs the masked scan's):",
          flush=True)
    grad_impls = [i for i in impls if i in ("xla", "pallas")]
    grad_cases = (grad_modes.scaled_cases(16, 16) if args.suite == "smoke"
                  else grad_modes.DEFAULT_CASES)
    grad_modes.print_header()
    for grad_case in grad_cases:
      rows = grad_modes.run_case(grad_case, grad_impls, args.repeats)
      grad_modes.print_rows(rows)
      grad_rows += rows
    grad_modes.print_legend()
  seconds = time.time() - start
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
  print(check_summary(results, grad_rows))
  print(f"total {seconds:.0f} s")
  return 1 if bad or bad_grads else 0


def check_summary(results: list[dict], grad_rows: list[dict]) -> str:
  """The run's verdict in one line: did every implementation match the reference?

  Args:
    results: `harness.run_case` rows (the masked scan's own rows included).
    grad_rows: `grad_modes.run_case` rows (may be empty).

  Returns:
    "check: every implementation matched ..." with the largest errors, or
    "check: N MISMATCHES ..." naming how many.

  Example:
    >>> row = dict(impl="xla", case="c", ok=True, max_error=0.0)
    >>> check_summary([dict(row, impl="masked_scan"), row], [])
    'check: every implementation matched the masked scan: 1 case, 1 implementation, largest scaled error 0'
  """
  compared = [r for r in results if r["impl"] != "masked_scan"]
  checked_grads = [r for r in grad_rows if r["checked"]]
  bad = [r for r in compared if not r["ok"]] + [r for r in checked_grads if not r["ok"]]
  if bad:
    return (f"check: {len(bad)} MISMATCHES against the masked scan (listed above); "
            "the figures of those rows mean nothing")
  n_cases = len({r["case"] for r in compared})
  n_impls = len({r["impl"] for r in compared})
  line = (f"check: every implementation matched the masked scan: {n_cases} "
          f"case{'s' * (n_cases != 1)}, {n_impls} implementation{'s' * (n_impls != 1)}, "
          f"largest scaled error {max((r['max_error'] for r in compared), default=0):.2g}")
  if checked_grads:
    worst = max(r.get("rel_diff_vs_ref_at_own_steps", r["rel_diff_vs_ref"])
                for r in checked_grads)
    line += (f"; {len(checked_grads)} exact gradients matched the reference's "
             f"(largest relative difference {worst:.2g})")
  return line


if __name__ == "__main__":
  sys.exit(main())
