"""Kernel time per tile height (`block_rows`), to check the default heuristic.

    python -m benchmarks.tiles                    # the CPU target cases, interpret mode
    python -m benchmarks.tiles --gpu              # B=4096, D=128, bf16 (gpu_check runs this)
    python -m benchmarks.tiles --tpu              # B=4096/32768, 128-2048 rows (gpu_check on a TPU)
    python -m benchmarks.tiles --tpu-keyed        # keyed steps (dropout), 128-1024 rows

Runs `pallas_loop.tuning.tune_block_rows` on recurrent-depth and uniform
counts and prints, per case, the median forward time at each candidate, the
fastest and the backend's default. On CPU the kernel runs in interpret mode,
so these times say how the interpreter's per-program cost trades against
sorted-tile work efficiency, not how a compiled kernel behaves.
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp

from benchmarks import blocks
from benchmarks import cases
from benchmarks import harness
import pallas_loop
from pallas_loop import _reference as reference
from pallas_loop import tuning


def _dropout(step):
  """`step` followed by `pallas_loop.random.dropout` of the new state (10%):
  a keyed step, whose kernel draws its random bits in the loop."""
  def keyed(params, h, x, *, key):
    return jax.tree.map(lambda a: pallas_loop.random.dropout(key, a, 0.1), step(params, h, x))
  return keyed


def sweep(batch: int, d: int, dtype, candidates, repeats: int,
          distributions=("recurrent_depth",), blocks_=("tanh_rnn", "residual_mlp"),
          with_scan: bool = False, keyed: bool = False) -> list[dict]:
  """One row per (block, distribution): seconds per block_rows, best, default
  (and, `with_scan`, the masked scan's seconds on the same inputs); `keyed`:
  the blocks with dropout after each step (`key=`)."""
  out = []
  for block in blocks_:
    step, params, h0, x = blocks.make(block, batch, d, dtype, jax.random.key(5))
    kw, label = {}, block
    if keyed:
      step, kw = _dropout(step), {"key": jax.random.key(7)}
      label = f"{block} + dropout (keyed)"
    for counts in distributions:
      t_max = cases.DEFAULT_MAX_ITERS[counts]
      n = jnp.asarray(cases.count_distribution(counts, batch, t_max, 5))
      r = tuning.tune_block_rows(step, params, h0, x, iters=n, max_iters=t_max,
                                 candidates=candidates, repeats=repeats, **kw)
      default = harness.pallas_block_rows(batch)
      scan = None
      if with_scan:
        scan = harness.median_seconds(jax.jit(functools.partial(
            reference.iterate, step, iters=n, max_iters=t_max, **kw)), params, h0, x,
            repeats=repeats)
      times = "  ".join(f"{k}: {v * 1e3:.3f} ms" for k, v in sorted(r.seconds.items()))
      print(f"block_rows {label} B={batch} D={d} {jnp.dtype(dtype).name} {counts}: {times}; "
            f"best {r.best}, default {default}"
            + (f"; masked scan {scan * 1e3:.3f} ms" if scan is not None else "")
            + (f"; rejected {sorted(r.rejected)}" if r.rejected else ""), flush=True)
      out.append(dict(block=block, keyed=keyed, batch=batch, d=d, counts=counts,
                      seconds=r.seconds,
                      best=r.best, default=default, rejected=r.rejected,
                      masked_scan_seconds=scan))
  return out


def gpu_sweep(repeats: int) -> list[dict]:
  """The H200 sweep: B=4096, D=128, bf16, block_rows 16 / 32 / 64."""
  return sweep(4096, 128, jnp.bfloat16, (16, 32, 64), repeats)


def tpu_sweep(repeats: int, batches=(4096, 32768)) -> list[dict]:
  """The TPU sweep: D=128, bf16, block_rows 128 to 2048, three count
  distributions, beside the masked scan. A TPU core runs the grid's tiles
  one after another, so a tile's step is a chain of dependent matrix-unit
  and vector work whose latency a taller tile amortises."""
  out = []
  for batch in batches:
    out += sweep(batch, 128, jnp.bfloat16, (128, 256, 512, 1024, 2048), repeats,
                 distributions=("constant", "uniform", "recurrent_depth"),
                 blocks_=("tanh_rnn", "gru", "residual_mlp"), with_scan=True)
  return out


def tpu_keyed_sweep(repeats: int) -> list[dict]:
  """Keyed steps on a TPU (dropout after the tanh RNN and GRU), B=4096,
  D=128, bf16, 128 to 1024 rows, beside the masked scan: the random bits
  are drawn in the loop, per row, so a taller tile draws more per step."""
  return sweep(4096, 128, jnp.bfloat16, (128, 256, 512, 1024), repeats,
               distributions=("uniform",), blocks_=("tanh_rnn", "gru"), with_scan=True,
               keyed=True)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--gpu", action="store_true", help="B=4096, D=128, bf16, 16/32/64 rows")
  parser.add_argument("--tpu", action="store_true",
                      help="B=4096 and 32768, D=128, bf16, 128 to 2048 rows, with the masked scan")
  parser.add_argument("--tpu-keyed", action="store_true",
                      help="keyed steps (dropout), B=4096, D=128, bf16, 128 to 1024 rows")
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args(argv)
  print(f"JAX {jax.__version__}, {jax.devices()[0].device_kind}")
  if args.gpu:
    gpu_sweep(args.repeats)
  elif args.tpu:
    tpu_sweep(args.repeats)
  elif args.tpu_keyed:
    tpu_keyed_sweep(args.repeats)
  else:
    sweep(1024, 64, jnp.float32, (8, 16, 32, 64), args.repeats,
          distributions=("uniform", "recurrent_depth"))
  return 0


if __name__ == "__main__":
  sys.exit(main())
