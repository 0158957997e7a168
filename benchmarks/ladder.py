"""Compile time against run time for the XLA forward's smallest stage.

    python -m benchmarks.ladder                          # MIN_ROWS 16,32,64,128, 5 rounds
    python -m benchmarks.ladder --min-rows 16,64 --rounds 2

Each stage of the XLA forward (`pallas_loop/_src/xla/xla_forward.py`) is one more
`lax.while_loop` for XLA to compile, and the ladder's smallest stages are
where rows that finish late (or halt late) stop paying for the whole
batch. `xla_forward.MIN_ROWS` sets the smallest stage. This runs the quick
suite's cases with the XLA implementation at each value, rounds
interleaved so that load on the machine hits every value alike, and prints
per case and value the medians of the fraction of the ideal speedup
(`benchmarks/harness.py`) and of the lowering + compile seconds.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
from unittest import mock

import jax

from benchmarks import cases
from benchmarks import harness
from pallas_loop._src.xla import xla_forward


def sweep(min_rows: list[int], rounds: int, repeats: int, suite: str = "quick") -> list[dict]:
  """One dict per (case, MIN_ROWS): medians over `rounds` of each measure."""
  seen: dict[tuple[str, int], list[dict]] = collections.defaultdict(list)
  stages = {}
  for _ in range(rounds):
    for value in min_rows:
      with mock.patch.object(xla_forward, "MIN_ROWS", value):
        for case in cases.SUITES[suite]():
          stages[case.label, value] = len(xla_forward.bucket_sizes(case.batch))
          for row in harness.run_case(case, ["masked_scan", "xla"], repeats):
            if row["impl"] == "xla":
              seen[case.label, value].append(row)
  out = []
  for (label, value), rows in seen.items():
    out.append(dict(
        case=label, min_rows=value, stages=stages[label, value],
        fraction_of_ideal=statistics.median(r["fraction_of_ideal"] for r in rows),
        compile_seconds=statistics.median(r["compile_seconds"] for r in rows),
        ok=all(r["ok"] for r in rows)))
  return sorted(out, key=lambda r: (r["case"], r["min_rows"]))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--min-rows", default="16,32,64,128", help="comma-separated values")
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--repeats", type=int, default=7, help="timed calls per case and round")
  parser.add_argument("--suite", default="quick", choices=sorted(cases.SUITES))
  args = parser.parse_args(argv)
  values = [int(v) for v in args.min_rows.split(",")]
  print(f"JAX {jax.__version__}, {jax.devices()[0].device_kind}; XLA implementation; "
        f"medians of {args.rounds} rounds")
  rows = sweep(values, args.rounds, args.repeats, args.suite)
  print(f"{'case':56s} {'MIN_ROWS':>8s} {'stages':>6s} {'of ideal':>8s} {'compile s':>9s}")
  for r in rows:
    print(f"{r['case']:56s} {r['min_rows']:8d} {r['stages']:6d} {r['fraction_of_ideal']:8.3f} "
          f"{r['compile_seconds']:9.2f}{'' if r['ok'] else '  MISMATCH'}")
  return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
