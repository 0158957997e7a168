"""Cost of one row-step as a function of how many rows a step runs on.

    python -m benchmarks.row_cost --block residual_mlp

Row skipping assumes that a step on S rows costs S/B of a step on B rows. This
probe measures that assumption on the current machine: for S rows, the median
time of 64 steps of the bare block in a `lax.fori_loop` (no masking), and of
`iterate(implementation="xla")` with S rows of count 64 and the others 0,
both divided by 64*S. Prints one line per S.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

import pallas_loop
from benchmarks import blocks
from benchmarks import harness


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--block", default="residual_mlp", choices=sorted(blocks.BLOCKS))
  parser.add_argument("--batch", type=int, default=1024)
  parser.add_argument("--d", type=int, default=64)
  parser.add_argument("--steps", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=15)
  args = parser.parse_args(argv)
  step, params, h0, x = blocks.make(args.block, args.batch, args.d, jnp.float32,
                                    jax.random.key(0))
  run = jax.jit(lambda n: pallas_loop.iterate(step, params, h0, x, iters=n,
                                              max_iters=args.steps, implementation="xla"))
  bare = jax.jit(lambda h, x_: jax.lax.fori_loop(0, args.steps,
                                                 lambda i, h: step(params, h, x_), h))
  print(f"{args.block} D={args.d}, {args.steps} steps, JAX {jax.__version__}, "
        f"{jax.devices()[0].device_kind}; microseconds per row-step")
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
