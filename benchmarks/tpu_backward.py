"""The TPU backward's checkpoint interval: `jax.grad` through `iterate` against the masked scan.

    python -m benchmarks.tpu_backward [--out every.jsonl] [--every 16,32,128]

For the `jax.grad` cases of `gpu_check`'s TPU suite (`cases.tpu_suite`: the
tanh RNN, B=32768, D=128, bfloat16, recurrent-depth counts at T=128 and
constant counts at T=64), `iterate` with `grad=Full(checkpoint_every=K)`
against the masked scan's `jax.grad`, timed inside one `jit` as `gpu_check`
times (`harness.run_case`: chained applications, the floor left out) and
checked against it. K at least the window (`max_iters`) runs no checkpointing
pass: each row's states are recomputed once, from the window's start; the
default K is about sqrt(T) (`loop_reverse.default_every`: the fewest states
held). Each line: the case, K, and `harness.run_case`'s record (seconds,
speedup over the masked scan, ns per useful row-step, max error), or the
error of a variant that failed. Exits non-zero on a mismatch or a failure.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import pallas_loop
from benchmarks import cases
from benchmarks import device_timing
from benchmarks import harness


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=None, help="JSON lines, one per implementation and K")
  parser.add_argument("--every", default=None,
                      help="comma-separated K (default: 16,32,128 at T=128; 16,64 at T=64)")
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args(argv)
  write = device_timing.json_lines(args.out)
  bad = 0
  for case in (c for c in cases.tpu_suite() if c.grad is not None):
    if args.every:
      intervals = tuple(int(k) for k in args.every.split(","))
    else:
      intervals = (16, 32, 128) if case.max_iters == 128 else (16, 64)
    for every in intervals:
      variant = dataclasses.replace(case, grad=pallas_loop.Full(checkpoint_every=every))
      start = time.time()
      try:
        rows = harness.run_case(variant, ["pallas"], repeats=args.repeats)
      except Exception as e:  # pylint: disable=broad-except
        rows = [{"impl": "pallas", "ok": False, "error": repr(e)[:2000]}]
      for r in rows:
        record = {k: (str(v) if k == "grad" else v) for k, v in r.items()}
        record.update(case_label=case.label, every=every, wall=time.time() - start)
        write(record)
        bad += not record.get("ok", False)
  print(f"tpu_backward: {bad} line(s) failed or mismatched")
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
