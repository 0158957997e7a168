"""Cost of one row-step as a function of how many rows a step runs on.

    python -m benchmarks.row_cost --block residual_mlp
    python -m benchmarks.row_cost --block tanh_rnn --bound

Row skipping assumes that a step on S rows costs S/B of a step on B rows. This
probe measures that assumption on the current machine: for S rows, the median
time of `steps` steps of the bare block in a `lax.fori_loop` (no masking), and
of `iterate(options=Options(implementation="xla"))` with S rows of count
`steps` and the others 0, both divided by steps*S. Prints one line per S.

`--bound` turns the measured costs into the best fraction of the ideal speedup
that *any* schedule running each row from step 0 on a padded prefix of rows can
reach on this machine (the XLA implementation's kind): with c(S) the bare
step cost on S rows (measured on a grid of S, every multiple of B/16) and a_t
the rows still running at trip t, such a schedule costs at least
sum_t min_{S >= a_t} c(S) (any bucket sizes, no masking, no stage overhead),
against the masked scan's measured time. If that bound is below a target, no
bucket ladder reaches the target here.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

import pallas_loop
from pallas_loop import _reference as reference
from benchmarks import blocks
from benchmarks import cases
from benchmarks import harness


def prefix_schedule_bound(counts, cost: dict[int, float]) -> float:
  """Least time of a prefix schedule: sum over trips of min_{S >= a_t} c(S).

  Args:
    counts: int [B], each row's steps.
    cost: S -> seconds of one step on S rows (must include S = B).

  Returns:
    Seconds.

  Example:
    >>> prefix_schedule_bound(np.array([2, 1]), {1: 1.0, 2: 1.5})
    2.5
  """
  counts = np.asarray(counts)
  sizes = sorted(cost)
  best = {}  # cheapest step that holds at least a rows
  for a in range(counts.size + 1):
    best[a] = min(cost[s] for s in sizes if s >= a)
  return float(sum(best[int((counts > t).sum())] for t in range(int(counts.max(initial=0)))))


def _bound(step, params, h0, x, bare, args) -> None:
  batch = args.batch
  grid = sorted({s for s in range(batch // 16, batch + 1, max(1, batch // 16))}
                | {s for s in (16, 32, 64) if s < batch} | {batch})
  cost = {s: harness.median_seconds(bare, h0[:s], x[:s], repeats=args.repeats) / args.steps
          for s in grid}
  print("bare step cost c(S), us: " + "  ".join(f"{s}:{c * 1e6:.1f}" for s, c in cost.items()))
  for name in ("uniform", "recurrent_depth"):
    t_max = cases.DEFAULT_MAX_ITERS[name]
    n = cases.count_distribution(name, batch, t_max)
    scan = jax.jit(lambda n_: reference.iterate(step, params, h0, x, iters=n_, max_iters=t_max))
    t_scan = harness.median_seconds(scan, jnp.asarray(n), repeats=args.repeats)
    ideal = batch * t_max / n.sum()
    t_best = prefix_schedule_bound(n, cost)
    print(f"{name:16s} masked scan {t_scan * 1e3:7.2f} ms, best prefix schedule "
          f"{t_best * 1e3:7.2f} ms: {t_scan / t_best:.2f}x of an ideal {ideal:.2f}x = "
          f"{t_scan / t_best / ideal:.2f} of the ideal at most")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--block", default="residual_mlp", choices=sorted(blocks.BLOCKS))
  parser.add_argument("--batch", type=int, default=1024)
  parser.add_argument("--d", type=int, default=64)
  parser.add_argument("--steps", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=15)
  parser.add_argument("--bound", action="store_true",
                      help="the best fraction of the ideal a prefix schedule can reach here")
  args = parser.parse_args(argv)
  step, params, h0, x = blocks.make(args.block, args.batch, args.d, jnp.float32,
                                    jax.random.key(0))
  print(f"{args.block} D={args.d}, {args.steps} steps, JAX {jax.__version__}, "
        f"{jax.devices()[0].device_kind}; microseconds per row-step")
  # `steps` steps of the bare block: no masking, no buckets.
  bare = jax.jit(lambda h, x_: jax.lax.fori_loop(0, args.steps,
                                                 lambda i, h: step(params, h, x_), h))
  if args.bound:
    _bound(step, params, h0, x, bare, args)
    return 0
  run = jax.jit(lambda n: pallas_loop.iterate(step, params, h0, x, iters=n,
                                              max_iters=args.steps,
                                              options=pallas_loop.Options(implementation="xla")))
  sizes = [s for s in (16, 32, 64, 128, 256, 512, 1024, 2048, 4096) if s <= args.batch]
  for s in sizes:
    n = jnp.asarray(np.where(np.arange(args.batch) < s, args.steps, 0), jnp.int32)
    per = 1e6 / (args.steps * s)  # seconds -> microseconds per row-step
    t_iter = harness.median_seconds(run, n, repeats=args.repeats) * per
    t_bare = harness.median_seconds(bare, h0[:s], x[:s], repeats=args.repeats) * per
    print(f"S={s:5d}  bare fori_loop {t_bare:.3f}  iterate(xla) {t_iter:.3f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
